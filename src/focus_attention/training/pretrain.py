"""``focus pretrain``: a small LLaMA-style model trained from random initialisation, with Focus
(routers and every model weight trained together, soft Sinkhorn routing) or with dense
attention, on the same tokens in the same order (docs/method.md §6, "From scratch").

The engine is ``transformers.Trainer``, so one process, ``torchrun`` and ``accelerate
launch`` (DDP with gloo on CPU or NCCL on GPU, FSDP through accelerate's configuration)
run the same code; only rank 0 writes logs, checkpoints and the final model. What this module
adds to the Trainer:

* the model (:mod:`.scratch_model`): transformers' ``LlamaForCausalLM`` and, with
  ``attention="focus"``, :func:`~focus_attention.hf.get_focus_model` on it with every base
  weight unfrozen and the routers registered as the submodule :data:`ROUTERS_MODULE` of the
  LLaMA model, so that the optimizer, DDP and the Trainer's checkpoints see them;
* validation perplexity at every checkpoint (and at step 0) on the validation split, scored
  by :func:`~focus_attention.evaluation.score_windows`: for Focus with soft routing (the
  training-time model) and with hard top-k routing for each ``eval_top_k`` (what inference
  uses), for dense attention the dense model;
* nothing for the routing-bias statistics: every soft training forward folds the batches of
  every rank into them (:meth:`~focus_attention.hf.router.FocusRouter.update_bias`), so
  under DDP's defaults every rank ends with the same routers, those of one process with
  ``grad_accum`` times the number of ranks;
* records that the two attention types saw the same data: the SHA-256 of the initial model
  weights, of the training blocks and of every batch in the order it was fed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, LlamaForCausalLM, Trainer, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ..assets.blocks import token_blocks
from ..assets.corpora import load_corpus
from ..hf import FocusModel, get_focus_model
from ..utils.env import environment, library_versions, weights_sha256
from ..utils.io import (
    UnreadableFileError,
    exclusive_lock,
    read_json_record,
    replace_entries,
    staged_directory,
    write_json_atomic,
)
from .callbacks import JsonlLog, SigintCheckpoint, StepTimer
from .outputs import (
    LOCK_NAME,
    LOG_NAME,
    TRAINER_STATE_EXPECTED,
    TRAINER_STATE_SHAPE,
    Checkpoint,
    check_checkpoint,
    remove_staging_leftovers,
    truncate_log,
)
from .schedule import warn_long_warmup
from .scratch_model import build_llama, load_tokenizer, train_tokenizer
from .settings import (
    ATTENTIONS,
    PRETRAIN_CONFIG_NAME,
    PRETRAIN_RESULT_NAME,
    ROUTERS_MODULE,
    ModelSize,
    PretrainConfig,
)
from .trainer import sharding
from .validation import validation_perplexities

__all__ = [
    "ATTENTIONS",
    "PRETRAIN_CONFIG_NAME",
    "PRETRAIN_RESULT_NAME",
    "ROUTERS_MODULE",
    "PretrainConfig",
    "pretrain",
    "sharding",
]

#: the file of a run's folder recording the SHA-256 of the training blocks it started on
DATA_NAME = "pretrain_data.json"


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 (hex) of a tensor's dtype, shape and bytes (CPU, contiguous)."""
    digest = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}".encode())
    digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# the pieces handed to transformers.Trainer
# --------------------------------------------------------------------------------------------


class BatchDigest:
    """SHA-256 of the training batches, in the order they are trained on
    (:meth:`PretrainTrainer.training_step` feeds it every micro-batch's ``input_ids``
    ``LongTensor [batch, seq_len]``). Two runs with equal :meth:`hexdigest` trained on the
    same tokens in the same order."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.batches = 0

    def update(self, input_ids: torch.Tensor) -> None:
        """Fold one batch in."""
        self.digest.update(input_ids.detach().cpu().contiguous().numpy().tobytes())
        self.batches += 1

    def hexdigest(self) -> str:
        """The SHA-256 (hex) of the batches so far."""
        return self.digest.hexdigest()


class PretrainTrainer(Trainer):
    """``transformers.Trainer`` whose ``evaluate`` is :func:`validation_perplexities` on fixed
    validation blocks (each rank scores all of them, with the same weights, so every rank logs
    the same numbers) and whose ``training_step`` feeds a :class:`BatchDigest`. Keyword
    arguments besides the Trainer's: ``focus`` (the :class:`FocusModel` or None),
    ``val_blocks`` ``LongTensor [n, seq_len]``, ``eval_top_k``, ``train_top_k`` and
    ``digest`` (a :class:`BatchDigest`)."""

    def __init__(self, *args: Any, focus: Any, val_blocks: torch.Tensor,
                 eval_top_k: tuple[int, ...], train_top_k: int, digest: BatchDigest,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.batch_digest = digest
        self.focus_model, self.val_blocks = focus, val_blocks
        self.eval_top_k, self.train_top_k = tuple(eval_top_k), int(train_top_k)

    def restore(self, checkpoint: Path) -> None:
        """Load the model weights and the Trainer state of ``checkpoint`` without training:
        what ``train(resume_from_checkpoint=...)`` restores, for a checkpoint of the run's
        last step (from there the Trainer would run one step past ``max_steps``)."""
        self._load_from_checkpoint(str(checkpoint))
        self.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:  # fmt: skip
        """The Trainer's training step, after folding ``inputs["input_ids"]`` into the digest."""
        self.batch_digest.update(inputs["input_ids"])
        return super().training_step(model, inputs, num_items_in_batch)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:  # fmt: skip
        """Validation perplexities as ``<prefix>_ppl``, ``<prefix>_ppl_top<k>``,
        ``<prefix>_loss``, ``<prefix>_tokens``; logged and passed to the callbacks."""
        values = validation_perplexities(
            self.model, self.focus_model, self.val_blocks, self.eval_top_k, self.train_top_k
        )
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in values.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics
        )
        return metrics


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def _check_out(config: PretrainConfig, out: Path) -> Path | None:
    """The checkpoint to resume from (None: start fresh) after checking ``out``.

    Raises:
        ValueError: ``out`` holds a run with other settings, or a run and no ``resume``.
        UnreadableFileError: a damaged ``pretrain_config.json`` (naming it).
    """
    saved = out / PRETRAIN_CONFIG_NAME
    trainer_dir = out / "trainer"
    checkpoint = get_last_checkpoint(str(trainer_dir)) if trainer_dir.is_dir() else None
    if saved.exists():
        expected = "the settings of a focus pretrain run (a JSON object)"
        document = read_json_record(saved, expected)
        try:
            previous = PretrainConfig.from_dict(document)
        except (TypeError, ValueError) as err:
            raise UnreadableFileError(f"{saved}: {err}; expected {expected}") from err
        differences = config.locked_differences(previous)
        if differences:
            raise ValueError(
                f"{out} holds a run with other settings {differences} (new, saved); "
                "choose another --out"
            )
    started = checkpoint is not None or (out / PRETRAIN_RESULT_NAME).is_file()
    if started and not config.resume:
        raise ValueError(f"{out} holds a run: pass --resume to continue it or choose another --out")
    return Path(checkpoint) if checkpoint else None


def _training_arguments(config: PretrainConfig, out: Path, resuming: bool) -> Any:
    """The ``transformers.TrainingArguments`` of a run: AdamW (betas 0.9, 0.95), linear
    warm-up then cosine decay, validation and a checkpoint every ``eval_every`` steps (and a
    validation at step 0), DDP with its defaults."""
    return TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=config.steps,
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        lr_scheduler_type="cosine",
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        eval_strategy="steps",
        eval_steps=config.eval_every,
        eval_on_start=not resuming,
        save_strategy="steps",
        save_steps=config.eval_every,
        save_total_limit=config.keep_checkpoints,
        logging_steps=config.log_every,
        report_to=[],
        disable_tqdm=not config.progress,
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
    )


def _tokenizer(config: PretrainConfig, size: ModelSize, corpus: Any, out: Path, main: bool) -> Any:
    """The run's tokenizer: ``out/tokenizer`` when it exists (a resumed run), else
    ``config.tokenizer``, else one trained on the training split; saved to ``out/tokenizer``
    by the main process."""
    path = out / "tokenizer"
    if (path / "tokenizer_config.json").is_file():
        return load_tokenizer(path)
    if config.tokenizer is not None:
        tok = load_tokenizer(config.tokenizer)
    else:
        tok = train_tokenizer(corpus.texts("train"), size.vocab_size)
    if main:
        with staged_directory(path, out / ".staging", "tokenizer-") as stage:
            tok.save_pretrained(str(stage))
    return tok


def _data(config: PretrainConfig, args: Any, out: Path) -> tuple[Any, torch.Tensor, torch.Tensor, str]:  # fmt: skip
    """``(tokenizer, train blocks, validation blocks, corpus name)``: blocks ``LongTensor
    [n, seq_len]`` from the training split (capped at ``max_train_tokens``) and the
    validation split (capped at ``eval_tokens``), whole documents joined with EOS
    (:func:`~focus_attention.assets.blocks.token_blocks`). The main process prepares the
    corpus and the tokenizer first, the others then read them."""
    main = args.should_save
    with args.main_process_first(desc="corpus and tokenizer"):
        corpus = load_corpus(config.corpus, quiet=not main)
        tok = _tokenizer(config, config.model_size(), corpus, out, main)
    train = token_blocks(
        tok, corpus.split("train"), config.seq_len, max_tokens=config.max_train_tokens
    )
    val = token_blocks(
        tok, corpus.split("validation"), config.seq_len, max_tokens=config.eval_tokens
    )
    return tok, train, val, corpus.name


def build_model(config: PretrainConfig, vocab_size: int) -> tuple[Any, Any, str]:
    """``(llama, focus, init_sha256)``: the run's ``LlamaForCausalLM``
    (:func:`~.scratch_model.build_llama`, seeded by ``config.seed``), the
    :class:`~focus_attention.hf.FocusModel` on it (None for dense attention) and the SHA-256
    of the LLaMA weights before Focus is attached (:func:`~focus_attention.utils.env.
    weights_sha256`), equal for both attention types of a seed. With Focus every LLaMA weight
    is trainable and the routers are the LLaMA submodule :data:`ROUTERS_MODULE`."""
    llama = build_llama(config.model_size(), vocab_size, config.seq_len, config.seed)
    init = weights_sha256(llama)
    focus = None
    if config.attention == "focus":
        focus = get_focus_model(llama, config.focus)
        llama.requires_grad_(True)
        llama.add_module(ROUTERS_MODULE, focus.routers)
        focus.train()
    return llama, focus, init


def save_final(llama: Any, focus: Any, tokenizer: Any, out: Path, result: dict[str, Any]) -> None:  # fmt: skip
    """Write the final output into ``out`` all together (staged there, then moved into place
    by :func:`~focus_attention.utils.io.replace_entries`: an interruption, a failed write or
    a kill leaves the previous output): ``model/`` (the LLaMA model without Focus,
    ``save_pretrained``, with the tokenizer), with Focus ``adapter/``
    (``FocusModel.save_pretrained``; its base fingerprint is that model's) and
    :data:`PRETRAIN_RESULT_NAME` (``result``). The routers are detached from the LLaMA model
    first."""
    if focus is not None and getattr(llama, ROUTERS_MODULE, None) is not None:
        delattr(llama, ROUTERS_MODULE)
    remove_staging_leftovers(out)
    with tempfile.TemporaryDirectory(prefix=".final-", dir=out) as tmp:
        stage = Path(tmp)
        if focus is None:
            llama.save_pretrained(str(stage / "model"))
        else:
            with focus.disable_focus():
                llama.save_pretrained(str(stage / "model"))
            focus.save_pretrained(stage / "adapter")
        tokenizer.save_pretrained(str(stage / "model"))
        write_json_atomic(stage / PRETRAIN_RESULT_NAME, result)
        replace_entries(stage, out)


def load_pretrained(out: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a finished run's directory: the ``LlamaForCausalLM`` of
    ``out/model``, wrapped by the Focus adapter of ``out/adapter`` when there is one (a
    :class:`~focus_attention.hf.FocusModel` in eval mode, top-k routing), float32, CPU.

    Raises:
        FileNotFoundError: ``out/model`` or :data:`PRETRAIN_RESULT_NAME` is missing (the run
            has not finished: ``focus pretrain --resume`` finishes it).
    """
    out = Path(out)
    for needed in (out / "model" / "config.json", out / PRETRAIN_RESULT_NAME):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed}: not found; the run in {out} has not finished "
                                    "(focus pretrain --resume finishes it)")  # fmt: skip
    model = LlamaForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float32)
    model.eval()
    if (out / "adapter").is_dir():
        model = FocusModel.from_pretrained(model, out / "adapter")
    return model, AutoTokenizer.from_pretrained(str(out / "model"))


def _validation_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per validated step (the last entry of a step wins): ``step``, ``ppl``,
    ``ppl_top<k>``, ``loss``, ``tokens``."""
    rows: dict[int, dict[str, Any]] = {}
    for entry in log_history:
        if "eval_ppl" in entry:
            row = {k[5:]: v for k, v in entry.items() if k.startswith("eval_")}
            row["tokens"] = int(row["tokens"])
            rows[int(entry["step"])] = {"step": int(entry["step"]), **row}
    return [rows[s] for s in sorted(rows)]


def _rank_digests(llama: Any) -> list[str]:
    """SHA-256 of the full model state (weights, routers, routing bias) on every rank."""
    mine = weights_sha256(llama)
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [str(d) for d in everyone]


def _result(config: PretrainConfig, run: dict[str, Any]) -> dict[str, Any]:
    """The ``pretrain_result.json`` document from the pieces of a finished run."""
    args, tok, llama, focus = run["args"], run["tokenizer"], run["llama"], run["focus"]
    train, val, timer = run["train"], run["val"], run["timer"]
    size = config.model_size()
    routers = sum(p.numel() for p in focus.routers.parameters()) if focus is not None else 0
    per_step = config.batch_size * config.grad_accum * args.world_size * config.seq_len
    state = run["trainer"].state
    return {
        "config": config.to_dict(),
        "model": {
            **dataclasses.asdict(size),
            "vocab_size": len(tok),
            "parameters": sum(p.numel() for p in llama.parameters()) - routers,
            "router_parameters": routers,
        },
        "data": {
            "corpus": run["corpus"],
            "train_blocks": int(train.shape[0]),
            "validation_blocks": int(val.shape[0]),
            "tokens_per_step": per_step,
            "tokens_trained": per_step * state.global_step,
            "init_weights_sha256": run["init"],
            "train_blocks_sha256": tensor_sha256(train),
            "validation_blocks_sha256": tensor_sha256(val),
            "batches_sha256": run["digest"].hexdigest(),
            "batches_fed": run["digest"].batches,
            "resumed_from_step": run["resumed_from"],
        },
        "steps": state.global_step,
        "validation": _validation_rows(state.log_history),
        "throughput": {
            "tokens_per_second": per_step * timer.steps / timer.seconds if timer.seconds else None,
            "steps_timed": timer.steps,
            "step_seconds": timer.seconds,
            "train_runtime_seconds": run["runtime"],
            "world_size": args.world_size,
            "note": "tokens of all ranks per wall second inside optimizer steps (validation "
            "and checkpointing excluded), measured on rank 0",
        },
        "distributed": run["distributed"],
        "rank_weights_sha256": run["digests"],
        "versions": library_versions(),
        "environment": environment(),
    }


def pretrain(config: PretrainConfig) -> dict[str, Any]:
    """Run (or resume) one from-scratch training (module docstring) and return its result,
    also written to ``<out>/pretrain_result.json`` by rank 0.

    Writes into ``config.out_dir()`` (rank 0 only): ``tokenizer/``, ``model/`` and, with
    Focus, ``adapter/`` (:func:`save_final`; :func:`load_pretrained` reads them back),
    ``log.jsonl`` (every Trainer log entry), ``pretrain_config.json``,
    ``pretrain_result.json`` and ``trainer/checkpoint-<step>`` (the Trainer's, resumable).

    Returns:
        dict with ``config``, ``model`` (shape, parameter counts), ``data`` (token counts,
        SHA-256 of the initial weights, of the training and validation blocks and of the batches
        fed by this process since it started), ``validation`` (one row per checkpoint:
        ``step``, ``ppl`` and with Focus ``ppl_top<k>``), ``throughput``,
        ``rank_weights_sha256`` (the final model's digest on
        every rank), ``versions`` and ``environment``.

    Raises:
        ValueError: an output directory holding another run's settings, or a run and no
            ``resume``; a resume whose training blocks differ from those the run started on
            (:data:`DATA_NAME`); a corpus too small for one block.
        UnreadableFileError: a damaged file of the run read back (its settings, a file of
            the checkpoint resumed from), naming it.
        FolderInUseError: another run is writing the output folder (a ``RuntimeError``).
        FileNotFoundError: ``tokenizer`` is not a directory.
        KeyboardInterrupt: after Ctrl-C, once every rank finished the step in progress and
            the Trainer saved its checkpoint (:class:`~.callbacks.SigintCheckpoint`); the
            final model is not written, ``resume`` continues the run.
    """
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    # the Trainer's linear warm-up gives optimizer step s (0-based) s / warmup_steps
    peak = (config.steps - 1) / max(1, config.warmup_steps)
    warn_long_warmup("focus pretrain", config.steps, config.warmup_steps, peak, config.lr)
    out = config.out_dir()
    main = _training_arguments(config, out, False).should_save  # rank 0 writes for all
    with exclusive_lock(out / LOCK_NAME, f"focus pretrain --out {out}") if main else contextlib.nullcontext():  # fmt: skip
        return _pretrain(config, out)


def _pretrain(config: PretrainConfig, out: Path) -> dict[str, Any]:
    """:func:`pretrain` once its folder is held."""
    checkpoint = _check_out(config, out)
    args = _training_arguments(config, out, checkpoint is not None)
    if checkpoint is not None:
        step = _checkpoint_step(checkpoint)
        check_checkpoint(Checkpoint(checkpoint, step, 1, step, args.world_size))
    if args.should_save:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / PRETRAIN_CONFIG_NAME, config.to_dict())
        if checkpoint is not None:  # a crashed run logged steps after its checkpoint
            truncate_log(out / LOG_NAME, _checkpoint_step(checkpoint))
        else:
            (out / LOG_NAME).unlink(missing_ok=True)
    tok, train, val, corpus = _data(config, args, out)
    if args.should_save:
        _check_same_data(out, train, checkpoint is not None)
    llama, focus, init = build_model(config, len(tok))
    run = {"args": args, "tokenizer": tok, "llama": llama, "focus": focus, "train": train,
           "val": val, "corpus": corpus, "init": init, "digest": BatchDigest(),
           "timer": StepTimer(), "sigint": SigintCheckpoint(), "resumed_from": None}  # fmt: skip
    trainer = _trainer(config, run, out)
    if checkpoint is not None:
        run["resumed_from"] = _checkpoint_step(checkpoint)
    run["distributed"] = sharding(trainer)
    run.update(trainer=trainer, runtime=_train_to_the_end(config, trainer, run, checkpoint))
    if not any(
        e.get("step") == trainer.state.global_step and "eval_ppl" in e
        for e in trainer.state.log_history
    ):
        trainer.evaluate()  # the last step was not a checkpoint step
    run["digests"] = _rank_digests(llama)
    result = _result(config, run)
    if args.should_save:
        save_final(llama, focus, tok, out, result)
    return result


def _train_to_the_end(config: PretrainConfig, trainer: PretrainTrainer, run: dict[str, Any],
                      checkpoint: Path | None) -> float | None:  # fmt: skip
    """Train (resumed from ``checkpoint``) to ``config.steps``; a checkpoint of the last step
    (a run whose final save did not happen) is only restored. Returns the Trainer's
    ``train_runtime`` (seconds; None when nothing trained).

    Raises:
        KeyboardInterrupt: after Ctrl-C, once the step in progress is checkpointed.
    """
    if checkpoint is not None and run["resumed_from"] >= config.steps:
        trainer.restore(checkpoint)
        return None
    output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    if run["sigint"].interrupted:
        if run["args"].should_save:
            print(f"\nfocus pretrain: interrupted after step {trainer.state.global_step}; "
                  f"checkpoint saved in {config.out_dir() / 'trainer'}; continue with "
                  "--resume", file=sys.stderr)  # fmt: skip
        raise KeyboardInterrupt
    return output.metrics.get("train_runtime")


def _checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step of a Trainer checkpoint (its ``trainer_state.json``).

    Raises:
        UnreadableFileError: a damaged file, or one without ``global_step`` (naming it).
    """
    state = read_json_record(checkpoint / "trainer_state.json", TRAINER_STATE_EXPECTED, TRAINER_STATE_SHAPE)  # fmt: skip
    return state["global_step"]


def _check_same_data(out: Path, train: torch.Tensor, resumed: bool) -> None:
    """Record the SHA-256 of the training blocks in :data:`DATA_NAME` when the run starts;
    on a resume, check the blocks have it (a run of an older release, without the file,
    records it now).

    Raises:
        ValueError: the blocks differ from those the run started on (the corpus text or
            the tokenizer changed); the message names both digests.
        UnreadableFileError: a damaged :data:`DATA_NAME`.
    """
    path, now = out / DATA_NAME, tensor_sha256(train)
    if resumed and path.exists():
        then = read_json_record(path, "the data fingerprint of a focus pretrain run",
                                {"train_blocks_sha256": str})["train_blocks_sha256"]  # fmt: skip
        if then != now:
            raise ValueError(
                f"--resume: the training data differ from those the run in {out} started on: "
                f"{path.name} records token blocks of SHA-256 {then}, the corpus now gives "
                f"{now} (its text changed); restore it, or start again in another --out"
            )
        return
    write_json_atomic(path, {"train_blocks_sha256": now, "train_blocks": int(train.shape[0])})


def _trainer(config: PretrainConfig, run: dict[str, Any], out: Path) -> PretrainTrainer:
    """The :class:`PretrainTrainer` of a run: the LLaMA model (with its routers), the
    training blocks as rows ``{"input_ids", "labels"}``, the batch digest and the
    callbacks (timer, ``log.jsonl``, Ctrl-C checkpointing)."""
    rows = [{"input_ids": b, "labels": b} for b in run["train"]]
    callbacks = [run["timer"], JsonlLog(out / LOG_NAME), run["sigint"]]
    return PretrainTrainer(
        model=run["llama"],
        args=run["args"],
        train_dataset=rows,
        eval_dataset=rows[:1],
        digest=run["digest"],
        processing_class=run["tokenizer"],
        callbacks=callbacks,
        focus=run["focus"],
        val_blocks=run["val"],
        eval_top_k=config.eval_top_k,
        train_top_k=config.focus.top_k,
    )
