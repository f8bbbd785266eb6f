"""The files of a ``focus train`` run and the rule that an output directory holds one run
(docs/training.md, "Output folder").

Layout under the run's ``out``: the final output (the Focus adapter ``focus_config.json`` +
``focus_model.safetensors``; ``lora/`` and ``model/`` for the methods that train LoRA or base
weights, :mod:`focus_attention.hf.run_folder`; ``train_result.json``,
``train_config.json`` and ``train.png``), written together
(:func:`~focus_attention.utils.io.replace_entries`); ``log.jsonl`` (every Trainer log entry,
one JSON object per line); and the
``transformers.Trainer`` checkpoints ``checkpoints/checkpoint-<step>/`` (phase 2 of a
two-phase run: ``checkpoints/phase-2/checkpoint-<step of the phase>/``), each holding the
run's trained parts as the final output does, the optimizer, schedule and RNG states,
``trainer_state.json`` (written last) and :data:`RUN_STATE_NAME`.

Every file of a run read back is checked for its shape first, and a damaged one is named
(:class:`~focus_attention.utils.io.UnreadableFileError`): the log, the result, a checkpoint
resumed from (:func:`check_checkpoint`). A result counts as a finished run only when its
step count and flags say so (:func:`train_result_unfinished`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from ..hf.card import card_replaceable
from ..hf.files import CARD_NAME, safetensors_keys
from ..hf.head_gates import GATES_NAME
from ..hf.model import CONFIG_NAME, WEIGHTS_NAME
from ..hf.run_folder import LORA_DIR, MODEL_DIR
from ..utils.io import (
    NUMBER,
    TRAIN_CONFIG_NAME,
    UnreadableFileError,
    atomic_write_text,
    check_zip_file,
    read_json_record,
    read_jsonl,
    shape_mismatch,
    unreadable,
    write_json_atomic,
)

__all__ = [
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "LOCK_NAME",
    "LOG_NAME",
    "PHASE2_DIR",
    "PLOT_NAME",
    "RESULT_NAME",
    "RUN_STATE_NAME",
    "Checkpoint",
    "check_checkpoint",
    "checkpoint_root",
    "data_fingerprint",
    "latest_checkpoint",
    "newest_checkpoint",
    "prepare_out",
    "read_log",
    "read_train_result",
    "remove_staging_leftovers",
    "train_result_unfinished",
    "trained_parts_differences",
    "truncate_log",
    "write_run_state",
]

#: sub-directory of ``out`` holding the Trainer checkpoints
CHECKPOINT_DIR = "checkpoints"
#: sub-directory of :data:`CHECKPOINT_DIR` holding a two-phase run's phase-2 checkpoints
PHASE2_DIR = "phase-2"
#: files of a run directory besides the adapter
LOG_NAME = "log.jsonl"
RESULT_NAME = "train_result.json"
CONFIG_FILE = TRAIN_CONFIG_NAME
PLOT_NAME = "train.png"
#: the lock a run holds on its output folder while it runs (removed when it ends)
LOCK_NAME = ".focus-train.lock"
#: what a checkpoint records of the run besides the Trainer's files: ``world_size``,
#: ``phase`` and ``step_offset`` (the optimizer steps of the phases before it)
RUN_STATE_NAME = "focus_run.json"
#: the Trainer's state file, written last into a checkpoint
TRAINER_STATE_NAME = "trainer_state.json"
#: what ``--overwrite`` deletes (with the checkpoints)
RUN_FILES = (LOG_NAME, CONFIG_NAME, WEIGHTS_NAME, RESULT_NAME, PLOT_NAME, CONFIG_FILE)
#: sub-directories that ``--overwrite`` deletes (LoRA adapter, trained base weights)
RUN_DIRS = (CHECKPOINT_DIR, LORA_DIR, MODEL_DIR)
#: the files whose presence marks a directory as holding a run
RUN_MARKERS = (CHECKPOINT_DIR, LOG_NAME, CONFIG_NAME, RESULT_NAME)
#: name prefixes of the folders a final save stages in ``out`` (the new entries, and the old
#: ones set aside by :func:`~focus_attention.utils.io.replace_entries`)
STAGING_PREFIXES = (".final-", ".old-")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
#: what each file read back holds, for the messages
LOG_EXPECTED = "the log of a focus train run (one JSON object per line)"
RESULT_EXPECTED = "the result of a focus train run (written by focus train)"
TRAINER_STATE_EXPECTED = "the Trainer state of a focus train checkpoint (JSON)"
RUN_STATE_EXPECTED = "the run state of a focus train checkpoint (JSON)"
#: the shapes (:func:`~focus_attention.utils.io.shape_mismatch`) the package reads them in
LOG_ENTRY_SHAPE = {"step?": int, "seconds?": NUMBER, "loss?": NUMBER}
RESULT_SHAPE = {"steps": int, "trainable_parameters": int, "train_seconds": NUMBER,
                "extra": {"interrupted": bool}, "config": {"steps": int}}  # fmt: skip
TRAINER_STATE_SHAPE = {"global_step": int}
RUN_STATE_SHAPE = {"world_size?": int, "phase?": int, "step_offset?": int,
                   "data?": (dict, type(None))}  # fmt: skip
#: the states a resume restores from a checkpoint (the Trainer starts a fresh optimizer or
#: schedule without a word when one is missing, so a resume checks they are there)
CHECKPOINT_STATES = {
    OPTIMIZER_NAME: "the optimizer (AdamW) state of a focus train checkpoint (torch.save)",
    SCHEDULER_NAME: "the learning-rate schedule state of a focus train checkpoint (torch.save)",
}
RNG_EXPECTED = "the random-generator states of a focus train checkpoint (torch.save)"


@dataclass(frozen=True)
class Checkpoint:
    """A complete Trainer checkpoint of a run: ``path``, ``step`` (optimizer steps of the
    whole run, earlier phases included), ``phase`` (1, or 2 in two-phase's second phase),
    ``local_step`` (the steps of its own phase), ``world_size`` (processes that wrote it)
    and ``data``, the :func:`data_fingerprint` of what the run trains on (None: written by
    an older release)."""

    path: Path
    step: int
    phase: int
    local_step: int
    world_size: int
    data: dict[str, Any] | None = None


def checkpoint_root(out: str | os.PathLike[str], phase: int = 1) -> Path:
    """The Trainer's ``output_dir`` of ``phase``: ``out/checkpoints`` (phase 1) or
    ``out/checkpoints/phase-2``."""
    root = Path(out) / CHECKPOINT_DIR
    return root if phase == 1 else root / PHASE2_DIR


def write_run_state(directory: Path, *, world_size: int, phase: int, step_offset: int,
                    data: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Write :data:`RUN_STATE_NAME` into the checkpoint ``directory`` (``data``: the
    :func:`data_fingerprint` of the run)."""
    state = {"world_size": world_size, "phase": phase, "step_offset": step_offset, "data": data}
    write_json_atomic(directory / RUN_STATE_NAME, state)


def data_fingerprint(train_blocks: torch.Tensor) -> dict[str, Any]:
    """What a run records of the data it trains on: ``{"train_blocks": SHA-256 (hex) of
    the token blocks (shape, dtype and values), "blocks": their number}``. Another corpus
    text, tokenizer, sequence length or token budget gives another digest.

    Args:
        train_blocks: the run's training blocks, ``LongTensor [n, seq_len]``.
    """
    blocks = train_blocks.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{tuple(blocks.shape)} {blocks.dtype}".encode())
    digest.update(blocks.numpy().tobytes())
    return {"train_blocks": digest.hexdigest(), "blocks": int(blocks.shape[0])}


def _read_json(path: Path, expected: str = "a JSON object", shape: Any = dict) -> dict[str, Any] | None:  # fmt: skip
    """A JSON object file of ``shape``, or None when it is missing, damaged or of another
    shape (an incomplete checkpoint)."""
    try:
        return read_json_record(path, expected, shape)
    except (OSError, UnreadableFileError):
        return None


def _checkpoints(root: Path) -> list[Checkpoint]:
    """The complete checkpoints directly under ``root``, oldest first: ``checkpoint-N``
    directories with a readable Trainer state and run state."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CHECKPOINT.fullmatch(p.name)
        trainer = _read_json(p / TRAINER_STATE_NAME, TRAINER_STATE_EXPECTED, TRAINER_STATE_SHAPE) if m else None  # fmt: skip
        run = _read_json(p / RUN_STATE_NAME, RUN_STATE_EXPECTED, RUN_STATE_SHAPE) if m else None
        if trainer is None or run is None:
            continue
        local, offset = trainer["global_step"], run.get("step_offset", 0)
        found.append(Checkpoint(p, offset + local, run.get("phase", 1), local,
                                run.get("world_size", 1), run.get("data")))  # fmt: skip
    return sorted(found, key=lambda c: c.step)


def newest_checkpoint(out: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest complete checkpoint of the run in ``out`` (phase 2's before phase 1's), or
    None."""
    found = _checkpoints(checkpoint_root(out, 2)) or _checkpoints(checkpoint_root(out, 1))
    return found[-1] if found else None


def latest_checkpoint(out: str | os.PathLike[str]) -> Path | None:
    """The directory of :func:`newest_checkpoint` (or None)."""
    found = newest_checkpoint(out)
    return None if found is None else found.path


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a ``log.jsonl`` (``[]`` when there is none; its last line, when a
    hard kill cut it, is dropped).

    Raises:
        UnreadableFileError: a directory, unreadable, a damaged line, or an entry whose
            ``step``, ``seconds`` or ``loss`` is not a number (the message names the file).
    """
    if not (path.exists() or path.is_symlink()):
        return []
    rows = read_jsonl(path, LOG_EXPECTED)
    why = shape_mismatch(rows, [LOG_ENTRY_SHAPE], "entries")
    if why is not None:
        raise unreadable(path, why, LOG_EXPECTED)
    return rows


def truncate_log(path: Path, step: int) -> None:
    """Keep only the records of steps ``<= step`` in ``log.jsonl`` (atomically), less the
    Trainer's end-of-training summary: a resumed run rewrites the steps after its
    checkpoint."""
    kept = [r for r in read_log(path) if r.get("step", 0) <= step and "train_runtime" not in r]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def read_train_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``train_result.json`` at ``path``, checked to have :data:`RESULT_SHAPE`.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: a damaged file or one of another shape, such as an older
            release's without ``extra.interrupted`` (the message names it).
    """
    return read_json_record(path, RESULT_EXPECTED, RESULT_SHAPE)


def train_result_unfinished(doc: Any, steps: int | None = None) -> list[str]:
    """Why the parsed ``train_result.json`` ``doc`` is not the result of a finished run:
    not of its shape (:data:`RESULT_SHAPE`; an older release's result has no
    ``extra.interrupted`` flag), a run interrupted, or fewer (or more) steps than planned.

    Args:
        doc: the parsed file.
        steps: the run's planned step count (None: the one ``doc`` records in its
            ``config``).

    Returns:
        the reasons, one phrase each; ``[]`` for a finished run's result.
    """
    doc_ = doc if isinstance(doc, dict) else {}
    extra, config, done = doc_.get("extra"), doc_.get("config"), doc_.get("steps")
    flag = extra.get("interrupted") if isinstance(extra, dict) else None
    planned = steps
    if planned is None and isinstance(config, dict):
        planned = config.get("steps")
    why = []
    if isinstance(done, int) and isinstance(planned, int) and done != planned:
        why.append(f"{RESULT_NAME} records {done} steps, the run has {planned}")
    if flag is True:
        why.append(f"{RESULT_NAME} records an interrupted run")
    mismatch = shape_mismatch(doc, RESULT_SHAPE)
    if mismatch is not None:
        older = " (an older release's result, or a damaged one)" if flag is None else ""
        why.append(f"{RESULT_NAME}: {mismatch}{older}")
    return why


def check_checkpoint(ckpt: Checkpoint) -> None:
    """Check, before a resume loads it, every file of the checkpoint ``ckpt`` the Trainer
    and the run read back: the optimizer and schedule states (:data:`CHECKPOINT_STATES`)
    and each process's random-generator state are there and whole zip archives (the format
    of ``torch.save``), the Trainer state has its step, every other ``torch.save`` file
    (``*.pt``, ``*.pth``, ``*.bin``) whole, every safetensors file readable, every JSON file
    a JSON object.

    Raises:
        FileNotFoundError: a missing optimizer, schedule or random-generator state (the
            Trainer would start afresh without it); the message names the file.
        UnreadableFileError: a damaged file, named with what it should hold.
    """
    path = ckpt.path
    rng = ["rng_state.pth"] if ckpt.world_size == 1 else [f"rng_state_{i}.pth" for i in range(ckpt.world_size)]  # fmt: skip
    needed = {**CHECKPOINT_STATES, **dict.fromkeys(rng, RNG_EXPECTED)}
    for name, expected in needed.items():
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} not found; expected {expected}: the "
                                    "checkpoint is incomplete (remove it to resume from the one "
                                    "before, or start again with --overwrite)")  # fmt: skip
        check_zip_file(path / name, expected)
    read_json_record(path / TRAINER_STATE_NAME, TRAINER_STATE_EXPECTED, TRAINER_STATE_SHAPE)
    if (path / RUN_STATE_NAME).exists():  # focus train's (focus pretrain's have none)
        read_json_record(path / RUN_STATE_NAME, RUN_STATE_EXPECTED, RUN_STATE_SHAPE)
    part = f"a file of the focus train checkpoint {path.name}"
    for file in sorted(p for p in path.rglob("*") if p.name not in needed):
        if file.suffix in (".pt", ".pth", ".bin"):
            check_zip_file(file, part)
        elif file.suffix == ".safetensors":
            safetensors_keys(file, part)
        elif file.suffix == ".json":
            read_json_record(file, f"{part} (a JSON object)")


def prepare_out(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to mix runs: ``out`` may hold an earlier run only with ``resume`` (continue)
    or ``overwrite`` (its log, checkpoints, adapter, plot and results are deleted).

    An empty ``checkpoints/`` (a run that stopped before its first step) holds no run.

    Raises:
        ValueError: ``out`` holds a run and neither flag is set.
    """
    existing = [name for name in RUN_MARKERS if (out / name).exists()]
    if CHECKPOINT_DIR in existing and newest_checkpoint(out) is None:
        existing.remove(CHECKPOINT_DIR)  # a run that stopped before its first checkpoint
    if resume or not existing:
        return
    if not overwrite:
        raise ValueError(
            f"{out} already holds a training run ({', '.join(existing)}): pass --resume to "
            "continue it or --overwrite to start again"
        )
    for name in RUN_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    if card_replaceable(out):  # the adapter's card, written by this package
        (out / CARD_NAME).unlink(missing_ok=True)


def _tensors_differ(mine: Path, theirs: Path) -> bool:
    """Whether two safetensors files hold other tensor names or values (read one tensor at
    a time, so that two whole models never sit in memory together); an unreadable or
    missing file differs."""
    try:
        with safe_open(str(mine), framework="pt") as a, safe_open(str(theirs), framework="pt") as b:
            if set(a.keys()) != set(b.keys()):
                return True
            return any(not torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())  # noqa: SIM118
    except (SafetensorError, OSError, ValueError):
        return True


def _gate_values(path: Path) -> Any:
    """The trained ``values`` of a head-gates file (None when missing or unreadable)."""
    data = _read_json(path, "the head gates of a focus train run")
    return None if data is None else data.get("values")


def trained_parts_differences(out: str | os.PathLike[str], checkpoint: str | os.PathLike[str]) -> list[str]:  # fmt: skip
    """The trained parts of a checkpoint that the output in ``out`` does not hold: every
    safetensors file of ``checkpoint`` (the Focus adapter's weights, ``lora/``, ``model/``)
    must be in ``out`` at the same relative path with the same tensors, and the head gates'
    values must be equal.

    Returns:
        the relative paths that are missing or differ (``[]``: the output holds the
        checkpoint's trained parts).
    """
    out, checkpoint = Path(out), Path(checkpoint)
    differ = []
    for path in sorted(checkpoint.rglob("*.safetensors")):
        name = path.relative_to(checkpoint)
        if _tensors_differ(out / name, path):
            differ.append(str(name))
    gates = checkpoint / GATES_NAME
    if gates.is_file() and _gate_values(out / GATES_NAME) != _gate_values(gates):
        differ.append(GATES_NAME)
    return differ


def remove_staging_leftovers(out: str | os.PathLike[str]) -> None:
    """Remove the staging folders of a final save that a killed process left in ``out``
    (:data:`STAGING_PREFIXES`)."""
    for path in Path(out).iterdir():
        if path.is_dir() and path.name.startswith(STAGING_PREFIXES):
            shutil.rmtree(path, ignore_errors=True)
