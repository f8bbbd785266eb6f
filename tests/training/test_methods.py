"""``focus train --method`` on a tiny random LLaMA: each method trains exactly its
parameters, saves in its library's format and reloads to the same logits, resumes exactly;
LoRA rank matching; two-phase's phases; bad combinations; ``focus eval`` of every method's
output."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tiny_assets import tiny_config, use_tiny_assets

from focus_attention.evaluation import evaluate, markdown_table
from focus_attention.hf.run_folder import (
    apply_lora,
    load_trained_weights,
    run_parts,
    tensor_digests,
)
from focus_attention.training import TrainConfig, train
from focus_attention.training.methods import (
    build_trainee,
    lora_modules,
    match_lora_rank,
    phase_at,
)
from focus_attention.training.outputs import newest_checkpoint
from focus_attention.training.run import unfinished_output

METHODS = ("focus", "lora", "attention", "full", "focus+lora", "two-phase")
#: the tiny runs: 4 steps, validation at 0, 2 and 4, a checkpoint every step
RUN = dict(steps=4, eval_every=2, save_every=1, keep_checkpoints=5)


def _cfg(assets, out, method, **kw):
    settings = dict(RUN, method=method)
    if method in ("focus", "focus+lora", "two-phase"):
        settings["lr"] = 1e-2
    if method == "two-phase":
        settings["phase1_steps"] = 2
    settings.update(kw)
    return tiny_config(assets, out, **settings)


@pytest.fixture(scope="module")
def runs(module_assets, tmp_path_factory):
    """One uninterrupted run of every method (the references)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        for method in METHODS:
            d = tmp_path_factory.mktemp(method.replace("+", "-")) / "run"
            out[method] = train(_cfg(module_assets, d, method))
    return out


def _base(assets):
    from focus_attention.assets.models import load_model

    return load_model(assets["model"], quiet=True)


def _saved(out) -> dict[str, torch.Tensor]:
    """Every tensor a run saved (Focus adapter, LoRA, model), keyed by file and name."""
    files = {"focus": out / "focus_model.safetensors",
             "lora": out / "lora" / "adapter_model.safetensors",
             "model": out / "model" / "model.safetensors"}  # fmt: skip
    return {f"{k}:{n}": t for k, f in files.items() if f.is_file()
            for n, t in load_file(str(f)).items()}  # fmt: skip


def _attention_names(state) -> set[str]:
    return {n for n in state if ".self_attn." in n}


@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_its_parameters_and_only_those(assets, runs, method):
    res = runs[method]
    base, _ = _base(assets)
    names = set(base.state_dict())
    doc = json.loads((res.out / "train_result.json").read_text())
    weights, info = doc["extra"]["base_weights_sha256"], doc["extra"]["method"]
    assert info["method"] == method and res.trainable_parameters == info["trainable_parameters"]
    assert all(math.isfinite(v) for v in res.losses) and len(res.losses) == 4
    parts = run_parts(res.out)
    saved = _saved(res.out)
    routers = 2 * (32 * 8 + 4 * 8)
    if method in ("focus", "lora", "focus+lora"):
        assert weights["equal"] and weights["changed"] == []
        assert not parts["model"]
    elif method == "attention":
        assert set(weights["changed"]) == _attention_names(names)
        count = sum(p.numel() for n, p in base.named_parameters() if ".self_attn." in n)
        assert res.trainable_parameters == count
    else:  # full, two-phase: every base tensor moved
        assert set(weights["changed"]) == names and not weights["equal"]
    if method == "full":
        assert res.trainable_parameters == sum(p.numel() for p in base.parameters())
    assert parts["focus"] == (method in ("focus", "focus+lora", "two-phase"))
    assert parts["lora"] == (method in ("lora", "focus+lora"))
    assert parts["model"] == (method in ("attention", "full", "two-phase"))
    lora = {k: t for k, t in saved.items() if k.startswith("lora:")}
    if parts["lora"]:  # rank 8 on q, k, v, o; B starts at zero and moved
        assert info["lora"]["rank"] == 8 and info["lora"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]  # fmt: skip
        assert sum(t.numel() for t in lora.values()) == info["groups"]["lora"]
        assert all(t.abs().sum() > 0 for k, t in lora.items() if "lora_B" in k)
    if parts["focus"]:  # the routers moved from their seeded start
        from focus_attention.hf import get_focus_model

        start = get_focus_model(base, res_cfg(res).focus_config()).focus_state_dict()
        for k, v in start.items():
            if k.endswith((".proj", ".centroids")):
                assert not torch.equal(v, saved[f"focus:{k}"]), k
        assert info["groups"]["routers"] == routers
    expected = {"focus": routers, "focus+lora": routers + info["groups"].get("lora", 0)}
    if method in expected:
        assert res.trainable_parameters == expected[method]


def res_cfg(res) -> TrainConfig:
    return TrainConfig.from_dict(json.loads((res.out / "train_config.json").read_text()))


def test_two_phase_keeps_the_base_in_phase_1_and_changes_it_in_phase_2(runs):
    res = runs["two-phase"]
    assert res.extra["phase1_base_weights"] == {"equal": True, "changed_count": 0}
    log = [json.loads(x) for x in (res.out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert [r["phase"] for r in steps] == [1, 1, 2, 2]
    # each phase has its own warm-up (2 steps) and cosine: phase 2 starts again at lr / 2
    assert [r["learning_rate"] for r in steps] == pytest.approx([0.5e-2, 1e-2, 0.5e-2, 1e-2])
    assert "base_lr" not in steps[0] and steps[2]["base_lr"] == pytest.approx(2.5e-5)
    # the phase-1 checkpoints hold no model; the phase-2 ones do
    ckpts = res.out / "checkpoints"
    assert not run_parts(ckpts / "checkpoint-2")["model"]
    assert run_parts(ckpts / "phase-2" / "checkpoint-1")["model"]  # step 3 of the run
    assert res.extra["method"]["groups"]["base"] > 0


def test_phase_at():
    cfg = TrainConfig(method="two-phase", steps=10, phase1_steps=4)
    assert [phase_at(cfg, s) for s in range(10)] == [1] * 4 + [2] * 6
    assert cfg.phase2_method == "full" and cfg.base_lr == 5e-5 and cfg.lr == 3e-2
    assert TrainConfig(method="two-phase", steps=9).phase1_steps == 4
    lora = TrainConfig(method="two-phase", phase2_method="lora")
    assert lora.base_lr == 5e-4 and lora.uses_lora()


def test_default_learning_rates_by_method():
    lrs = {m: TrainConfig(method=m).lr for m in METHODS}
    assert lrs == {"focus": 3e-2, "lora": 5e-4, "attention": 5e-5, "full": 5e-5,
                   "focus+lora": 3e-2, "two-phase": 3e-2}  # fmt: skip
    assert TrainConfig(method="focus+lora").base_lr == 5e-4
    assert TrainConfig(method="lora", lr=1e-3).lr == 1e-3


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


@pytest.mark.parametrize(
    ("method", "extra"), [(m, {}) for m in METHODS] + [("two-phase", {"phase2_method": "lora"})]
)
def test_saved_output_reloads_to_the_same_logits(assets, tmp_path, method, extra):
    from focus_attention.hf import FocusModel

    cfg = _cfg(assets, tmp_path / "unused", method, **extra)
    base, tok = _base(assets)
    step = cfg.phase1_steps + 1 if method == "two-phase" else 0  # two-phase: phase 2
    trainee = build_trainee(cfg, base, tok, None, step)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # stand-in for training: move every trained tensor
        for p in trainee.params:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    trainee.model.eval()
    x = torch.randint(0, trainee.hf.config.vocab_size, (2, 32), generator=gen)
    want = _logits(trainee.model, x)
    trainee.save_pretrained(tmp_path / "out")
    fresh, _ = _base(assets)
    model = load_trained_weights(fresh, tmp_path / "out")
    if run_parts(tmp_path / "out")["lora"]:
        apply_lora(model, tmp_path / "out")
    if run_parts(tmp_path / "out")["focus"]:
        model = FocusModel.from_pretrained(model, tmp_path / "out")
    assert torch.equal(_logits(model, x), want)
    if trainee.focus is None:  # and the dense logits differ from the untouched base
        assert not torch.equal(want, _logits(_base(assets)[0], x))


def _crash(assets, out, method, step):
    def crash(s, record):
        if s == step:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(_cfg(assets, out, method), callback=crash)


@pytest.mark.parametrize(
    ("method", "crash_at"),
    [
        ("focus", 3),
        pytest.param("lora", 3, marks=pytest.mark.slow),
        pytest.param("attention", 3, marks=pytest.mark.slow),
        ("full", 2),
        pytest.param("focus+lora", 3, marks=pytest.mark.slow),
        pytest.param("two-phase", 3, marks=pytest.mark.slow),
        ("two-phase", 4),
    ],  # fmt: skip
)
def test_resume_is_exact(assets, runs, tmp_path, method, crash_at):
    """A crash after step ``crash_at`` (its checkpoint is lost) and a resume give the
    reference run's losses and every saved tensor exactly (two-phase: resumed at the phase
    boundary and inside phase 2)."""
    ref = runs[method]
    out = tmp_path / "run"
    _crash(assets, out, method, crash_at)
    assert newest_checkpoint(out).step == crash_at - 1
    resumed = train(_cfg(assets, out, method, resume=True))
    assert resumed.start_step == crash_at - 1
    assert resumed.losses == ref.losses[crash_at - 1 :]
    want, got = _saved(ref.out), _saved(out)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert resumed.trainable_parameters == ref.trainable_parameters
    assert resumed.extra["base_weights_sha256"]["after"] == ref.extra["base_weights_sha256"]["after"]  # fmt: skip


@pytest.mark.parametrize(
    "method",
    ["focus", "full", "lora", "focus+lora", "two-phase"],
)
def test_resume_rewrites_trained_parts_that_are_not_the_last_checkpoints(assets, runs, tmp_path, method):  # fmt: skip
    """A finished run's folder whose result says finished but whose trained parts (the
    adapter, ``lora/``, ``model/``) are an earlier checkpoint's (a final save killed between
    two renames): ``--resume`` names every such part and writes the finished output."""
    ref = runs[method]
    out = tmp_path / "run"
    shutil.copytree(ref.out, out)
    first = out / "checkpoints" / "checkpoint-1"
    parts = [p.name for p in first.iterdir() if p.name in ("focus_model.safetensors", "lora", "model")]  # fmt: skip
    for name in parts:
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        (shutil.copytree if (first / name).is_dir() else shutil.copy)(first / name, target)
    cfg = _cfg(assets, out, method, resume=True)
    why = unfinished_output(cfg, out, newest_checkpoint(out))
    assert len(why) == 1 and why[0].endswith(f"not those of {newest_checkpoint(out).path.name}")
    for name in parts:
        assert name in why[0]
    resumed = train(cfg)
    assert not resumed.extra.get("already_finished") and resumed.steps == 4
    want, got = _saved(ref.out), _saved(out)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert train(cfg).extra["already_finished"]


def test_lora_rank_match_picks_the_closest_count(assets, tmp_path):
    assert match_lora_rank(100, 250) == 2  # 200 and 300 tie: the smaller
    assert match_lora_rank(100, 260) == 3 and match_lora_rank(100, 10) == 1
    assert match_lora_rank(57_600, 280_320) == 5  # SmolLM2 q, v: 288,000
    base, _ = _base(assets)
    _, short, per_rank = lora_modules(base, ("q", "v"))
    assert short == ["q_proj", "v_proj"]
    k_v = base.model.layers[0].self_attn.v_proj.out_features
    assert per_rank == 2 * ((32 + 32) + (32 + k_v))
    res = train(_cfg(assets, tmp_path / "run", "lora", lora_rank="match", lora_targets=("q", "v"),
                     steps=1, eval_every=-1, save_every=0))  # fmt: skip
    info = res.extra["method"]["lora"]
    focus = 2 * (32 * 8 + 4 * 8)
    best = min(range(1, 100), key=lambda r: (abs(r * per_rank - focus), r))
    assert info["rank"] == best and info["matched_focus_parameters"] == focus
    assert res.trainable_parameters == best * per_rank == info["parameters"]
    assert info["alpha"] == best and info["per_rank"] == per_rank


def test_focus_plus_lora_trains_both(runs):
    info = runs["focus+lora"].extra["method"]
    assert set(info["groups"]) == {"routers", "lora"}
    assert info["lr"] == {"routers": 1e-2, "lora": 5e-4}


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(method="lora", objective="distill"), "objective.*'lm' with --method lora"),
        (dict(method="full", objective="coverage"), "objective"),
        (dict(method="two-phase", objective="mix"), "objective"),
        (dict(method="focus", lora_rank=4), "lora_rank.*trains no LoRA"),
        (dict(method="full", lora_targets=("q",)), "lora_targets"),
        (dict(method="two-phase", lora_rank=4), "lora_rank"),  # phase 2 full by default
        (dict(method="lora", base_lr=1e-4), "base_lr.*use --lr"),
        (dict(method="lora", phase1_steps=2), "phase1_steps.*two-phase"),
        (dict(method="two-phase", steps=4, phase1_steps=5), "phase1_steps.*at most"),
        (dict(method="two-phase", phase2_method="attention"), "phase2_method"),
        (dict(method="lora", lora_rank=0), "lora_rank"),
        (dict(method="lora", lora_dropout=1.0), "lora_dropout"),
        (dict(method="sgd"), "method"),
    ],
)
def test_bad_combinations_raise_clear_errors(settings, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**settings)


def test_unknown_lora_target_is_refused(assets, tmp_path):
    with pytest.raises(ValueError, match="'x_proj' names no linear layer of LlamaAttention"):
        train(_cfg(assets, tmp_path / "run", "lora", lora_targets=("q", "x_proj"), steps=1))


def test_dense_methods_need_no_window_shorter_than_the_block():
    TrainConfig(method="lora", seq_len=16)  # window 128 > 16: fine without Focus
    with pytest.raises(ValueError, match="more than window"):
        TrainConfig(method="focus+lora", seq_len=16)


def test_cli_flags_and_config_file(tmp_path):
    import argparse

    from focus_attention.cli.train import config_from_args, register_cli

    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nmethod = "focus+lora"\nlora_targets = ["q", "v"]\n')
    args = parser.parse_args(["train", "--config", str(toml), "--lora-rank", "match",
                              "--lora-alpha", "16", "--base-lr", "1e-4"])  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.method, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.base_lr) == (
        "focus+lora", "match", 16.0, ("q", "v"), 1e-4)  # fmt: skip
    args = parser.parse_args(["train", "--method", "two-phase", "--phase1-steps", "10",
                              "--phase2-method", "lora", "--lora-targets", "q,k"])  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.phase1_steps, cfg.phase2_method, cfg.lora_targets) == (10, "lora", ("q", "k"))
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def _eval(assets, out, **kw):
    return evaluate(model=str(assets["model"]), adapter=str(out), corpus=str(assets["corpus"]),
                    split="test", max_tokens=128, seq_len=64, threads=1, progress=False,
                    **kw).to_dict()  # fmt: skip


@pytest.mark.parametrize("method", ["lora", "full", "focus+lora", "two-phase"])
def test_eval_of_every_method(assets, runs, method):
    res = _eval(assets, runs[method].out)
    ppl, weights = res["ppl"], res["base_weights_sha256"]
    focus = method in ("focus+lora", "two-phase")
    assert set(ppl) == ({"base", "tuned", "focus_soft", "focus_topk"} if focus else {"base", "tuned"})  # fmt: skip
    assert all(math.isfinite(v) for v in (ppl["base"], ppl["tuned"]))
    assert ppl["tuned"] != ppl["base"]
    assert weights["trained"] and res["config"]["method"] == method
    train_doc = json.loads((runs[method].out / "train_result.json").read_text())
    assert weights["after"] == train_doc["extra"]["base_weights_sha256"]["after"]
    assert weights["changed"] == train_doc["extra"]["base_weights_sha256"]["changed"]
    assert (weights["lora_tensors"] > 0) == (method in ("lora", "focus+lora"))
    if focus:
        assert list(ppl["focus_topk"]) == ["1", "2", "3", "4"]
        assert ppl["focus_topk"]["4"] == pytest.approx(ppl["tuned"], rel=1e-4)  # top-K = dense
    else:
        assert res["routing_affected_share"] is None and res["config"]["focus"] is None
    table = markdown_table(res)
    assert "| tuned (dense) |" in table and ("Focus top-k" in table) == focus
    # the position table has the tuned row too
    assert table.count("| tuned (dense) |") == 2


def test_eval_of_a_dense_run_refuses_focus_settings(assets, runs):
    with pytest.raises(ValueError, match="--top-k.*no Focus adapter"):
        _eval(assets, runs["lora"].out, top_k=(1,))


def test_eval_cli_reports_the_changed_weights(assets, runs, capsys):
    from focus_attention.cli import main

    argv = ["eval", "--model", str(assets["model"]), "--adapter", str(runs["attention"].out),
            "--corpus", str(assets["corpus"]), "--max-tokens", "128", "--seq-len", "64",
            "--threads", "1", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    n = len(runs["attention"].extra["base_weights_sha256"]["changed"])
    assert "| tuned (dense) |" in out and f"trained base weights: {n} of" in out


def test_training_digests_match_the_untouched_base(assets, runs):
    """``base_weights_sha256.before`` is the untouched base's, for every method."""
    from focus_attention.utils.env import weights_sha256

    base, _ = _base(assets)
    assert {r.extra["base_weights_sha256"]["before"] for r in runs.values()} == {
        weights_sha256(base)
    }
    assert len(tensor_digests(base)) == len(base.state_dict())


@pytest.mark.assets
def test_smollm2_lora_counts():
    """The trainable counts on the real model: Focus 280,320; LoRA per rank on q, v and on
    q, k, v, o; the matched ranks."""
    from tiny_assets import require_real_assets

    require_real_assets()
    from focus_attention.assets.models import load_model

    base, _ = load_model("smollm2-135m", quiet=True)
    _, _, qv = lora_modules(base, ("q", "v"))
    _, _, qkvo = lora_modules(base, ("q", "k", "v", "o"))
    assert qv == 30 * ((576 + 576) + (576 + 192)) == 57_600
    assert qkvo == 30 * (2 * (576 + 576) + 2 * (576 + 192)) == 115_200
    assert match_lora_rank(qv, 280_320) == 5 and match_lora_rank(qkvo, 280_320) == 2
    assert 8 * qkvo == 921_600  # the common setting, r = 8 on q, k, v, o


def test_resume_of_a_finished_run_and_overwrite(assets, runs, tmp_path):
    """``--resume`` of a finished LoRA run reports its count and touches nothing;
    ``--overwrite`` with another method removes the LoRA adapter."""
    out = tmp_path / "run"
    first = train(_cfg(assets, out, "lora", steps=1, eval_every=-1, save_every=0))
    again = train(_cfg(assets, out, "lora", steps=1, eval_every=-1, save_every=0, resume=True))
    assert again.extra["already_finished"]
    assert again.trainable_parameters == first.trainable_parameters
    assert run_parts(out)["lora"]
    train(_cfg(assets, out, "focus", steps=1, eval_every=-1, save_every=0, overwrite=True))
    assert run_parts(out) == {"focus": True, "lora": False, "model": False}


def test_dense_validation_is_logged(runs):
    val = runs["lora"].validation
    assert [v["step"] for v in val] == [0, 2, 4]
    assert "val_ppl_topk" not in val[0] and val[0]["val_ppl"] == val[0]["val_ppl_base"]
    assert all(math.isfinite(v["val_ppl"]) for v in val)
    assert [v["step"] for v in runs["focus+lora"].validation] == [0, 2, 4]
    assert "val_ppl_topk" in runs["focus+lora"].validation[-1]


@pytest.mark.slow
def test_two_phase_with_lora_resumes_exactly_inside_phase_2(assets, tmp_path):
    """Phase 2 with LoRA: the uninterrupted run injects LoRA under the routers at the
    boundary, the resumed one loads both; same losses and tensors."""
    lora = dict(phase2_method="lora", lora_rank="match", lora_targets=("q", "v"))
    ref = train(_cfg(assets, tmp_path / "ref", "two-phase", **lora))
    info = ref.extra["method"]
    assert info["phase"] == 2 and set(info["groups"]) == {"routers", "lora"}
    assert info["lora"]["matched_focus_parameters"] == info["groups"]["routers"]
    assert ref.extra["base_weights_sha256"]["changed"] == []
    out = tmp_path / "run"

    def crash(s, record):
        if s == 4:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(_cfg(assets, out, "two-phase", **lora), callback=crash)
    resumed = train(_cfg(assets, out, "two-phase", resume=True, **lora))
    assert resumed.start_step == 3 and resumed.losses == ref.losses[3:]
    want, got = _saved(ref.out), _saved(out)
    assert want.keys() == got.keys() and any(k.startswith("lora:") for k in want)
    for k in want:
        assert torch.equal(want[k], got[k]), k
