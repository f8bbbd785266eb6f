"""``focus train``: training a pretrained causal LM (docs/method.md §6).

By default (``method = "focus"``) only the Focus routers (``W_g`` and the centroids ``C`` of
every Focus layer, §1) train; every base parameter is frozen (checked before the first
step) and the base model runs in ``eval()`` mode (no dropout). The model routes softly
(Sinkhorn and the soft gate, §2-§3); each soft batch also updates the calibrated causal bias
used by top-k inference (§4). The other methods (LoRA, attention or full fine-tuning, LoRA
with Focus, two-phase) change what trains, in this same loop (:mod:`.methods`).

The run, step by step (:func:`train`): check the settings and the output directory, resume
from the newest checkpoint if asked, load the corpus and the model, attach Focus, then per
optimizer step: ``grad_accum`` micro-batches of next-token cross-entropy, gradient clipping,
AdamW, the learning-rate schedule (:mod:`.schedule`), a log record, validation when due
(top-k and soft perplexity on the validation split) and a checkpoint when due
(:mod:`.checkpoint`). Ctrl-C (SIGINT) between or during steps saves a checkpoint of the last
completed step and the adapter, then re-raises; a SIGINT arriving during the optimizer update
(and the building of its record) or a save waits until that finishes. A completed step is
always in the log: stopped during its validation, it is logged without the validation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..evaluation.trained import base_weights_report, tensor_digests
from ..hf import FocusModel
from ..hf.model import WEIGHTS_NAME
from ..utils.env import environment, library_versions, weights_sha256
from ..utils.io import write_json_atomic
from .checkpoint import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    LOG_NAME,
    PLOT_NAME,
    RESULT_NAME,
    checkpoint_path,
    latest_checkpoint,
    load_state,
    prepare_out,
    read_log,
    restore_rng_state,
    save_checkpoint,
    seed_everything,
    truncate_log,
)
from .config import RESUME_LOCKED_WHY, TrainConfig
from .distributed import Distributed
from .distributed import setup as setup_distributed
from .methods import (
    Trainee,
    build_trainee,
    dense_validation,
    phase_at,
    phase_schedule,
    start_phase2,
    step_loss,
    trainable_parameters,
)
from .plot import write_plot
from .schedule import block_indices
from .trainer import routing_dominance

__all__ = ["TrainResult", "train", "trainable_parameters"]

Callback = Callable[[int, dict[str, Any]], None]


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        out: the output directory (final adapter, log, plot, checkpoints).
        steps: optimizer steps completed in total (including those before a resume).
        start_step: the step this call started from (0, or the resumed checkpoint's).
        losses: training loss (mean next-token cross-entropy, nats/token) of every step run
            by this call, in order.
        validation: the validation records of this call: dicts with ``step``,
            ``val_ppl_topk``, ``val_ppl_soft``, ``val_tokens`` (and ``val_ppl_base`` at step
            0).
        final_loss: loss of the last step (``None`` if no step ran).
        seconds: wall-clock seconds of this call (loading included).
        train_seconds: cumulative seconds spent in the training loop over all resumes.
        trainable_parameters: number of trained values (Focus routers, LoRA matrices or
            base weights, by method; at the end of the run).
        adapter: directory of the final adapter (= ``out``).
        checkpoint: directory of the last checkpoint written (or ``None``).
        log: path of ``log.jsonl``; plot: path of ``train.png`` (``None`` if not written).
        extra: ``interrupted``, ``peak_memory_bytes`` (see :func:`peak_memory_bytes`),
            ``seconds_per_step`` (loop seconds over all steps, validation included),
            ``train_blocks``, ``prepend_bos``, ``base_weights_sha256`` (``before``,
            ``after``, ``equal``, ``changed``: the base tensors that changed, ``changed_count``,
            ``lora_tensors``), ``method`` (:meth:`~.methods.Trainee.describe`: method,
            trained values per group, learning rates, the LoRA rank and targets), for
            two-phase ``phase1_base_weights`` (``equal``, ``changed_count`` at the end of
            phase 1); ``already_finished`` for a ``--resume`` of a finished run.
    """

    out: Path
    steps: int
    start_step: int
    losses: list[float]
    validation: list[dict[str, Any]]
    final_loss: float | None
    seconds: float
    train_seconds: float
    trainable_parameters: int
    adapter: Path
    checkpoint: Path | None
    log: Path
    plot: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (paths as strings)."""
        d = dataclasses.asdict(self)
        for k in ("out", "adapter", "checkpoint", "log", "plot"):
            d[k] = None if d[k] is None else str(d[k])
        return d


class SigintGuard:
    """Turns SIGINT into ``KeyboardInterrupt`` at once, except inside :meth:`critical`
    sections (optimizer update, saves), where it is deferred to the section's end. Installed
    only in the main thread (elsewhere it is a no-op)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigintGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.depth > 0:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section that SIGINT does not cut: it raises ``KeyboardInterrupt`` at its end."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0 and self.pending:
                self.pending = False
                raise KeyboardInterrupt


def validation_perplexity(
    model: FocusModel, blocks: torch.Tensor, *, base: bool = False
) -> dict[str, Any]:
    """Validation perplexity of ``blocks`` with top-k and with soft routing (eval mode, no
    bias update) and, with ``base``, of the base model (Focus disabled); the model is put
    back into training mode (base model in eval mode)."""
    from ..evaluation.perplexity import score_windows

    model.eval()
    extra = {}
    try:
        if base:
            with model.disable_focus():
                nll_base, n = score_windows(model, blocks)
            extra["val_ppl_base"] = math.exp(nll_base / n)
        model.set_routing("topk")
        nll_topk, n = score_windows(model, blocks)
        model.set_routing("soft")
        nll_soft, _ = score_windows(model, blocks)
    finally:
        model.set_routing("auto")
        model.train()
        model.base_model.eval()
    return {
        "val_ppl_topk": math.exp(nll_topk / n),
        "val_ppl_soft": math.exp(nll_soft / n),
        "val_tokens": n,
        **extra,
    }


#: what :attr:`TrainResult.validation` keeps of a validation record
VALIDATION_KEYS = ("step", "val_ppl_topk", "val_ppl_soft", "val_ppl", "val_tokens", "val_ppl_base")


def _resume_state(cfg: TrainConfig, out: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """``(checkpoint, trainer state)`` to resume from, or ``(None, None)`` without resume.

    Raises:
        FileNotFoundError: ``resume`` without a checkpoint.
        ValueError: the checkpoint's settings differ in a field that changes the result.
    """
    if not cfg.resume:
        return None, None
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {out / CHECKPOINT_DIR}")
    state = load_state(ckpt)
    diff = TrainConfig.from_dict(state["config"]).locked_differences(cfg)
    if diff:
        why = "".join(f"; {RESUME_LOCKED_WHY[k]}" for k in diff if k in RESUME_LOCKED_WHY)
        raise ValueError(
            f"--resume: settings differ from the checkpoint {ckpt} "
            f"(field: (checkpoint, now)): {diff}{why}"
        )
    return ckpt, state


def _finished_result(out: Path, ckpt: Path, state: dict[str, Any], t_call: float) -> TrainResult:
    """``--resume`` of a run whose newest checkpoint is its last step: say so and touch
    nothing (the adapter, log, plot and ``train_result.json`` stay as they are)."""
    from ..hf.files import WEIGHTS_EXPECTED, read_safetensors

    step = int(state["step"])
    print(
        f"focus train: nothing to do: run already finished at step {step} ({out}); "
        "its files are left as they are",
        file=sys.stderr,
    )
    n_trainable = state.get("trainable_parameters")
    if n_trainable is None:  # a checkpoint from before the count was stored
        tensors, _ = read_safetensors(ckpt / WEIGHTS_NAME, WEIGHTS_EXPECTED)
        n_trainable = sum(
            t.numel() for k, t in tensors.items() if k.endswith((".proj", ".centroids"))
        )
    png = out / PLOT_NAME
    return TrainResult(
        out=out,
        steps=step,
        start_step=step,
        losses=[],
        validation=[],
        final_loss=None,
        seconds=time.monotonic() - t_call,
        train_seconds=float(state["elapsed"]),
        trainable_parameters=n_trainable,
        adapter=out,
        checkpoint=ckpt,
        log=out / LOG_NAME,
        plot=png if png.is_file() else None,
        extra={"already_finished": True},
    )


@dataclass
class _Data:
    """The model, tokenizer and token blocks of a run."""

    model: Any
    train_blocks: torch.Tensor
    val_blocks: torch.Tensor | None
    prepend_bos: bool
    tokenizer: Any = None


def _load_data(cfg: TrainConfig, corpus: Any) -> _Data:
    """Load the model, then cut the corpus' ``train`` (and ``validation``) split into blocks."""
    from ..assets.corpora import token_blocks
    from ..assets.models import auto_prepend_bos, load_model

    quiet = not cfg.progress
    model, tokenizer = load_model(cfg.model, quiet=quiet)
    bos = auto_prepend_bos(model) if cfg.prepend_bos is None else cfg.prepend_bos
    train_blocks = token_blocks(tokenizer, corpus.texts("train"), cfg.seq_len,
                                max_tokens=cfg.max_train_tokens, prepend_bos=bos)  # fmt: skip
    val_blocks = None
    if cfg.eval_every >= 0:
        val_blocks = token_blocks(tokenizer, corpus.texts("validation"), cfg.seq_len,
                                  max_tokens=cfg.eval_tokens, prepend_bos=bos)  # fmt: skip
    return _Data(model, train_blocks, val_blocks, bos, tokenizer)


class _Run:
    """One training run in progress: the model, optimizer, schedule, counters and files.

    The steps of :func:`train` are its methods, so that each one reads at once."""

    def __init__(
        self, cfg: TrainConfig, out: Path, data: _Data, ckpt: Path | None, step: int,
        digests: dict[str, str], dist: Distributed | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.out, self.data = cfg, out, data
        self.dist = dist or Distributed()
        self.digests = digests  # of the untouched base, per tensor
        self.phase1_report: dict[str, Any] | None = None
        self.use(build_trainee(cfg, data.model, data.tokenizer, ckpt, step))
        focus = self.trainee.focus
        self.dist.place(focus if focus is not None else self.trainee.model)  # device, sharding
        self.step, self.elapsed = 0, 0.0
        self.start_step = 0
        self.losses: list[float] = []
        self.validation: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = ckpt
        self.log_path = out / LOG_NAME
        self.unlogged: dict[str, Any] | None = None  # a completed step's record, not yet logged
        self.step_started = time.monotonic()
        self.num_blocks = int(data.train_blocks.shape[0])
        self.tokens_per_step = cfg.seq_len * cfg.batch_size * self.dist.global_accum(cfg.grad_accum)

    def use(self, trainee: Trainee) -> None:
        """Train ``trainee`` from now on: its parameters, a fresh AdamW and the schedule of
        its phase."""
        self.trainee = trainee
        self.last_lrs = [g["lr"] for g in trainee.groups]
        self.model = trainee.model
        self.params = trainee.params
        self.opt = trainee.optimizer(self.cfg)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, phase_schedule(self.cfg, trainee.phase)
        )

    def enter_phase(self) -> None:
        """Two-phase: switch to phase 2 when the next step belongs to it (the base weights
        at the end of phase 1 are compared with the untouched base first)."""
        if phase_at(self.cfg, self.step) == self.trainee.phase:
            return
        report = base_weights_report(self.digests, self.trainee.hf)
        self.phase1_report = {"equal": report["changed_count"] == 0,
                              "changed_count": report["changed_count"]}  # fmt: skip
        self.use(start_phase2(self.trainee, self.cfg))
        if self.cfg.progress:
            info = self.trainee.describe()
            groups = ", ".join(f"{k} {v:,d}" for k, v in info["groups"].items())
            print(f"\nfocus train: phase 2 from step {self.step + 1}: {self.num_trainable:,d} "
                  f"trainable parameters ({groups}); base weights unchanged in phase 1: "
                  f"{self.phase1_report['equal']}", file=sys.stderr)  # fmt: skip

    @property
    def num_trainable(self) -> int:
        return self.trainee.num_trainable

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from a trainer state (optimizer, schedule, RNG, step, seconds), dropping
        the log records after its step; without one, start a fresh log."""
        if state is None:
            if self.dist.is_main:
                self.log_path.unlink(missing_ok=True)
            return
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.phase1_report = state.get("phase1_base_weights")
        restore_rng_state(state["rng"])
        self.step, self.elapsed = int(state["step"]), float(state["elapsed"])
        self.start_step = self.step
        if self.dist.is_main:
            truncate_log(self.log_path, self.step)

    def announce(self, corpus_name: str) -> None:
        """What is about to train, on stderr."""
        m, cfg, info = self.model, self.cfg, self.trainee.describe()
        val = self.data.val_blocks
        groups = ", ".join(f"{k} {v:,d} (lr {info['lr'][k]:g})" for k, v in info["groups"].items())
        focus = f"; {len(m.focus_layers)} Focus layers" if self.trainee.focus is not None else ""
        lines = [
            f"focus train: {cfg.model} on {corpus_name} -> {self.out}; method {cfg.method}",
            f"  trainable parameters: {self.num_trainable:,d} of "
            f"{sum(p.numel() for p in m.parameters()):,d}: {groups}{focus}",
        ]
        lora = info.get("lora")
        if lora:
            lines.append(f"  LoRA rank {lora['rank']} (alpha {lora['alpha']:g}) on "
                         f"{lora['targets']} of {lora['modules']} modules")  # fmt: skip
        if cfg.method == "two-phase":
            what = "LoRA" if cfg.phase2_method == "lora" else "every base weight"
            lines.append(f"  two-phase: the routers alone for {cfg.phase1_steps} steps, then "
                         f"the routers and {what} (lr {cfg.base_lr:g}) for "
                         f"{cfg.steps - cfg.phase1_steps}")  # fmt: skip
        lines.append(f"  {self.num_blocks} training blocks of {cfg.seq_len} tokens; "
                     f"{self.tokens_per_step} tokens/step"
                     + (f"; validation {val.numel()} tokens" if val is not None else ""))  # fmt: skip
        print("\n".join(lines), file=sys.stderr)

    def emit(self, log: Any, rec: dict[str, Any], started: float) -> None:
        """Add the time since ``started`` to the loop's seconds and log ``rec`` with it."""
        self.elapsed += time.monotonic() - started
        rec["seconds"] = round(self.elapsed, 3)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        self.unlogged = None

    def validate(self, rec: dict[str, Any], *, base: bool = False) -> None:
        """Score the validation blocks into ``rec`` and keep them in ``validation``."""
        if self.trainee.focus is None:
            rec.update(dense_validation(self.trainee, self.data.val_blocks, base=base))
        else:
            rec.update(validation_perplexity(self.model, self.data.val_blocks, base=base))
            self.trainee.train_mode()
        self.validation.append({k: rec[k] for k in VALIDATION_KEYS if k in rec})

    def validation_due(self) -> bool:
        every = self.cfg.eval_every
        if self.data.val_blocks is None or every < 0:
            return False
        return self.step == self.cfg.steps or (every > 0 and self.step % every == 0)

    def save(self, guard: SigintGuard, log: Any, *, final: bool = False) -> None:
        """A checkpoint of the current step; ``final`` (end of run, Ctrl-C): also the
        adapter in ``out`` and the plot. SIGINT waits until it is written."""
        state = {
            "elapsed": self.elapsed,
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "config": self.cfg.to_dict(),
            "trainable_parameters": self.num_trainable,
            **self.dist.trainer_state(),
        }
        if self.phase1_report is not None:
            state["phase1_base_weights"] = self.phase1_report
        with guard.critical():
            if not self.dist.is_main:  # rank 0 writes the files
                self.last_checkpoint = checkpoint_path(self.out, self.step)
                return
            saver = self.dist.saver(self.trainee.focus) if self.dist.sharded else self.trainee
            self.last_checkpoint = save_checkpoint(
                saver, state, self.step, self.out, self.cfg.keep_checkpoints
            )
            if final:
                saver.save_pretrained(self.out)
                log.flush()
                write_plot(self.log_path, self.out / PLOT_NAME)

    def forward_backward(self) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        """The micro-batches of one optimizer step: the objective's metrics (``loss`` and
        the objective's own) and the routing dominance of each."""
        cfg = self.cfg
        metrics, doms = [], []
        accum = self.dist.global_accum(cfg.grad_accum)  # micro-batches per step, all ranks
        focus = self.trainee.focus
        self.dist.begin_step(focus.routers if focus is not None else {}, self.step)
        for micro in self.dist.local_micro_batches(cfg.grad_accum):
            idx = block_indices(self.step, micro, batch_size=cfg.batch_size,
                                grad_accum=accum, num_blocks=self.num_blocks,
                                seed=cfg.seed)  # fmt: skip
            x = self.dist.to_device(self.data.train_blocks[idx])
            gen = torch.Generator().manual_seed(
                (cfg.seed * 1_000_003 + self.step * accum + micro) % (2**63 - 1)
            )
            try:
                step = step_loss(self.trainee, x, cfg, gen)
            except RuntimeError as err:
                raise RuntimeError(f"{err} at step {self.step + 1}") from err
            (step.loss / accum).backward()
            metrics.append(step.metrics)
            doms.append(routing_dominance(step.records))
            del step
        self.dist.end_step(self.params)  # gradients and routing statistics over ranks
        return self.dist.gather_in_order(metrics), self.dist.gather_in_order(doms)

    def optimizer_step(self, guard: SigintGuard) -> tuple[float, float]:
        """Clip, update, advance the schedule and the step: ``(grad_norm, lr used)``."""
        with guard.critical():
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            self.last_lrs = [float(g["lr"]) for g in self.opt.param_groups]
            lr_now = self.last_lrs[0]
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
        return grad_norm, lr_now

    def train_step(self, guard: SigintGuard) -> dict[str, Any]:
        """One optimizer step; returns its log record (before validation)."""
        self.enter_phase()
        self.opt.zero_grad(set_to_none=True)
        metrics, doms = self.forward_backward()
        with guard.critical():  # the update and its record: a Ctrl-C cannot fall between
            grad_norm, lr_now = self.optimizer_step(guard)
            rec = self.step_record(metrics, doms, grad_norm, lr_now)
            self.unlogged = rec
        return rec

    def step_record(self, metrics: list[dict[str, float]], doms: list[dict[str, float]],
                    grad_norm: float, lr_now: float) -> dict[str, Any]:  # fmt: skip
        """The log record of the step just taken: the micro-batches' mean metrics, rates,
        gradient norm, routing dominance and tokens seen."""
        rec: dict[str, Any] = {"step": self.step}
        for key in metrics[0]:
            rec[key] = sum(m[key] for m in metrics) / len(metrics)
        rec.update(lr=lr_now, grad_norm=grad_norm)
        if len(self.opt.param_groups) > 1:  # the base side's rate, after the routers'
            rec["base_lr"] = self.last_lrs[1]
        if self.cfg.method == "two-phase":
            rec["phase"] = self.trainee.phase
        for key in ("dominance", "dominance_max", "dominance_topk"):
            vals = [d[key] for d in doms if key in d]
            if vals:
                rec[key] = max(vals) if key.endswith("max") else sum(vals) / len(vals)
        rec["tokens"] = self.step * self.tokens_per_step
        self.losses.append(rec["loss"])
        return rec

    def loop(self, guard: SigintGuard, log: Any, pbar: Any, callback: Callback | None) -> None:
        """Validate at step 0 (once per run), then step until ``steps``; checkpoints when
        due and a final save."""
        logged = self.dist.main_value(
            lambda: {r.get("step") for r in read_log(self.log_path) if _val_ppl(r) is not None}
        )
        if self.data.val_blocks is not None and self.step == 0 and 0 not in logged:
            t0 = time.monotonic()
            rec: dict[str, Any] = {"step": 0}
            self.validate(rec, base=True)
            self.emit(log, rec, t0)
            pbar.set_postfix(val_ppl=f"{_val_ppl(rec):.2f}")
        while self.step < self.cfg.steps:
            t0 = self.step_started = time.monotonic()
            rec = self.train_step(guard)
            if self.validation_due():
                self.validate(rec)
            self.emit(log, rec, t0)
            pbar.update(1)
            pbar.set_postfix(_postfix(rec))
            if callback is not None:
                callback(self.step, rec)
            every = self.cfg.save_every
            if every and self.step % every == 0 and self.step < self.cfg.steps:
                self.save(guard, log)
        self.save(guard, log, final=True)

    def run(self, callback: Callback | None) -> bool:
        """Train to the end or until Ctrl-C (then save); returns whether interrupted."""
        from tqdm.auto import tqdm

        quiet = not self.cfg.progress or not self.dist.is_main
        pbar = tqdm(total=self.cfg.steps, initial=self.step, disable=quiet, desc="train",
                    dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        with SigintGuard() as guard, self.dist.open_log(self.log_path) as log:
            try:
                self.loop(guard, log, pbar, callback)
            except KeyboardInterrupt:
                pbar.close()
                if self.unlogged is not None:  # stopped in the step's validation or log
                    self.emit(log, self.unlogged, self.step_started)
                self.dist.abort_step(self.step)  # multi-process: the step's routing statistics
                self.save(guard, log, final=True)
                print(
                    f"\nfocus train: interrupted after step {self.step}; adapter saved in "
                    f"{self.out}, checkpoint {self.last_checkpoint}; continue with --resume",
                    file=sys.stderr,
                )
                return True
            finally:
                pbar.close()
        return False


def _postfix(rec: dict[str, Any]) -> dict[str, str]:
    """The progress bar's summary of a step record."""
    post = {"loss": f"{rec['loss']:.3f}", "dom": f"{rec.get('dominance', 0):.2f}",
            "lr": f"{rec['lr']:.1e}"}  # fmt: skip
    if _val_ppl(rec) is not None:
        post["val_ppl"] = f"{_val_ppl(rec):.2f}"
    return post


def _val_ppl(rec: dict[str, Any]) -> float | None:
    """The headline validation perplexity of a log record: top-k with Focus, dense
    without; None in a record without validation."""
    return rec.get("val_ppl_topk", rec.get("val_ppl"))


def peak_memory_bytes() -> int:
    """Peak memory of this process so far, in bytes: the CUDA allocator's peak when CUDA is
    in use, else the peak resident set size (``getrusage``; 0 where unavailable)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB else


#: methods whose base weights must come out of training unchanged
FROZEN_BASE_METHODS = ("focus", "lora", "focus+lora")


def _weights_record(run: _Run, sha_before: str) -> dict[str, Any]:
    """``base_weights_sha256`` of the result: the SHA-256 of every base tensor before and
    after, whether they are equal, and which tensors changed (LoRA tensors apart)."""
    if run.cfg.method == "focus":
        sha_after = weights_sha256(run.dist.weights_view(run.model.base_model))
        changed = [] if sha_after == sha_before else base_weights_report(run.digests, run.trainee.hf)["changed"]  # fmt: skip
        lora = 0
    else:
        report = base_weights_report(run.digests, run.trainee.hf)
        sha_after, changed, lora = report["after"], report["changed"], report["lora_tensors"]
    return {"before": sha_before, "after": sha_after, "equal": sha_before == sha_after,
            "changed": changed, "changed_count": len(changed), "lora_tensors": lora}  # fmt: skip


def _finish(run: _Run, sha_before: str, interrupted: bool, t_call: float) -> TrainResult:
    """Check or report the base weights, write ``train_result.json`` and build the result.

    Raises:
        RuntimeError: the base model's weights changed in a method that keeps them frozen
            (:data:`FROZEN_BASE_METHODS`).
    """
    weights = _weights_record(run, sha_before)
    sha_after = weights["after"]
    out = run.out
    png = out / PLOT_NAME
    result = TrainResult(
        out=out,
        steps=run.step,
        start_step=run.start_step,
        losses=run.losses,
        validation=run.validation,
        final_loss=run.losses[-1] if run.losses else None,
        seconds=time.monotonic() - t_call,
        train_seconds=run.elapsed,
        trainable_parameters=run.num_trainable,
        adapter=out,
        checkpoint=run.last_checkpoint,
        log=run.log_path,
        plot=png if png.is_file() else None,
        extra={
            "interrupted": interrupted,
            "peak_memory_bytes": peak_memory_bytes(),
            "seconds_per_step": run.elapsed / max(1, run.step),
            "train_blocks": run.num_blocks,
            "prepend_bos": run.data.prepend_bos,
            "base_weights_sha256": weights,
            "method": run.trainee.describe(),
            **run.dist.describe(),
        },
    )
    if run.phase1_report is not None:
        result.extra["phase1_base_weights"] = run.phase1_report
    focus = run.trainee.focus
    doc = {**result.to_dict(), "config": run.cfg.to_dict(),
           "focus_config": focus.focus_config.to_dict() if focus is not None else None,
           "versions": library_versions(), "environment": environment()}  # fmt: skip
    if run.dist.is_main:
        write_json_atomic(out / RESULT_NAME, doc)
    if sha_after != sha_before and run.cfg.method in FROZEN_BASE_METHODS:
        trained = "Focus parameters" if run.cfg.method == "focus" else "LoRA and Focus parameters"
        raise RuntimeError(
            f"the base model's weights changed during training (SHA-256 {sha_before} before, "
            f"{sha_after} after; {weights['changed'][:3]}...): only the {trained} may train"
        )
    return result


def train(config: TrainConfig, *, callback: Callback | None = None) -> TrainResult:
    """Train a pretrained causal LM by ``config.method`` (docs/method.md §6): by default
    the Focus centroids of the frozen model.

    Args:
        config: the :class:`TrainConfig`.
        callback: called as ``callback(step, record)`` after every optimizer step with the
            1-based step count and its log record (after validation, before the periodic
            checkpoint). An exception raised there stops training; ``KeyboardInterrupt``
            is handled like Ctrl-C.

    Returns:
        a :class:`TrainResult`; the final adapter (and ``lora/`` or ``model/``, see
        :mod:`focus_attention.evaluation.trained`) is in ``config.out_dir()``.

    Raises:
        ValueError: bad configuration, an ``out`` directory holding another run (without
            ``resume``/``overwrite``), a ``resume`` whose settings differ from the
            checkpoint's (other than :data:`~.config.RESUME_FREE_FIELDS`), too little text.
        FileNotFoundError: ``resume`` without a checkpoint.
        RuntimeError: parameters that are trainable or frozen against the method, a
            non-finite loss, base weights that changed in a method that keeps them frozen
            (SHA-256 of every base tensor before and after training).
        KeyboardInterrupt: after Ctrl-C, once the adapter (in ``out``) and a checkpoint of
            the last completed step are saved.
    """
    from ..assets.corpora import load_corpus

    t_call = time.monotonic()
    cfg = config
    cfg.validate()
    out = cfg.out_dir()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    dist = setup_distributed()  # one process unless started by torchrun / accelerate launch
    if dist.is_main:
        prepare_out(out, resume=cfg.resume, overwrite=cfg.overwrite)
    dist.barrier()  # the other ranks read out once rank 0 has checked and cleared it
    ckpt, state = _resume_state(cfg, out)
    dist.check_resume(state, cfg.grad_accum)
    dist.check_method(cfg.method)
    if state is not None and int(state["step"]) >= cfg.steps:
        return _finished_result(out, ckpt, state, t_call)
    with dist.main_first():  # rank 0 prepares the caches, the others then read them
        corpus = load_corpus(cfg.corpus, quiet=not cfg.progress)  # fails before the model
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / CONFIG_FILE, cfg.to_dict())
    seed_everything(cfg.seed)
    with dist.main_first():
        data = _load_data(cfg, corpus)
    sha_before = weights_sha256(data.model)
    step = int(state["step"]) if state is not None else 0
    run = _Run(cfg, out, data, ckpt, step, tensor_digests(data.model), dist)
    run.restore(state)
    run.trainee.train_mode()
    if cfg.progress and dist.is_main:
        run.announce(corpus.name)
    interrupted = run.run(callback)
    result = _finish(run, sha_before, interrupted, t_call)
    if interrupted:
        raise KeyboardInterrupt
    return result
