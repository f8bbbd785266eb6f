"""FocusTrainer: every method and objective trains under transformers.Trainer exactly as the
reference step (step_loss, AdamW over the method's groups, the phase schedule, clipping) on
the batches the Trainer fed, and its log entries carry the objective's metrics."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
from tiny import FOCUS_DEFAULTS, build_model, ids
from tolerances import tolerance

from focus_attention.hf import FocusConfig
from focus_attention.training.config import TrainConfig
from focus_attention.training.distributed import end_process_group
from focus_attention.training.methods import build_trainee, phase_schedule, step_loss
from focus_attention.training.trainer import FocusTrainer

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
from transformers import TrainingArguments  # noqa: E402

STEPS, ACCUM, BATCH = 2, 2, 2


def config(method: str, objective: str = "lm") -> TrainConfig:
    base_lr = 1e-3 if method in ("focus+lora", "two-phase") else None
    return TrainConfig(method=method, objective=objective, seq_len=32, batch_size=BATCH,
                       grad_accum=ACCUM, steps=STEPS, warmup_steps=1, lr=1e-2, base_lr=base_lr,
                       max_grad_norm=0.5, weight_decay=0.01, coverage_queries=8, seed=3,
                       focus=FocusConfig(**FOCUS_DEFAULTS))  # fmt: skip


class Recording(FocusTrainer):
    """FocusTrainer that keeps the micro-batches it trained on, in order."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.fed.append(inputs["input_ids"].clone())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def trained(trainee) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in trainee.model.named_parameters()}
    return {names[id(p)]: p.detach().clone() for p in trainee.params}


def trainer_run(cfg: TrainConfig, out) -> tuple[dict, list[torch.Tensor], list[dict]]:
    torch.set_num_threads(1)
    trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_grad_norm=cfg.max_grad_norm,
                             seed=cfg.seed, use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=1, disable_tqdm=True)  # fmt: skip
    rows = [{"input_ids": r} for r in ids(12, cfg.seq_len, seed=9)]
    run = Recording(args=args, train_dataset=rows, trainee=trainee, config=cfg)
    run.fed = []
    run.train()
    return trained(trainee), run.fed, run.state.log_history


def reference_run(cfg: TrainConfig, fed: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step by hand: micro-batch losses / ACCUM, clipping, AdamW, the phase schedule."""
    trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
    opt = trainee.optimizer(cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, phase_schedule(cfg, 1))
    for index, x in enumerate(fed):
        trainee.train_mode()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
        (step_loss(trainee, x, cfg, gen).loss / ACCUM).backward()
        if index % ACCUM == ACCUM - 1:
            torch.nn.utils.clip_grad_norm_(trainee.params, cfg.max_grad_norm)
            opt.step()
            schedule.step()
            opt.zero_grad()
    return trained(trainee)


@pytest.mark.parametrize(
    ("method", "objective"),
    [("focus", "lm"), ("focus", "distill"), ("focus", "mix"), ("focus", "coverage"),
     ("focus+lora", "lm"), ("lora", "lm"), ("attention", "lm"), ("full", "lm")],
)  # fmt: skip
def test_every_method_and_objective_trains_as_the_reference_step(tmp_path, method, objective):
    cfg = config(method, objective)
    got, fed, log = trainer_run(cfg, tmp_path)
    assert len(fed) == STEPS * ACCUM
    want = reference_run(cfg, fed)
    before = trained(build_trainee(cfg, build_model("llama"), None, None, 0))
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tolerance("rounding"), msg=name)
    assert any(not torch.equal(got[n], before[n]) for n in got)  # training moved something
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    if method in ("focus", "focus+lora"):
        assert all("dominance" in e and "objective_loss" in e for e in steps)
    if objective in ("distill", "mix"):
        assert all("distill_kl" in e for e in steps)
    if objective == "coverage":
        assert all(0 <= e["coverage_soft"] <= 1 for e in steps)


WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def data_parallel_run(cfg: TrainConfig, out: str, accum: int, backend: str | None = None) -> dict:
    """FocusTrainer with ``accum`` micro-batches per step: trained tensors and the routers'
    buffers."""
    torch.set_num_threads(1)
    trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=accum, max_grad_norm=cfg.max_grad_norm,
                             seed=cfg.seed, use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, ddp_backend=backend, ddp_timeout=180)  # fmt: skip
    rows = [{"input_ids": r} for r in ids(12, cfg.seq_len, seed=9)]
    FocusTrainer(args=args, train_dataset=rows, trainee=trainee, config=cfg).train()
    buffers = {k: v.clone() for k, v in trainee.model.named_buffers() if "routers" in k}
    return {**trained(trainee), **buffers}


def _rank(rank: int, port: int, out: str, method: str) -> None:
    os.environ.update(FOCUS_NO_EXTENSION="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD))  # fmt: skip
    got = data_parallel_run(config(method), f"{out}/run", 1, "gloo")
    torch.save(got, f"{out}/rank{rank}.pt")
    assert end_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["focus", "focus+lora"])
def test_two_processes_train_as_one_with_twice_the_accumulation(tmp_path, method):
    """DDP (gloo, the Trainer's defaults) on 2 ranks with accumulation 1 gives, on both ranks,
    the routers, routing bias, update count (and LoRA) of one process accumulating 2."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(_free_port(), str(tmp_path), method), nprocs=WORLD, join=True)
    want = data_parallel_run(config(method), str(tmp_path / "one"), WORLD)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got) == set(want)
        for name, value in want.items():
            if value.is_floating_point():
                torch.testing.assert_close(got[name], value, **tolerance("oracle"), msg=name)
            else:
                assert torch.equal(got[name], value), name
        assert int(got["routers.0.bias_updates"]) == STEPS * WORLD


@pytest.mark.parametrize("method", ["focus", "lora"])
def test_evaluate_gives_the_validation_perplexities_of_the_run(tmp_path, method):
    """Focus: top-k perplexity with the run's top_k and soft perplexity; dense methods: the
    model's perplexity; at the run's first step also the base model's; scored block by
    block; the routing and top_k are left as they were."""
    from focus_attention.evaluation.perplexity import score_windows

    cfg = config(method)
    trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
    blocks = ids(3, cfg.seq_len, seed=11)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                             disable_tqdm=True)  # fmt: skip
    run = FocusTrainer(args=args, trainee=trainee, config=cfg, val_blocks=blocks)
    got = run.evaluate()
    model = trainee.model
    model.eval()
    with torch.no_grad():
        if trainee.focus is None:
            nll, n = score_windows(model, blocks)
            want = {"val_ppl": math.exp(nll / n), "val_ppl_base": math.exp(nll / n)}
        else:
            with model.disable_focus():
                base, _ = score_windows(model, blocks)
            model.set_routing("topk")
            nll, n = score_windows(model, blocks)
            model.set_routing("soft")
            soft, _ = score_windows(model, blocks)
            model.set_routing("auto")
            want = {"val_ppl_topk": math.exp(nll / n), "val_ppl_soft": math.exp(soft / n),
                    "val_ppl_base": math.exp(base / n)}  # fmt: skip
    assert got == pytest.approx({**want, "val_tokens": n}, rel=1e-12)
    assert got["val_tokens"] == 3 * (cfg.seq_len - 1)
    if trainee.focus is not None:
        assert model.focus_config.top_k == cfg.focus.top_k and model.routing_mode == "topk"
    assert [e for e in run.state.log_history if "val_tokens" in e]  # logged


def test_two_phase_is_two_trainer_runs_with_a_fresh_optimizer_and_schedule_each(tmp_path):
    """Phase 1 trains the routers alone, phase 2 (start_phase2) the routers and LoRA, each a
    FocusTrainer run with its own AdamW and warm-up/cosine schedule: equal to the reference
    step replayed on the batches each run fed."""
    from focus_attention.training.methods import start_phase2

    cfg = config("two-phase")
    cfg.steps, cfg.phase1_steps, cfg.phase2_method = 2 * STEPS, STEPS, "lora"
    cfg.validate()

    def runs(step_fn):
        trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
        fed_by_phase = []
        for phase in (1, 2):
            if phase == 2:
                trainee = start_phase2(trainee, cfg)
            fed_by_phase.append(step_fn(trainee, phase, len(fed_by_phase)))
        return trained(trainee), fed_by_phase

    def with_trainer(trainee, phase, _):
        args = TrainingArguments(output_dir=str(tmp_path / f"phase{phase}"), max_steps=STEPS,
                                 per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
                                 max_grad_norm=cfg.max_grad_norm, seed=cfg.seed, use_cpu=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
        rows = [{"input_ids": r} for r in ids(12, cfg.seq_len, seed=9)]
        run = Recording(args=args, train_dataset=rows, trainee=trainee, config=cfg)
        run.fed = []
        run.train()
        assert trainee.phase == phase and len(run.optimizer.param_groups) == phase
        return run.fed

    got, fed = runs(with_trainer)

    def by_hand(trainee, phase, index):
        opt = trainee.optimizer(cfg)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, phase_schedule(cfg, phase))
        for i, x in enumerate(fed[index]):
            trainee.train_mode()
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
            (step_loss(trainee, x, cfg, gen).loss / ACCUM).backward()
            if i % ACCUM == ACCUM - 1:
                torch.nn.utils.clip_grad_norm_(trainee.params, cfg.max_grad_norm)
                opt.step()
                schedule.step()
                opt.zero_grad()

    want, _ = runs(by_hand)
    assert set(got) == set(want) and any(".lora_" in n for n in got)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tolerance("rounding"), msg=name)


def checkpointed_run(cfg: TrainConfig, out, resume=None) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
    args = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_grad_norm=cfg.max_grad_norm,
                             seed=cfg.seed, use_cpu=True, report_to=[], save_steps=2,
                             disable_tqdm=True)  # fmt: skip
    rows = [{"input_ids": r} for r in ids(24, cfg.seq_len, seed=9)]
    FocusTrainer(args=args, train_dataset=rows, trainee=trainee, config=cfg).train(
        resume_from_checkpoint=resume
    )
    buffers = {k: v.clone() for k, v in trainee.model.named_buffers() if "routers" in k}
    return {**trained(trainee), **buffers}


@pytest.mark.slow
@pytest.mark.parametrize(("method", "parts"), [("focus+lora", {"lora"}), ("full", {"model"})])
def test_checkpoints_hold_every_trained_part_and_resume_exactly(tmp_path, method, parts):
    """A checkpoint holds the method's output (Focus adapter, lora/, model/); resuming a fresh
    model from the step-2 checkpoint ends where the uninterrupted run ends."""
    cfg = config(method)
    straight = checkpointed_run(cfg, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert parts <= {p.name for p in ckpt.iterdir()}
    assert (ckpt / "focus_config.json").is_file() == (method == "focus+lora")
    resumed = checkpointed_run(cfg, tmp_path / "again", resume=str(ckpt))
    assert set(resumed) == set(straight)
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, **tolerance("rounding"), msg=name)


@pytest.mark.parametrize("objective", ["lm", "distill"])
def test_the_focus_method_leaves_every_base_tensor_unchanged(tmp_path, objective):
    """SHA-256 of the base model's state before and after FocusTrainer (dropout-free base in
    eval mode, frozen weights); the routers did train."""
    from focus_attention.utils.env import weights_sha256

    cfg = config("focus", objective)
    trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
    before, routers = weights_sha256(trainee.hf), trained(trainee)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    rows = [{"input_ids": r} for r in ids(8, cfg.seq_len, seed=9)]
    FocusTrainer(args=args, train_dataset=rows, trainee=trainee, config=cfg).train()
    assert weights_sha256(trainee.hf) == before
    assert all(not torch.equal(v, routers[k]) for k, v in trained(trainee).items())
