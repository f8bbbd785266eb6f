"""``focus train``: training a pretrained causal LM by method (docs/method.md §6) on
``transformers.Trainer`` (:class:`~.trainer.FocusTrainer`).

By default (``method = "focus"``) only the Focus routers (``W_g`` and the centroids ``C`` of
every Focus layer, §1) train; every base parameter is frozen (checked before the first
step, and by SHA-256 of every base tensor after the last) and the base model runs in
``eval()`` mode (no dropout). The model routes softly (Sinkhorn and the soft gate, §2-§3);
each soft batch also updates the calibrated causal bias used by top-k inference (§4). The
other methods (LoRA, attention or full fine-tuning, LoRA with Focus, two-phase) change what
trains (:mod:`.methods`); two-phase runs are two Trainer runs, one per phase.

The run (:func:`train`): check the settings and the output directory, find the checkpoint
to resume from, load the corpus and the model, build the method's model, then let the
Trainer train (gradient accumulation, clipping, AdamW over the method's groups, the
warm-up and cosine schedule, the data order, validation, checkpoints, ``torchrun`` and
``accelerate launch``), and write the final output (:mod:`.outputs`). Ctrl-C (SIGINT)
finishes the step in progress, checkpoints it, writes the output and re-raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PrinterCallback, ProgressCallback, TrainingArguments, set_seed

from ..assets.blocks import token_blocks
from ..assets.corpora import load_corpus
from ..assets.models import auto_prepend_bos, load_model
from ..evaluation.needles import needle_blocks
from ..hf.run_folder import base_weights_report, tensor_digests
from ..utils.env import environment, library_versions, weights_sha256
from ..utils.io import (
    UnreadableFileError,
    exclusive_lock,
    read_json_record,
    replace_entries,
    write_json_atomic,
)
from .callbacks import (
    CurrentIntervals,
    JsonlLog,
    SigintCheckpoint,
    StepHook,
    StepProgress,
    StepTimer,
)
from .config import RESUME_FREE_FIELDS, RESUME_LOCKED_WHY, TrainConfig
from .methods import Trainee, build_trainee, start_phase2
from .outputs import (
    CONFIG_FILE,
    LOCK_NAME,
    LOG_NAME,
    PLOT_NAME,
    RESULT_EXPECTED,
    RESULT_NAME,
    Checkpoint,
    check_checkpoint,
    checkpoint_root,
    data_fingerprint,
    newest_checkpoint,
    prepare_out,
    read_log,
    read_train_result,
    remove_staging_leftovers,
    train_result_unfinished,
    trained_parts_differences,
    truncate_log,
)
from .plot import write_plot
from .schedule import lr_factor, warn_long_warmup
from .trainer import FocusTrainer, sharding

try:
    import resource
except ImportError:  # not on Windows
    resource = None

__all__ = ["TrainResult", "peak_memory_bytes", "train", "unfinished_output"]

Callback = Callable[[int, dict[str, Any]], None]
#: methods whose base weights must come out of training unchanged
FROZEN_BASE_METHODS = ("focus", "lora", "focus+lora")
#: what :attr:`TrainResult.validation` keeps of a validation entry
VALIDATION_KEYS = ("step", "val_ppl_topk", "val_ppl_soft", "val_ppl", "val_tokens", "val_ppl_base")


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        out: the output directory (final output, log, plot, checkpoints).
        steps: optimizer steps completed in total (including those before a resume).
        start_step: the step this call started from (0, or the resumed checkpoint's).
        losses: training loss (the objective's, averaged over the step's micro-batches and
            processes; nats/token for ``lm``) of every step run by this call, in order.
        validation: the validation entries of this call: dicts with ``step``,
            ``val_ppl_topk``, ``val_ppl_soft`` (Focus) or ``val_ppl`` (dense methods),
            ``val_tokens`` (and ``val_ppl_base`` at step 0).
        final_loss: loss of the last step (``None`` if no step ran).
        seconds: wall-clock seconds of this call (loading included).
        train_seconds: seconds spent in optimizer steps over all resumes.
        trainable_parameters: number of trained values (Focus routers, LoRA matrices or
            base weights, by method; at the end of the run).
        adapter: directory of the final adapter (= ``out``).
        checkpoint: directory of the newest checkpoint (or ``None``).
        log: path of ``log.jsonl``; plot: path of ``train.png`` (``None`` if not written).
        extra: ``interrupted``, ``peak_memory_bytes`` (:func:`peak_memory_bytes`),
            ``seconds_per_step``, ``train_blocks``, ``prepend_bos``, ``base_weights_sha256``
            (``before``, ``after``, ``equal``, ``changed``: the base tensors that changed,
            ``changed_count``, ``lora_tensors``), ``method``
            (:meth:`~.methods.Trainee.describe`), ``distributed`` (``world_size``,
            ``requested``, ``sharded``), for two-phase ``phase1_base_weights`` (``equal``,
            ``changed_count`` at the end of phase 1), ``data`` (the fingerprint of the
            training data, :func:`~.outputs.data_fingerprint`); ``already_finished`` for a
            ``--resume`` of a finished run.
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


def peak_memory_bytes() -> int:
    """Peak memory of this process so far, in bytes: the CUDA allocator's peak when CUDA is
    in use, else the peak resident set size (``getrusage``; 0 where unavailable)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    if resource is None:
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB else


def training_arguments(cfg: TrainConfig, out: Path, phase: int, steps: int, *,
                       validate_at_start: bool) -> Any:  # fmt: skip
    """The ``transformers.TrainingArguments`` of one phase of a run: ``steps`` optimizer
    steps of ``grad_accum`` micro-batches of ``batch_size`` blocks per process, clipping at
    ``max_grad_norm``, a log entry every step, validation every ``eval_every`` steps and at
    the end (``< 0``: never), a checkpoint every ``save_every`` steps and at the end (the
    newest ``keep_checkpoints`` kept), into :func:`~.outputs.checkpoint_root`. The optimizer
    and schedule are :class:`~.trainer.FocusTrainer`'s."""
    validate = cfg.eval_every >= 0
    return TrainingArguments(
        output_dir=str(checkpoint_root(out, phase)),
        max_steps=steps,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        logging_steps=1,
        eval_strategy="steps" if validate else "no",
        eval_steps=(cfg.eval_every or steps) if validate else None,
        eval_on_start=validate and validate_at_start,
        save_strategy="steps",
        save_steps=cfg.save_every or steps,
        save_total_limit=cfg.keep_checkpoints,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        remove_unused_columns=False,  # the rows are {"input_ids"}; FocusTrainer reads them
    )


@dataclass
class _Data:
    """The model, tokenizer and token blocks of a run, and the fingerprint of the training
    blocks (:func:`~.outputs.data_fingerprint`)."""

    model: Any
    tokenizer: Any
    train_blocks: torch.Tensor
    val_blocks: torch.Tensor | None
    prepend_bos: bool
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fingerprint = data_fingerprint(self.train_blocks)


def _train_blocks(cfg: TrainConfig, corpus: Any, tokenizer: Any, bos: bool) -> torch.Tensor:
    """The training blocks: the ``train`` split cut into blocks, then ``retrieval_blocks``
    needle prompts of the ``train`` split; with ``head-gates`` needle prompts of the
    ``validation`` split instead, one per block of the run."""
    if cfg.method != "head-gates":
        blocks = token_blocks(tokenizer, corpus.texts("train"), cfg.seq_len,
                              max_tokens=cfg.max_train_tokens, prepend_bos=bos)  # fmt: skip
        if not cfg.retrieval_blocks:
            return blocks
        needles = needle_blocks(tokenizer, cfg.corpus, "train", cfg.seq_len, cfg.retrieval_blocks,
                                cfg.seed, tokenizer.bos_token_id if bos else None)  # fmt: skip
        return torch.cat([blocks, needles.to(blocks.dtype)])

    count = max(1, cfg.steps) * cfg.batch_size * cfg.grad_accum
    return needle_blocks(tokenizer, cfg.corpus, "validation", cfg.seq_len, count, cfg.seed,
                         tokenizer.bos_token_id if bos else None)  # fmt: skip


def _load_data(cfg: TrainConfig, corpus: Any) -> _Data:
    """Load the model, then cut the corpus' ``train`` (and ``validation``) split into blocks."""
    model, tokenizer = load_model(cfg.model, quiet=not cfg.progress)
    bos = auto_prepend_bos(model) if cfg.prepend_bos is None else cfg.prepend_bos
    try:
        train_blocks = _train_blocks(cfg, corpus, tokenizer, bos)
    except ValueError as err:
        raise ValueError(f"the train split (--max-train-tokens {cfg.max_train_tokens}): {err}") from err  # fmt: skip
    val_blocks = None
    if cfg.eval_every >= 0:
        try:
            val_blocks = token_blocks(tokenizer, corpus.texts("validation"), cfg.seq_len,
                                      max_tokens=cfg.eval_tokens, prepend_bos=bos)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"the validation split (--eval-tokens {cfg.eval_tokens}): {err}") from err  # fmt: skip
    return _Data(model, tokenizer, train_blocks, val_blocks, bos)


def _resume_point(cfg: TrainConfig, out: Path, world_size: int) -> Checkpoint | None:
    """The checkpoint to resume from (None without ``resume``).

    Raises:
        FileNotFoundError: ``resume`` without a checkpoint.
        ValueError: the run's settings differ in a field that changes the result, or the
            checkpoint was written by another number of processes.
        UnreadableFileError: a damaged ``train_config.json`` (naming it).
    """
    if not cfg.resume:
        return None
    ckpt = newest_checkpoint(out)
    if ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {checkpoint_root(out)}")
    diff = saved_config(out).locked_differences(cfg)
    if diff:
        why = "".join(f"; {RESUME_LOCKED_WHY[k]}" for k in diff if k in RESUME_LOCKED_WHY)
        free = ", ".join(f"--{name.replace('_', '-')}" for name in RESUME_FREE_FIELDS
                         if name not in ("resume", "overwrite", "out"))  # fmt: skip
        raise ValueError(f"--resume: settings differ from the run in {out} "
                         f"(field: (saved, now)): {diff}{why}; a resume may change only "
                         f"{free}")  # fmt: skip
    if ckpt.world_size != world_size:
        raise ValueError(
            f"--resume: the checkpoint was written by {ckpt.world_size} processes, this run "
            f"has {world_size}; resume with {ckpt.world_size} processes (grad_accum "
            f"{cfg.grad_accum}) so each step takes the same micro-batches"
        )
    return ckpt


def saved_config(out: Path) -> TrainConfig:
    """The settings of the run in ``out`` (its ``train_config.json``).

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: a file that is damaged or holds no valid settings (the
            message names it and what is wrong).
    """
    path, expected = out / CONFIG_FILE, "the settings of a focus train run (a JSON object)"
    saved = read_json_record(path, expected)
    try:
        return TrainConfig.from_dict(saved)
    except (TypeError, ValueError) as err:
        raise UnreadableFileError(f"{path}: {err}; expected {expected}") from err


def unfinished_output(cfg: TrainConfig, out: Path, ckpt: Checkpoint) -> list[str]:
    """Why the output in ``out`` is not the finished run of ``cfg`` whose last checkpoint
    is ``ckpt`` (a run whose final save was interrupted, failed or killed keeps the output
    it had before): no readable ``train_result.json``, one that records another step count,
    an interrupted run, no interrupted flag (an older release's result), other settings
    (:func:`~.outputs.train_result_unfinished`), or trained parts (adapter weights,
    ``lora/``, ``model/``, head gates) other than the checkpoint's
    (:func:`~.outputs.trained_parts_differences`).

    Returns:
        the reasons, one phrase each; ``[]`` when the output is the finished run's.
    """
    try:
        doc = read_json_record(out / RESULT_NAME, RESULT_EXPECTED)
    except (OSError, ValueError) as err:
        return [str(err)]
    why = train_result_unfinished(doc, ckpt.step)
    try:
        changed = sorted(TrainConfig.from_dict(doc.get("config") or {}).locked_differences(cfg))
    except (AttributeError, TypeError, ValueError):
        changed = ["config"]
    if changed:
        why.append(f"{RESULT_NAME} records other settings ({', '.join(changed)})")
    differ = trained_parts_differences(out, ckpt.path)
    if differ:
        why.append(f"{', '.join(differ)} not those of {ckpt.path.name}")
    return why


def _finished_result(out: Path, ckpt: Checkpoint, t_call: float) -> TrainResult:
    """``--resume`` of a finished run (:func:`unfinished_output` found nothing missing): say
    so and touch nothing."""
    doc = read_train_result(out / RESULT_NAME)
    print(f"focus train: nothing to do: run already finished at step {ckpt.step} ({out}); "
          "its files are left as they are", file=sys.stderr)  # fmt: skip
    png = out / PLOT_NAME
    return TrainResult(out=out, steps=ckpt.step, start_step=ckpt.step, losses=[],
                       validation=[], final_loss=None, seconds=time.monotonic() - t_call,
                       train_seconds=float(doc.get("train_seconds", 0.0)),
                       trainable_parameters=int(doc["trainable_parameters"]), adapter=out,
                       checkpoint=ckpt.path, log=out / LOG_NAME,
                       plot=png if png.is_file() else None,
                       extra={"already_finished": True})  # fmt: skip


class _Run:
    """One training run in progress: its settings, files, data, model and callbacks; the
    steps of :func:`train` are its methods."""

    def __init__(self, cfg: TrainConfig, out: Path, data: _Data, ckpt: Checkpoint | None,
                 args: Any, callback: Callback | None) -> None:  # fmt: skip
        self.cfg, self.out, self.data, self.ckpt, self.args = cfg, out, data, ckpt, args
        self.callback = callback
        self.main = args.should_save
        self.start_step = ckpt.step if ckpt is not None else 0
        self.log_path = out / LOG_NAME
        self.sha_before = weights_sha256(data.model)
        self.digests = tensor_digests(data.model)  # of the untouched base, per tensor
        self.trainee: Trainee = build_trainee(cfg, data.model, data.tokenizer, None, 0)
        self.rows: list[dict[str, Any]] = []  # this call's log entries
        self.sigint = SigintCheckpoint()
        earlier = read_log(self.log_path) if ckpt is not None else []
        seconds = [r["seconds"] for r in earlier if r.get("step", 0) <= self.start_step and "seconds" in r]  # fmt: skip
        self.timer = StepTimer(seconds[-1] if seconds else 0.0)
        self.progress = StepProgress(cfg.steps, self.start_step) if cfg.progress and self.main else None  # fmt: skip
        self.distributed: dict[str, Any] = {}

    def phases(self) -> list[tuple[int, int, int]]:
        """``(phase, steps, step_offset)`` of each phase with steps."""
        cfg = self.cfg
        if cfg.method != "two-phase":
            return [(1, cfg.steps, 0)]
        first = cfg.phase1_steps
        return [p for p in ((1, first, 0), (2, cfg.steps - first, first)) if p[1] > 0]

    def start_log(self) -> None:
        """A fresh log, or the resumed one without the entries after the checkpoint."""
        if not self.main:
            return
        if self.ckpt is None:
            self.log_path.unlink(missing_ok=True)
        else:
            truncate_log(self.log_path, self.ckpt.step)

    def trainer(self, phase: int, steps: int, offset: int, resume: bool) -> FocusTrainer:
        """The :class:`FocusTrainer` of one phase, with the run's callbacks."""
        cfg = self.cfg
        args = training_arguments(cfg, self.out, phase, steps, validate_at_start=offset == 0 and not resume)  # fmt: skip
        rows = [{"input_ids": b} for b in self.data.train_blocks]
        log = JsonlLog(self.log_path, offset, self.rows)  # this call's entries, every phase
        callbacks: list[Any] = [CurrentIntervals(), self.timer, log]
        if self.callback is not None:  # before the Ctrl-C check of the same entry
            callbacks.append(StepHook(self.callback, offset))
        callbacks.append(self.sigint)
        if self.progress is not None:
            callbacks.append(self.progress)
        val = self.data.val_blocks
        trainer = FocusTrainer(args=args, train_dataset=rows, eval_dataset=rows[:1] if val is not None else None,
                               trainee=self.trainee, config=cfg, val_blocks=val,
                               step_offset=offset, data=self.data.fingerprint,
                               callbacks=callbacks)  # fmt: skip
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        return trainer

    def run_phase(self, phase: int, steps: int, offset: int) -> None:
        """Train one phase (resumed from the run's checkpoint when it belongs to it)."""
        ckpt = self.ckpt
        if ckpt is not None and ckpt.phase > phase:
            return  # this phase finished before the checkpoint
        if phase == 2:
            self.phase1 = base_weights_report(self.digests, self.trainee.hf)
            self.trainee = start_phase2(self.trainee, self.cfg)
        resume = ckpt is not None and ckpt.phase == phase
        if resume and ckpt.local_step >= steps:  # the phase ended with this checkpoint
            self.trainee.load_checkpoint(ckpt.path)
            return
        trainer = self.trainer(phase, steps, offset, resume)
        self.distributed = sharding(trainer)
        trainer.train(resume_from_checkpoint=str(ckpt.path) if resume else None)

    def validate_untrained(self) -> None:
        """A run of 0 steps: the validation of step 0 (when validation is on)."""
        if self.data.val_blocks is None:
            return
        trainer = self.trainer(1, 1, 0, False)
        trainer.evaluate()

    def train(self) -> None:
        """Every phase in turn, until the end or Ctrl-C."""
        self.phase1: dict[str, Any] | None = None
        phases = self.phases() if self.cfg.steps > 0 else []
        if not phases and self.ckpt is None:
            self.validate_untrained()
        try:
            for phase, steps, offset in phases:
                self.run_phase(phase, steps, offset)
                if self.sigint.interrupted:
                    break
        finally:
            if self.progress is not None:
                self.progress.close()

    def steps_done(self) -> int:
        """Optimizer steps of the run so far."""
        done = [r["step"] for r in self.rows if "loss" in r]
        return max(done, default=self.start_step)

    def weights_record(self) -> dict[str, Any]:
        """``base_weights_sha256`` of the result: the SHA-256 of every base tensor before
        and after, whether they are equal, and which tensors changed (LoRA tensors apart)."""
        report = base_weights_report(self.digests, self.trainee.hf)
        if self.cfg.method == "focus":
            after, lora = weights_sha256(self.trainee.hf), 0
        else:
            after, lora = report["after"], report["lora_tensors"]
        changed = [] if after == self.sha_before else report["changed"]
        return {"before": self.sha_before, "after": after, "equal": after == self.sha_before,
                "changed": changed, "changed_count": len(changed), "lora_tensors": lora}  # fmt: skip

    def result(self, t_call: float) -> TrainResult:
        """The :class:`TrainResult` of the run so far."""
        losses = [float(r["loss"]) for r in self.rows if "loss" in r]
        validation = [{k: r[k] for k in VALIDATION_KEYS if k in r} for r in self.rows
                      if "val_tokens" in r]  # fmt: skip
        steps = self.steps_done()
        extra = {"interrupted": self.sigint.interrupted, "peak_memory_bytes": peak_memory_bytes(),
                 "seconds_per_step": self.timer.seconds / max(1, steps),
                 "train_blocks": int(self.data.train_blocks.shape[0]),
                 "prepend_bos": self.data.prepend_bos, "base_weights_sha256": self.weights_record(),
                 "method": self.trainee.describe(), "distributed": self.distributed,
                 "data": self.data.fingerprint}  # fmt: skip
        if self.phase1 is not None:
            extra["phase1_base_weights"] = {"equal": self.phase1["changed_count"] == 0,
                                            "changed_count": self.phase1["changed_count"]}  # fmt: skip
        return TrainResult(out=self.out, steps=steps, start_step=self.start_step, losses=losses,
                           validation=validation, final_loss=losses[-1] if losses else None,
                           seconds=time.monotonic() - t_call, train_seconds=self.timer.seconds,
                           trainable_parameters=self.trainee.num_trainable, adapter=self.out,
                           checkpoint=None, log=self.log_path, extra=extra)  # fmt: skip

    def publish(self, result: TrainResult) -> None:
        """Rank 0: the final output (the trained parts, ``train_config.json``,
        ``train_result.json`` and ``train.png``) staged in ``out``, then moved into place
        all together (:func:`~focus_attention.utils.io.replace_entries`): an interruption,
        a failed write or a kill leaves the previous output (or, killed between two
        renames, a mix that :func:`unfinished_output` refuses as finished)."""
        result.checkpoint = _newest_path(self.out)
        png = self.out / PLOT_NAME
        if not self.main:
            result.plot = png if png.is_file() else None
            return
        remove_staging_leftovers(self.out)
        focus = self.trainee.focus
        with tempfile.TemporaryDirectory(prefix=".final-", dir=self.out) as tmp:
            result.plot = png if write_plot(self.log_path, Path(tmp) / PLOT_NAME) else None
            doc = {**result.to_dict(), "config": self.cfg.to_dict(),
                   "focus_config": focus.focus_config.to_dict() if focus is not None else None,
                   "versions": library_versions(), "environment": environment()}  # fmt: skip
            # the records first: the adapter's model card reports them
            write_json_atomic(Path(tmp) / CONFIG_FILE, self.cfg.to_dict())
            write_json_atomic(Path(tmp) / RESULT_NAME, doc)
            self.trainee.save_pretrained(tmp)
            replace_entries(tmp, self.out)


def _newest_path(out: Path) -> Path | None:
    found = newest_checkpoint(out)
    return None if found is None else found.path


def _check_frozen(cfg: TrainConfig, weights: dict[str, Any]) -> None:
    """Raises ``RuntimeError`` when the base weights changed in a method that keeps them
    frozen (:data:`FROZEN_BASE_METHODS`)."""
    if weights["equal"] or cfg.method not in FROZEN_BASE_METHODS:
        return
    trained = "Focus parameters" if cfg.method == "focus" else "LoRA and Focus parameters"
    raise RuntimeError(
        f"the base model's weights changed during training (SHA-256 {weights['before']} "
        f"before, {weights['after']} after; {weights['changed'][:3]}...): only the {trained} "
        "may train"
    )


def _prepare(cfg: TrainConfig, args: Any, t_call: float) -> tuple[Checkpoint | None, TrainResult | None]:  # fmt: skip
    """Check the resume point: ``(checkpoint, finished result)``; the last is not None when
    a resumed run has nothing left to do. The checkpoint resumed from is checked whole
    (:func:`~.outputs.check_checkpoint`). The output directory is checked (and, with
    ``overwrite``, cleared) once the corpus and the model have loaded."""
    out = cfg.out_dir()
    if not cfg.resume and not cfg.overwrite and args.should_save:
        prepare_out(out, resume=False, overwrite=False)  # refuse early, delete nothing
    ckpt = _resume_point(cfg, out, args.world_size)
    if ckpt is None:
        return None, None
    if ckpt.step >= cfg.steps:
        why = unfinished_output(cfg, out, ckpt)
        if not why:
            return ckpt, _finished_result(out, ckpt, t_call)
        if args.should_save:
            print(f"focus train: the run trained all {ckpt.step} steps, but the output in {out} "
                  f"is not its final one ({'; '.join(why)}): writing it from {ckpt.path.name}",
                  file=sys.stderr)  # fmt: skip
    check_checkpoint(ckpt)
    return ckpt, None


def _check_same_data(cfg: TrainConfig, ckpt: Checkpoint | None, data: _Data, main: bool) -> None:
    """A resume trains on the data the run trained on: the fingerprint of the training
    blocks now must be the one ``ckpt`` records (a checkpoint of an older release records
    none: said on stderr).

    Raises:
        ValueError: another fingerprint (the corpus text, the tokenizer or the blocks
            changed since the run started); the message names both.
    """
    if ckpt is None:
        return
    if not isinstance(ckpt.data, dict):
        if main:
            print(f"focus train: {ckpt.path} records no fingerprint of its training data (an "
                  "older release's checkpoint): the data cannot be checked against the run's",
                  file=sys.stderr)  # fmt: skip
        return
    then, now = ckpt.data, data.fingerprint
    if then.get("train_blocks") != now["train_blocks"]:
        raise ValueError(
            f"--resume: the training data differ from those the run in {cfg.out_dir()} trained "
            f"on: {ckpt.path.name} records {then.get('blocks')} token blocks of SHA-256 "
            f"{then.get('train_blocks')}, the corpus {cfg.corpus!r} now gives {now['blocks']} "
            f"blocks of SHA-256 {now['train_blocks']} (its text or the model's tokenizer "
            "changed); restore them, or start the run again with --overwrite"
        )


def train(config: TrainConfig, *, callback: Callback | None = None) -> TrainResult:
    """Train a pretrained causal LM by ``config.method`` (docs/method.md §6): by default
    the Focus centroids of the frozen model.

    One process, ``torchrun`` and ``accelerate launch`` run the same code (the Trainer's
    data parallelism; only rank 0 writes files).

    Args:
        config: the :class:`TrainConfig`.
        callback: called as ``callback(step, entry)`` after every optimizer step with the
            1-based step count and its log entry (before the step's validation and
            checkpoint). An exception raised there stops training.

    Returns:
        a :class:`TrainResult`; the final adapter (and ``lora/`` or ``model/``, see
        :mod:`focus_attention.hf.run_folder`) is in ``config.out_dir()``.

    Raises:
        ValueError: bad configuration, an ``out`` directory holding another run (without
            ``resume``/``overwrite``), a ``resume`` whose settings differ from the run's
            (other than :data:`~.config.RESUME_FREE_FIELDS`) or with another number of
            processes or whose training data differ from the checkpoint's fingerprint, too
            little text.
        FileNotFoundError: ``resume`` without a checkpoint, or from a checkpoint without its
            optimizer, schedule or random-generator state.
        UnreadableFileError: a damaged file of the run read back (``train_config.json``,
            ``log.jsonl``, a file of the checkpoint); a ``ValueError`` naming the file.
        FolderInUseError: another run is writing ``out`` (a ``RuntimeError`` naming it).
        RuntimeError: parameters that are trainable or frozen against the method, a
            non-finite loss, base weights that changed in a method that keeps them frozen.
        KeyboardInterrupt: after Ctrl-C, once the step in progress is checkpointed and the
            output written.
    """
    t_call = time.monotonic()
    cfg = config
    cfg.validate()
    _warn_long_warmup(cfg)
    out = cfg.out_dir()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    args = training_arguments(cfg, out, 1, max(1, cfg.steps), validate_at_start=False)
    # one run writes a folder at a time (rank 0 writes for all processes)
    lock = exclusive_lock(out / LOCK_NAME, f"focus train --out {out}") if args.should_save else contextlib.nullcontext()  # fmt: skip
    with lock:
        return _train(cfg, args, t_call, callback)


def _train(cfg: TrainConfig, args: Any, t_call: float, callback: Callback | None) -> TrainResult:
    """:func:`train` once its folder is held: the run from its resume point to its output."""
    out = cfg.out_dir()
    ckpt, finished = _prepare(cfg, args, t_call)
    if finished is not None:
        return finished
    with args.main_process_first(local=False):  # rank 0 prepares the caches, the others read
        corpus = load_corpus(cfg.corpus, quiet=not cfg.progress)  # fails before the model
        set_seed(cfg.seed)
        data = _load_data(cfg, corpus)
        _check_same_data(cfg, ckpt, data, args.should_save)
        if args.should_save:  # what --overwrite deletes goes only once the inputs are good
            prepare_out(out, resume=cfg.resume, overwrite=cfg.overwrite)
            out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out / CONFIG_FILE, cfg.to_dict())
    run = _Run(cfg, out, data, ckpt, args, callback)
    run.start_log()
    if cfg.progress and run.main:
        _announce(run, corpus.name)
    run.train()
    result = run.result(t_call)
    run.publish(result)
    _check_frozen(cfg, result.extra["base_weights_sha256"])
    if run.sigint.interrupted:
        if run.main:
            print(f"\nfocus train: interrupted after step {result.steps}; output saved in "
                  f"{out}, checkpoint {result.checkpoint}; continue with --resume",
                  file=sys.stderr)  # fmt: skip
        raise KeyboardInterrupt
    return result


def _warn_long_warmup(cfg: TrainConfig) -> None:
    """Warn when the warm-up does not end before the last step of the run, or of a phase of
    a two-phase run (each phase warms up anew; :func:`~.schedule.warn_long_warmup`)."""
    if cfg.method != "two-phase":
        phases = [("", cfg.steps)]
    else:
        phases = [("phase 1", cfg.phase1_steps), ("phase 2", cfg.steps - cfg.phase1_steps)]
    for name, steps in phases:
        peak = max((lr_factor(s, steps, cfg.warmup_steps) for s in range(steps)), default=0.0)
        warn_long_warmup("focus train", steps, cfg.warmup_steps, peak, cfg.lr, name)


def _announce(run: _Run, corpus: str) -> None:
    """What the run trains, on standard error."""
    info = run.trainee.describe()
    groups = ", ".join(f"{k} {v:,d}" for k, v in info["groups"].items())
    start = f"resuming at step {run.start_step}" if run.ckpt is not None else "starting"
    print(f"focus train: {run.cfg.method} on {run.cfg.model}, corpus {corpus}: "
          f"{run.data.train_blocks.shape[0]:,d} blocks of {run.cfg.seq_len} tokens; "
          f"{run.trainee.num_trainable:,d} trainable parameters ({groups}); {start}",
          file=sys.stderr)  # fmt: skip
