"""``focus pretrain`` on the tiny preset: model sizes, identical data and initialisation for
both attention types, the loss going down, exact resume, reloading the saved model, settings
errors, and a 2-process torchrun run whose ranks end with identical routers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_assets import use_tiny_assets
from tolerances import tolerance

from focus_attention.hf import FocusBaseMismatchWarning, FocusConfig
from focus_attention.training.pretrain import (
    ROUTERS_MODULE,
    PretrainConfig,
    build_model,
    load_pretrained,
    pretrain,
)
from focus_attention.training.scratch_model import END_OF_TEXT, build_llama, load_tokenizer
from focus_attention.training.settings import SIZES, resolve_size
from focus_attention.training.validation import validation_perplexities

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

#: 4 steps of 2 blocks of 64 tokens, window 16, validated and checkpointed every 2 steps
TINY = dict(size="tiny", seq_len=64, batch_size=2, steps=4, eval_every=2, eval_tokens=256,
            lr=1e-2, warmup_steps=0, log_every=1, threads=1)  # fmt: skip


def tiny(corpus: Path, out: Path, attention: str = "focus", **changes) -> PretrainConfig:
    settings = {**TINY, "corpus": str(corpus), "out": str(out), "attention": attention}
    focus = FocusConfig(num_groups=4, top_k=2, window=16)
    return PretrainConfig(**{**settings, **changes}, focus=focus)


@pytest.fixture(scope="module")
def runs(module_assets, tmp_path_factory, kernel_built):
    """The tiny preset trained with Focus and with dense attention (same seed)."""
    root = tmp_path_factory.mktemp("pretrain")
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        return {a: (pretrain(tiny(module_assets["corpus"], root / a, a)), root / a)
                for a in ("focus", "dense")}  # fmt: skip


def test_sizes_build_at_the_requested_shape():
    small = resolve_size("small")
    model = build_llama(small, small.vocab_size, 512, seed=0)
    assert sum(p.numel() for p in model.parameters()) == small.num_parameters()
    assert 2_000_000 < small.num_parameters() < 5_000_000  # a few million parameters
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (256, 4, 4)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 512
    wide = resolve_size("tiny", hidden_size=96, num_heads=3, num_kv_heads=1)
    assert (wide.hidden_size, wide.num_heads, wide.num_kv_heads) == (96, 3, 1)
    assert sum(p.numel() for p in build_llama(wide, 300, 64, 0).parameters()) == (
        wide.num_parameters(300)
    )
    a, b = build_llama(SIZES["tiny"], 300, 64, 1), build_llama(SIZES["tiny"], 300, 64, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"size": "huge"}, "size"),
        ({"hidden_size": 66}, "num_heads"),  # 66 / 2 = 33: odd head width
        ({"hidden_size": 63}, "num_heads"),  # not divisible by the heads
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"attention": "sparse"}, "attention"),
        ({"seq_len": 16}, "window"),  # 16 tokens: every pair inside the 16-token window
        ({"eval_top_k": (1, 5)}, "eval_top_k"),  # K = 4
        ({"eval_tokens": 32}, "eval_tokens"),
        ({"steps": 0}, "steps"),
    ],
)
def test_bad_settings_raise_clear_errors(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        tiny(tmp_path, tmp_path / "out", **changes)


def test_dense_ignores_the_window_and_focus_refuses_topk_training(tmp_path):
    assert tiny(tmp_path, tmp_path, "dense", seq_len=16).seq_len == 16
    with pytest.raises(ValueError, match="routing"):
        PretrainConfig(**{**TINY, "corpus": "x"}, focus=FocusConfig(num_groups=4, routing="topk"))


def test_both_attention_types_see_the_same_init_tokens_and_order(runs):
    focus, dense = runs["focus"][0], runs["dense"][0]
    for key in ("init_weights_sha256", "train_blocks_sha256", "validation_blocks_sha256",
                "batches_sha256", "batches_fed", "tokens_trained"):  # fmt: skip
        assert focus["data"][key] == dense["data"][key], key
    assert focus["data"]["batches_fed"] == 4  # one batch per step, no accumulation
    assert focus["model"]["parameters"] == dense["model"]["parameters"]
    assert focus["model"]["router_parameters"] > 0 == dense["model"]["router_parameters"]
    # same data, different attention: the trained models differ
    assert focus["validation"][-1]["ppl"] != dense["validation"][-1]["ppl"]
    assert set(focus["validation"][-1]) >= {"ppl", "ppl_top1", "ppl_top2"}
    assert "ppl_top1" not in dense["validation"][-1]


def test_a_few_steps_lower_the_loss_and_every_checkpoint_is_validated(runs):
    for attention, (result, out) in runs.items():
        steps = [row["step"] for row in result["validation"]]
        assert steps == [0, 2, 4], attention
        ppl = [row["ppl"] for row in result["validation"]]
        assert ppl[-1] < 0.8 * ppl[0], (attention, ppl)
        losses = [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
                  if "loss" in r and "eval_ppl" not in r]  # fmt: skip
        assert len(losses) == 4 and losses[-1] < losses[0], (attention, losses)
        assert result["throughput"]["tokens_per_second"] > 0
        assert sorted(p.name for p in (out / "trainer").iterdir()) == [
            "checkpoint-2",
            "checkpoint-4",
        ]


def test_focus_routers_train_with_every_weight_and_feed_the_routing_bias(runs):
    _, out = runs["focus"]
    ckpt = load_file(str(out / "trainer" / "checkpoint-2" / "model.safetensors"))
    final = load_file(str(out / "trainer" / "checkpoint-4" / "model.safetensors"))
    for name in (f"{ROUTERS_MODULE}.0.centroids", f"{ROUTERS_MODULE}.1.proj",
                 "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):  # fmt: skip
        assert not torch.equal(ckpt[name], final[name]), name
    assert int(final[f"{ROUTERS_MODULE}.0.bias_updates"]) == 4
    assert final[f"{ROUTERS_MODULE}.0.routing_bias"].abs().sum() > 0


def test_the_tokenizer_is_a_trained_byte_level_bpe(runs):
    _, out = runs["focus"]
    tok = load_tokenizer(out / "tokenizer")
    assert tok.eos_token == END_OF_TEXT and tok.eos_token_id == 0
    assert 257 < len(tok) <= SIZES["tiny"].vocab_size
    text = "Grüße, κόσμε: any text encodes"  # byte-level: nothing is unknown
    assert tok.decode(tok(text).input_ids) == text


@pytest.mark.parametrize("attention", ["focus", "dense"])
def test_the_saved_model_reloads_with_the_same_logits(runs, attention):
    result, out = runs[attention]
    config = PretrainConfig.from_dict(result["config"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FocusBaseMismatchWarning)  # the adapter fits the model
        model, tok = load_pretrained(out)
    # the same model rebuilt from the last Trainer checkpoint (LLaMA weights + routers)
    llama, focus, _ = build_model(config, len(tok))
    state = load_file(str(out / "trainer" / "checkpoint-4" / "model.safetensors"))
    missing, unexpected = llama.load_state_dict(state, strict=False)
    assert not unexpected and missing in ([], ["lm_head.weight"])  # tied to the embedding
    reference = focus if focus is not None else llama
    reference.eval()
    x = torch.randint(0, len(tok), (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, reference(input_ids=x).logits,
                                   **tolerance("oracle"))  # fmt: skip
    assert (attention == "focus") == hasattr(model, "focus_config")
    again = validation_perplexities(llama, focus, x, (1,), 2)
    if focus is None:
        reloaded = validation_perplexities(model, None, x, (1,), 2)
    else:
        reloaded = validation_perplexities(model.base_model, model, x, (1,), 2)
    assert again == pytest.approx(reloaded, rel=1e-5)


def test_resume_from_a_checkpoint_continues_exactly(runs, assets, tmp_path):
    straight, out = runs["focus"]
    copy = tmp_path / "resumed"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoint-4", "model", "adapter",
                                                             "pretrain_result.json"))  # fmt: skip
    config = tiny(assets["corpus"], copy)
    with pytest.raises(ValueError, match="--resume"):
        pretrain(config)
    resumed = pretrain(tiny(assets["corpus"], copy, resume=True))
    assert resumed["data"]["resumed_from_step"] == 2 and resumed["data"]["batches_fed"] == 2
    assert [r["step"] for r in resumed["validation"]] == [0, 2, 4]
    for got, want in zip(resumed["validation"], straight["validation"], strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    a = load_file(str(out / "trainer" / "checkpoint-4" / "model.safetensors"))
    b = load_file(str(copy / "trainer" / "checkpoint-4" / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], **tolerance("rounding"), msg=k)


def test_a_resume_checks_its_data_and_its_checkpoint_and_holds_its_folder(runs, assets, tmp_path):  # fmt: skip
    """The run records the digest of its training blocks; a resume whose blocks differ, or
    whose checkpoint has a damaged optimizer state, is refused naming the file; a folder
    another run holds is refused naming it."""
    from focus_attention.utils.io import FolderInUseError, UnreadableFileError, exclusive_lock

    straight, out = runs["dense"]
    data = json.loads((out / "pretrain_data.json").read_text())
    assert data["train_blocks_sha256"] == straight["data"]["train_blocks_sha256"]
    copy = tmp_path / "resumed"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoint-4", "model",
                                                             "pretrain_result.json"))  # fmt: skip
    config = tiny(assets["corpus"], copy, "dense", resume=True)
    (copy / "pretrain_data.json").write_text(json.dumps({**data, "train_blocks_sha256": "0" * 64}))
    with pytest.raises(ValueError, match=rf"^--resume: the training data differ .*records token blocks of SHA-256 0{{64}}, the corpus now gives {data['train_blocks_sha256']}"):  # fmt: skip
        pretrain(config)
    (copy / "pretrain_data.json").write_text(json.dumps(data))
    state = copy / "trainer" / "checkpoint-2" / "optimizer.pt"
    whole = state.read_bytes()
    state.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UnreadableFileError, match=rf"^{state}: truncated or not a torch.save file"):
        pretrain(config)
    state.write_bytes(whole)
    in_use = rf"^{copy} is in use by process {os.getpid()}"
    held = exclusive_lock(copy / ".focus-train.lock", "focus pretrain --out elsewhere")
    with held, pytest.raises(FolderInUseError, match=in_use):
        pretrain(config)
    assert pretrain(config)["data"]["resumed_from_step"] == 2


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_a_resumed_log_holds_each_step_once(runs, assets, tmp_path):
    """A run that crashed after step 4 was logged, its last checkpoint step 2's: the resumed
    run's log is the uninterrupted run's, each step once."""
    straight, out = runs["dense"]
    copy = tmp_path / "resumed"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoint-4", "model",
                                                             "pretrain_result.json"))  # fmt: skip
    pretrain(tiny(assets["corpus"], copy, "dense", resume=True))
    got, want = _losses(copy), _losses(out)
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)


def _stop_the_final_save_at(monkeypatch, at: int) -> None:
    """Raise KeyboardInterrupt at rename ``at`` (0-based) of :func:`save_final`."""
    import focus_attention.training.pretrain as module

    real_save, real_replace, seen = module.save_final, os.replace, []

    def replace(a, b):
        seen.append(1)
        if len(seen) - 1 == at:
            raise KeyboardInterrupt
        return real_replace(a, b)

    def save_final(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(os, "replace", replace)
            return real_save(*args, **kwargs)

    monkeypatch.setattr(module, "save_final", save_final)


@pytest.mark.parametrize("at", [0, 3, 6])
def test_a_stopped_final_save_leaves_no_output_and_resume_finishes(runs, assets, tmp_path, monkeypatch, at):  # fmt: skip
    """The final save stopped at a rename: no model, adapter or result is left (the run is
    not "finished": load_pretrained refuses it), and --resume writes the uninterrupted run's
    output."""
    straight, out = runs["focus"]
    copy = tmp_path / "run"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("model", "adapter", "pretrain_result.json"))  # fmt: skip
    with monkeypatch.context() as m:
        _stop_the_final_save_at(m, at)
        with pytest.raises(KeyboardInterrupt):
            pretrain(tiny(assets["corpus"], copy, resume=True))
    assert not [p.name for p in copy.iterdir() if p.name in ("model", "adapter", "pretrain_result.json")]  # fmt: skip
    with pytest.raises(FileNotFoundError, match="has not finished"):
        load_pretrained(copy)
    resumed = pretrain(tiny(assets["corpus"], copy, resume=True))
    assert resumed["data"]["batches_fed"] == 0  # the last checkpoint restored, no step past it
    for got, want in zip(resumed["validation"], straight["validation"], strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    for part, name in (("model", "model.safetensors"), ("adapter", "focus_model.safetensors")):
        a, b = load_file(str(out / part / name)), load_file(str(copy / part / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert not [p for p in copy.iterdir() if p.name.startswith(".final-")]
    load_pretrained(copy)


def test_a_warm_up_as_long_as_the_run_warns_with_the_peak_it_reaches(assets, tmp_path):
    with pytest.warns(UserWarning, match="focus pretrain: --warmup-steps 4 is not below --steps 2: "
                      r"the learning rate only warms up, peaking at 0.25 x --lr 0.01 = 0.0025"):  # fmt: skip
        pretrain(tiny(assets["corpus"], tmp_path / "run", "dense", steps=2, warmup_steps=4))
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert max(r["learning_rate"] for r in rows if "learning_rate" in r) == pytest.approx(0.0025)


def test_a_run_with_other_settings_is_refused(runs, assets):
    _, out = runs["dense"]
    with pytest.raises(ValueError, match="other settings"):
        pretrain(tiny(assets["corpus"], out, "dense", lr=3e-3, resume=True))


def test_cli_reports_bad_options(capsys):
    from focus_attention.cli import main

    assert main(["pretrain", "--size", "tiny", "--seq-len", "16", "--window", "16"]) == 1
    assert "window" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pretrain", "--attention", "sparse"])


@pytest.mark.slow
def test_two_processes_under_torchrun_end_with_identical_routers(assets, tmp_path):
    out = tmp_path / "ddp"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", "29611", "-m", "focus_attention.cli", "pretrain",
            "--attention", "focus", "--corpus", str(assets["corpus"]), "--out", str(out),
            "--size", "tiny", "--seq-len", "64", "--window", "16", "--num-groups", "4",
            "--batch-size", "1", "--steps", "3", "--eval-every", "3", "--eval-tokens", "128",
            "--lr", "1e-2", "--warmup-steps", "0", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FOCUS_NO_EXTENSION": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "pretrain_result.json").read_text())
    assert result["throughput"]["world_size"] == 2
    digests = result["rank_weights_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]  # weights, routers and routing bias
    assert result["data"]["tokens_trained"] == 3 * 2 * 64
    model, _ = load_pretrained(out)
    # every step folded both ranks' batches, as one process accumulating two micro-batches
    assert int(model.routers["0"].bias_updates) == 3 * 2


ACCELERATE = Path(sys.executable).with_name("accelerate")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not ACCELERATE.is_file(), reason="accelerate is not installed")
@pytest.mark.parametrize("config", ["ddp.yaml", "fsdp.yaml"])
def test_accelerate_launch_with_the_committed_configs(assets, tmp_path, config):
    """``accelerate launch --config_file configs/accelerate/*.yaml -m focus_attention.cli
    pretrain``: two processes end with identical weights, only rank 0 reports, and the
    result records whether the model was sharded (accelerate shards only on accelerators,
    so on CPUs the FSDP file trains data-parallel and says so)."""
    out = tmp_path / "run"
    argv = [str(ACCELERATE), "launch", "--config_file", str(REPO / "configs/accelerate" / config),
            "--num_processes", "2", "--main_process_port", "29613", "-m", "focus_attention.cli",
            "pretrain", "--attention", "focus", "--corpus", str(assets["corpus"]),
            "--out", str(out), "--size", "tiny", "--seq-len", "64", "--window", "16",
            "--num-groups", "4", "--batch-size", "1", "--steps", "2", "--eval-every", "2",
            "--eval-tokens", "128", "--lr", "1e-2", "--warmup-steps", "0", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FOCUS_NO_EXTENSION": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("output: ") == 1  # rank 0 only
    result = json.loads((out / "pretrain_result.json").read_text())
    digests = result["rank_weights_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]
    fsdp = config == "fsdp.yaml"
    layout = result["distributed"]
    assert layout["world_size"] == 2 and layout["requested"] == fsdp
    if not torch.cuda.is_available():
        assert layout["sharded"] is False
        assert ("enables FSDP only on accelerators" in proc.stderr) == fsdp


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[2] / "configs" / "pretrain").glob("*.toml")),
    ids=lambda p: p.name,
)
def test_shipped_pretrain_settings_files_are_valid_and_flags_override_them(path):
    from focus_attention.cli import build_parser
    from focus_attention.cli.pretrain import config_from_args

    args = build_parser().parse_args(["pretrain", "--config", str(path), "--seed", "3",
                                      "--attention", "dense", "--num-groups", "8"])  # fmt: skip
    config = config_from_args(args)
    assert (config.seed, config.attention, config.focus.num_groups) == (3, "dense", 8)
    assert config.focus.seed == 3  # the run's seed seeds the routers
    default = config_from_args(build_parser().parse_args(["pretrain"]))
    assert default.focus.num_groups == 4 and default.focus == FocusConfig(num_groups=4)
