"""``focus train`` (:func:`focus_attention.training.train`) on a tiny random LLaMA:
centroid-only training on transformers.Trainer, exact resume after Ctrl-C and crashes,
checkpoints, the final output, schedule, data order and configuration errors."""

from __future__ import annotations

import json
import math
import os
import signal
import warnings

import pytest
import torch
from safetensors.torch import load_file
from tiny_assets import tiny_config, train_config, use_tiny_assets
from tolerances import tolerance

from focus_attention.training import (
    CHECKPOINT_DIR,
    EpochPermutations,
    TrainConfig,
    latest_checkpoint,
    lr_factor,
    train,
)
from focus_attention.training.methods import trainable_parameters


@pytest.fixture(scope="module")
def reference(module_assets, tmp_path_factory):
    """An uninterrupted 6-step run (the reference for resume tests)."""
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        out = tmp_path_factory.mktemp("reference") / "run"
        result = train(tiny_config(module_assets, out))
    return result


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "focus_model.safetensors"))


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _same_log(a: list[dict], b: list[dict]) -> None:
    """Equal logs apart from wall-clock seconds and the Trainer's end-of-run summary."""

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows
                if "train_runtime" not in r]  # fmt: skip

    assert strip(a) == strip(b)


def _steps(out) -> list[int]:
    return [r["step"] for r in _log(out) if "loss" in r]


def test_reference_run(reference):
    out = reference.out
    assert reference.steps == 6 and len(reference.losses) == 6
    assert all(math.isfinite(v) for v in reference.losses)
    assert [v["step"] for v in reference.validation] == [0, 3, 6]
    assert "val_ppl_base" in reference.validation[0]
    assert latest_checkpoint(out).name == "checkpoint-6"
    assert sorted(p.name for p in (out / CHECKPOINT_DIR).iterdir()) == [
        "checkpoint-4",
        "checkpoint-6",
    ]  # keep_checkpoints = 2
    rows = [r for r in _log(out) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["loss"] for r in rows] == reference.losses
    # the rate each step used: warm-up over 2 steps, then cosine decay to 0 at step 6
    assert rows[0]["learning_rate"] == pytest.approx(0.5e-2)
    assert rows[1]["learning_rate"] == pytest.approx(1e-2)
    assert all(0.25 <= r["dominance"] <= 1 for r in rows)
    assert [r["tokens"] for r in rows] == [64 * s for s in range(1, 7)]  # 2 blocks of 32
    assert reference.trainable_parameters == 2 * (32 * 8 + 4 * 8)
    assert reference.extra["base_weights_sha256"]["equal"]
    # the routers moved, the final adapter equals the last checkpoint's
    ckpt = _weights(out / CHECKPOINT_DIR / "checkpoint-6")
    for k, v in _weights(out).items():
        assert torch.equal(v, ckpt[k])
    assert (out / "train.png").stat().st_size > 1000
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left
    card = (out / "README.md").read_text()  # the adapter's model card reports the run
    assert "steps run: 6" in card and "val_ppl_topk at step 6" in card
    # the same library versions block as focus eval's JSON
    from focus_attention.utils.env import library_versions

    doc = json.loads((out / "train_result.json").read_text())
    assert doc["versions"] == library_versions()
    assert {"torch", "transformers", "tokenizers", "safetensors", "python"} <= set(doc["versions"])
    # cost of the run: peak memory (at least the model's weights) and seconds per step
    from focus_attention.training.run import peak_memory_bytes

    # torch alone takes > 100 MiB; the peak never decreases within this process
    assert 100 * 2**20 < doc["extra"]["peak_memory_bytes"] <= peak_memory_bytes()
    assert doc["extra"]["seconds_per_step"] == pytest.approx(reference.train_seconds / 6)
    assert rows[-1]["seconds"] == pytest.approx(reference.train_seconds)


def _ctrl_c_at(stop: int):
    """A step hook that sends a real SIGINT (as from the terminal) after step ``stop``."""

    def hook(step, entry):
        if step == stop:
            os.kill(os.getpid(), signal.SIGINT)

    return hook


def test_resume_after_ctrl_c_equals_uninterrupted(assets, reference, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(assets, out), callback=_ctrl_c_at(2))
    # the step in progress completed: the adapter and a checkpoint of step 2 load
    assert latest_checkpoint(out).name == "checkpoint-2"
    from focus_attention.assets.models import load_model
    from focus_attention.hf import FocusModel

    base, _ = load_model(assets["model"], quiet=True)
    fm = FocusModel.from_pretrained(base, out)
    ckpt = _weights(out / CHECKPOINT_DIR / "checkpoint-2")
    for k, v in fm.focus_state_dict().items():
        assert torch.equal(v, ckpt[k])
    assert json.loads((out / "train_result.json").read_text())["extra"]["interrupted"]

    resumed = train(tiny_config(assets, out, resume=True))
    assert resumed.start_step == 2 and resumed.steps == 6
    assert resumed.losses == reference.losses[2:]
    ref_w, w = _weights(reference.out), _weights(out)
    assert ref_w.keys() == w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], w[k]), k
    _same_log(_log(out), _log(reference.out))


def _resume_equals_reference(assets, reference, out, stopped: int) -> None:
    assert latest_checkpoint(out).name == f"checkpoint-{stopped}"
    assert _steps(out) == list(range(1, stopped + 1))  # the stopped step too
    resumed = train(tiny_config(assets, out, resume=True))
    assert resumed.start_step == stopped and resumed.losses == reference.losses[stopped:]
    for k, v in _weights(reference.out).items():
        assert torch.equal(v, _weights(out)[k]), k


def test_ctrl_c_during_validation_stops_after_it(assets, reference, tmp_path, monkeypatch):
    """Ctrl-C while the step-3 validation runs (the run's second): the validation
    completes, step 3 is checkpointed, and the resumed run ends as the uninterrupted one."""
    from focus_attention.training import trainer

    original, calls = trainer.validation_perplexities, []

    def validation(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "validation_perplexities", validation)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(assets, out))
    monkeypatch.undo()
    assert [r["step"] for r in _log(out) if "val_ppl_topk" in r] == [0, 3]
    _resume_equals_reference(assets, reference, out, 3)
    _same_log(_log(out), _log(reference.out))


def _crash_at(assets, out, crash_step: int) -> None:
    """A run of the reference settings into ``out`` that crashes after step ``crash_step``."""

    def crash(step, record):
        if step == crash_step:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(assets, out), callback=crash)


def test_resume_after_crash_from_periodic_checkpoint(assets, reference, tmp_path):
    out = tmp_path / "run"
    _crash_at(assets, out, 5)
    assert latest_checkpoint(out).name == "checkpoint-4"
    assert _steps(out) == [1, 2, 3, 4, 5]  # step 5 logged, its checkpoint lost with the crash
    resumed = train(tiny_config(assets, out, resume=True))
    assert resumed.start_step == 4 and resumed.losses == reference.losses[4:]
    for k, v in _weights(reference.out).items():
        assert torch.equal(v, _weights(out)[k]), k
    _same_log(_log(out), _log(reference.out))


@pytest.mark.slow
def test_resume_accepts_changed_validation_and_save_settings(assets, reference, tmp_path):
    out = tmp_path / "run"
    _crash_at(assets, out, 3)
    assert latest_checkpoint(out).name == "checkpoint-2"
    changed = dict(eval_every=1, eval_tokens=32, save_every=1, keep_checkpoints=5, threads=2)
    resumed = train(tiny_config(assets, out, resume=True, **changed))
    assert resumed.start_step == 2 and resumed.losses == reference.losses[2:]
    assert [v["step"] for v in resumed.validation] == [3, 4, 5, 6]
    for k, v in _weights(reference.out).items():
        assert torch.equal(v, _weights(out)[k]), k


def test_resume_with_more_steps_says_why_not(assets, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(assets, out, steps=1, eval_every=-1))
    with pytest.raises(
        ValueError, match="'steps'.*learning-rate schedule.*new run with another --out"
    ):
        train(tiny_config(assets, out, steps=3, eval_every=-1, resume=True))


def test_resume_of_a_finished_run_touches_nothing(assets, tmp_path, capsys):
    from focus_attention.cli import main

    out = tmp_path / "run"
    train(tiny_config(assets, out, steps=2, eval_every=1))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    assert json.loads((out / "train_result.json").read_text())["losses"]
    capsys.readouterr()
    argv = ["train", "--model", str(assets["model"]), "--corpus", str(assets["corpus"]),
            "--out", str(out), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
            "--lr", "0.01", "--warmup-steps", "2", "--eval-every", "5", "--eval-tokens", "64",
            "--save-every", "2", "--threads", "1", "--num-groups", "4", "--top-k", "2",
            "--window", "8", "--group-dim", "8", "--sink-tokens", "1", "--resume",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "nothing to do: run already finished at step 2" in printed.err
    assert "trained" not in printed.out
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    assert after == before
    res = train(tiny_config(assets, out, steps=2, eval_every=1, resume=True))
    assert res.steps == res.start_step == 2 and res.losses == [] and res.checkpoint is not None
    assert res.trainable_parameters == 2 * (32 * 8 + 4 * 8)  # 2 layers, d_model 32


def test_ctrl_c_during_the_first_step_saves_it(assets, tmp_path, monkeypatch):
    """A SIGINT inside the first training forward: the step completes, its checkpoint and
    the adapter load."""
    from focus_attention.hf import FocusModel

    out = tmp_path / "run"
    calls = {"n": 0}
    original = FocusModel.forward

    def forward(self, *args, **kwargs):
        if self.training:  # a training forward, not a validation one
            calls["n"] += 1
            if calls["n"] == 1:
                os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FocusModel, "forward", forward)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(assets, out))
    assert calls["n"] == 1  # batch_size 2, one micro-batch: one training forward
    assert latest_checkpoint(out).name == "checkpoint-1"
    assert _steps(out) == [1]
    from focus_attention.assets.models import load_model

    base, _ = load_model(assets["model"], quiet=True)
    FocusModel.from_pretrained(base, out)  # the adapter loads


def test_only_focus_parameters_train(assets):
    from focus_attention.assets.models import load_model
    from focus_attention.hf import FocusConfig, get_focus_model

    base, _ = load_model(assets["model"], quiet=True)
    fm = get_focus_model(base, FocusConfig(num_groups=4, top_k=2, window=8, group_dim=8))
    params = trainable_parameters(fm)
    names = {n for n, p in fm.named_parameters() if any(p is q for q in params)}
    assert {n.split("routers.", 1)[1] for n in names} == {f"{i}.{t}" for i in ("0", "1") for t in ("proj", "centroids")}  # fmt: skip
    base.model.norm.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="base parameters require grad"):
        trainable_parameters(fm)
    base.model.norm.weight.requires_grad_(False)
    fm.routers["0"].proj.requires_grad_(False)
    with pytest.raises(RuntimeError, match="Focus parameters"):
        trainable_parameters(fm)


def test_grad_accum_matches_batch(assets, tmp_path):
    a = train(tiny_config(assets, tmp_path / "a", steps=2, batch_size=2, grad_accum=1, eval_every=-1))  # fmt: skip
    b = train(tiny_config(assets, tmp_path / "b", steps=2, batch_size=1, grad_accum=2, eval_every=-1))  # fmt: skip
    assert a.losses == pytest.approx(b.losses, rel=1e-5)
    wa, wb = _weights(a.out), _weights(b.out)
    for k in wa:
        if k.endswith("bias_updates"):  # counts forwards: 2 vs 4
            assert int(wb[k]) == 2 * int(wa[k])
            continue
        torch.testing.assert_close(wa[k], wb[k], **tolerance("gradient"))


def test_zero_steps_saves_untrained_adapter(assets, tmp_path):
    res = train(tiny_config(assets, tmp_path / "z", steps=0))
    assert res.steps == 0 and res.losses == [] and res.final_loss is None
    assert [v["step"] for v in res.validation] == [0]
    assert (res.out / "focus_model.safetensors").is_file()
    w = _weights(res.out)
    assert float(w["layer.0.routing_bias"].abs().sum()) == 0  # never calibrated


def test_out_directory_guards(assets, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(assets, out, steps=1, eval_every=-1))
    assert json.loads((out / "train_result.json").read_text())["plot"] == str(out / "train.png")
    with pytest.raises(ValueError, match="--resume"):
        train(tiny_config(assets, out, steps=1, eval_every=-1))
    with pytest.raises(ValueError, match="settings differ"):
        train(tiny_config(assets, out, steps=1, eval_every=-1, lr=0.5, resume=True))
    # the Focus settings one by one, and what a resume may change
    with pytest.raises(ValueError, match=r"'focus.top_k': \(2, 1\).*may change only --threads"):
        train(tiny_config(assets, out, steps=1, eval_every=-1, top_k=1, resume=True))
    # --overwrite deletes the earlier run only once the new inputs load
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="nonexistent"):
        train(
            tiny_config(assets, out, steps=1, corpus=str(tmp_path / "nonexistent"), overwrite=True)
        )
    assert sorted(p.name for p in out.iterdir()) == before
    with pytest.raises(FileNotFoundError):
        train(tiny_config(assets, tmp_path / "empty", resume=True))
    res = train(tiny_config(assets, out, steps=2, eval_every=-1, overwrite=True))
    assert res.start_step == 0 and _steps(out) == [1, 2]
    # resuming a finished run with more free settings changed does nothing more
    again = train(tiny_config(assets, out, steps=2, eval_every=-1, resume=True, save_every=7))
    assert again.start_step == 2 and again.losses == []


def test_lr_schedule():
    assert [lr_factor(s, 10, 2) for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, 10, 2) == pytest.approx(1.0)
    assert lr_factor(6, 10, 2) == pytest.approx(0.5)
    assert lr_factor(10, 10, 2) == pytest.approx(0.0)
    assert lr_factor(0, 5, 0) == 1.0


def _warmup_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "--warmup-steps" in str(w.message)]


def test_a_warm_up_that_does_not_end_before_the_last_step_warns_with_the_peak(assets, tmp_path):
    """--warmup-steps at or beyond --steps: the run warns, naming the peak it reaches (the
    rate the log shows), and trains as asked; a warm-up that ends in time says nothing."""
    with pytest.warns(UserWarning) as record:
        train(tiny_config(assets, tmp_path / "long", steps=3, warmup_steps=4, eval_every=-1,
                          save_every=0))  # fmt: skip
    (message,) = _warmup_warnings(record)
    assert message.startswith("focus train: --warmup-steps 4 is not below --steps 3: ")
    assert "peaking at 0.75 x --lr 0.01 = 0.0075 and never decaying" in message
    rates = [r["learning_rate"] for r in _log(tmp_path / "long") if "loss" in r]
    assert max(rates) == pytest.approx(0.0075)
    with pytest.warns(UserWarning, match="--warmup-steps 3 is not below --steps 3: .*peaking at 1 "):  # fmt: skip
        train(tiny_config(assets, tmp_path / "equal", steps=3, warmup_steps=3, eval_every=-1,
                          save_every=0))  # fmt: skip
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train(tiny_config(assets, tmp_path / "short", steps=3, warmup_steps=2, eval_every=-1,
                          save_every=0))  # fmt: skip
    assert _warmup_warnings(record) == []


def test_each_phase_of_two_phase_training_warns_of_its_own_warm_up():
    from focus_attention.training.run import _warn_long_warmup

    cfg = TrainConfig(method="two-phase", steps=10, phase1_steps=3, warmup_steps=4)
    cfg.validate()
    with pytest.warns(UserWarning) as record:
        _warn_long_warmup(cfg)
    (message,) = _warmup_warnings(record)
    assert "--warmup-steps 4 is not below phase 1 (3 steps)" in message


def _order(seed: int, n: int = 10, epochs: int = 2) -> list[int]:
    sampler = EpochPermutations(n, seed)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += list(sampler)
    return out


def test_data_order_is_a_seeded_permutation_per_epoch():
    seen = _order(5)
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # a fresh permutation each epoch
    assert seen == _order(5)
    assert _order(6)[:4] != seen[:4]
    assert len(EpochPermutations(7, 0)) == 7
    # whole optimizer steps: 10 blocks, 4 a step: 8 of each epoch's permutation
    cut = EpochPermutations(10, 5, step_blocks=4)
    assert list(cut) == seen[:8] and len(cut) == 8
    cut.set_epoch(1)
    assert list(cut) == seen[10:18]
    with pytest.raises(ValueError, match="3 training blocks, 4 per optimizer step"):
        EpochPermutations(3, 1, step_blocks=4)


def _steps_per_epoch(world: int, batch: int, accum: int, blocks: int = 10, epochs: int = 3) -> list[list[list[int]]]:  # fmt: skip
    """The blocks each optimizer step takes, every rank together, epoch by epoch, with the
    FocusTrainer's data order for ``world`` processes dealt to the ranks by accelerate
    (``BatchSamplerShard``, as the Trainer's data loader does)."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from focus_attention.training.trainer import FocusTrainer

    args = SimpleNamespace(per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                           world_size=world)  # fmt: skip
    trainer = SimpleNamespace(args=args, train_dataset=list(range(blocks)),
                              train_config=SimpleNamespace(seed=3))  # fmt: skip
    sampler = FocusTrainer._get_train_sampler(trainer)
    order = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ranks = [list(BatchSamplerShard(BatchSampler(sampler, batch, False), world, r)) for r in range(world)]  # fmt: skip
        assert all(len(b) % accum == 0 for b in ranks), "an epoch ends inside a step"
        steps = len(ranks[0]) // accum
        order.append([sorted(i for r in ranks for b in r[s * accum : (s + 1) * accum] for i in b)
                      for s in range(steps)])  # fmt: skip
    return order


@pytest.mark.parametrize("world, batch, accum", [(2, 1, 2), (2, 2, 1), (3, 1, 1), (4, 1, 2)])
def test_each_epoch_is_cut_to_whole_steps_of_every_process(world, batch, accum):
    """The epoch cut counts every process: N processes with grad_accum G take, step by step
    and epoch by epoch, the blocks one process takes with grad_accum N x G, and no epoch ends
    inside a step (accelerate would otherwise fill the last batches from the epoch's start)."""
    assert _steps_per_epoch(world, batch, accum) == _steps_per_epoch(1, batch, accum * world)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"steps": -1}, "steps"),
        ({"seq_len": 1}, "seq_len"),
        ({"seq_len": 128}, "seq_len.*every pair is inside the local window.*no gradient"),
        ({"seq_len": 16, "window": 8}, None),
        ({"seq_len": 8, "window": 8, "num_groups": 4, "top_k": 1}, "seq_len.*window \\(8\\)"),
        ({"lr": 0}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"weight_decay": "0.1"}, "weight_decay"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"batch_size": 0}, "batch_size"),
        ({"threads": 0}, "threads"),
        ({"resume": True, "overwrite": True}, "resume"),
        ({"top_k": 9}, "top_k"),
        ({"gate": "nope"}, "gate"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    if field is None:  # accepted
        train_config(**changes)
        return
    with pytest.raises(ValueError, match=field):
        train_config(**changes)


def test_config_round_trip_and_default_out():
    cfg = train_config(corpus="/data/my books/", num_groups=4, top_k=1, seed=3)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert str(cfg.out_dir()) == "runs/my-books"
    assert cfg.focus_config().num_groups == 4 and cfg.focus_config().seed == 3
    with pytest.raises(ValueError, match="unknown"):
        TrainConfig.from_dict({"bogus": 1})


def test_config_reads_the_flat_layout_of_earlier_runs():
    flat = {"steps": 5, "seq_len": 64, "num_groups": 4, "top_k": 1, "window": 8, "seed": 2}
    cfg = TrainConfig.from_dict(flat)
    assert cfg.steps == 5 and cfg.focus.num_groups == 4 and cfg.focus.window == 8
    assert cfg.focus_config().seed == 2


def test_config_refuses_forced_top_k_routing():
    with pytest.raises(ValueError, match="focus.routing"):
        train_config(routing="topk")


def test_missing_corpus_fails_before_the_model_loads(tmp_path, monkeypatch):

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the corpus was checked")

    monkeypatch.setattr("focus_attention.training.run.load_model", no_loading)
    cfg = TrainConfig(
        corpus=str(tmp_path / "nonexistent"), out=str(tmp_path / "run"), progress=False
    )
    with pytest.raises(ValueError, match="no such local text file or folder"):
        train(cfg)
    assert not (tmp_path / "run").exists()  # nothing written


def test_settings_saved_before_methods_existed_resume_as_focus():
    """A ``train_config.json`` / checkpoint config written before ``method`` and the LoRA
    settings existed reads as ``method = "focus"`` with no locked difference."""
    now = TrainConfig()
    old = {k: v for k, v in now.to_dict().items()
           if k not in ("method", "base_lr", "lora_rank", "lora_alpha", "lora_targets",
                        "lora_dropout", "phase1_steps", "phase2_method")}  # fmt: skip
    old["lr"] = 3e-2
    cfg = TrainConfig.from_dict(old)
    assert cfg.method == "focus" and cfg.lr == 3e-2
    assert cfg.locked_differences(now) == {}


def test_dense_layers_train_the_other_routers_only(assets, tmp_path):
    """A dense layer's router stays as initialised (two learning rates leave it equal, and
    its bias is never updated); with every layer dense there is nothing to train, and the
    run says so before the first step."""
    from focus_attention.hf import FocusConfig

    runs = {}
    for lr in (1e-2, 5e-2):
        out = tmp_path / f"lr{lr}"
        train(tiny_config(assets, out, steps=2, lr=lr, eval_every=-1, save_every=0,
                          dense_layers=[1]))  # fmt: skip
        runs[lr] = _weights(out)
    assert FocusConfig.from_json_file(out / "focus_config.json").dense_layers == (1,)
    a, b = runs.values()
    for name in ("proj", "centroids", "routing_bias", "bias_updates"):
        assert torch.equal(a[f"layer.1.{name}"], b[f"layer.1.{name}"]), name
    assert not torch.equal(a["layer.0.proj"], b["layer.0.proj"])
    assert float(a["layer.1.bias_updates"]) == 0 < float(a["layer.0.bias_updates"])
    with pytest.raises(ValueError, match="every Focus layer runs dense.*nothing to train"):
        train(tiny_config(assets, tmp_path / "all", steps=1, dense_layers=[0, 1]))


def test_init_adapter_starts_from_its_routers_under_this_runs_settings(assets, reference, tmp_path):  # fmt: skip
    """--init-adapter: zero steps save exactly the adapter's routers (bias and update count
    included) with this run's window; a trained step moves them from there; a run from
    fresh routers starts elsewhere."""
    from focus_attention.hf import FocusConfig

    src = _weights(reference.out)
    out = tmp_path / "zero"
    train(tiny_config(assets, out, steps=0, window=4, init_adapter=str(reference.out)))
    got = _weights(out)
    assert got.keys() == src.keys()
    for k in src:
        assert torch.equal(got[k], src[k]), k
    assert FocusConfig.from_json_file(out / "focus_config.json").window == 4
    fresh = _weights(train(tiny_config(assets, tmp_path / "fresh", steps=0)).out)
    assert not torch.equal(fresh["layer.0.centroids"], src["layer.0.centroids"])
    one = _weights(train(tiny_config(assets, tmp_path / "one", steps=1, eval_every=-1, save_every=0,
                                     init_adapter=str(reference.out))).out)  # fmt: skip
    assert not torch.equal(one["layer.0.centroids"], src["layer.0.centroids"])
    one_step = 0.1  # not a dtype tolerance: one step moves a centroid by far less than this
    torch.testing.assert_close(
        one["layer.0.centroids"], src["layer.0.centroids"], atol=one_step, rtol=0
    )
    assert int(one["layer.0.bias_updates"]) > int(src["layer.0.bias_updates"])


def test_init_adapter_errors(assets, reference, tmp_path):
    with pytest.raises(ValueError, match="num_groups=4, this model 8"):
        train(tiny_config(assets, tmp_path / "k8", steps=0, num_groups=8, top_k=2,
                          init_adapter=str(reference.out)))  # fmt: skip
    with pytest.raises(FileNotFoundError, match="focus_config.json not found"):
        train(tiny_config(assets, tmp_path / "none", steps=0, init_adapter=str(tmp_path)))
    with pytest.raises(ValueError, match="init_adapter.*no Focus routers"):
        train_config(method="lora", init_adapter=str(reference.out))
    with pytest.raises(ValueError, match="init_adapter"):
        train_config(init_adapter="")
