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
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..hf.card import card_replaceable
from ..hf.files import CARD_NAME
from ..hf.head_gates import GATES_NAME
from ..hf.model import CONFIG_NAME, WEIGHTS_NAME
from ..hf.run_folder import LORA_DIR, MODEL_DIR
from ..utils.io import TRAIN_CONFIG_NAME, atomic_write_text, write_json_atomic

__all__ = [
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "LOG_NAME",
    "PHASE2_DIR",
    "PLOT_NAME",
    "RESULT_NAME",
    "RUN_STATE_NAME",
    "Checkpoint",
    "checkpoint_root",
    "latest_checkpoint",
    "newest_checkpoint",
    "prepare_out",
    "read_log",
    "remove_staging_leftovers",
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


@dataclass(frozen=True)
class Checkpoint:
    """A complete Trainer checkpoint of a run: ``path``, ``step`` (optimizer steps of the
    whole run, earlier phases included), ``phase`` (1, or 2 in two-phase's second phase),
    ``local_step`` (the steps of its own phase) and ``world_size`` (processes that wrote it)."""

    path: Path
    step: int
    phase: int
    local_step: int
    world_size: int


def checkpoint_root(out: str | os.PathLike[str], phase: int = 1) -> Path:
    """The Trainer's ``output_dir`` of ``phase``: ``out/checkpoints`` (phase 1) or
    ``out/checkpoints/phase-2``."""
    root = Path(out) / CHECKPOINT_DIR
    return root if phase == 1 else root / PHASE2_DIR


def write_run_state(directory: Path, *, world_size: int, phase: int, step_offset: int) -> None:
    """Write :data:`RUN_STATE_NAME` into the checkpoint ``directory``."""
    state = {"world_size": world_size, "phase": phase, "step_offset": step_offset}
    write_json_atomic(directory / RUN_STATE_NAME, state)


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is missing or damaged (an incomplete checkpoint)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _checkpoints(root: Path) -> list[Checkpoint]:
    """The complete checkpoints directly under ``root``, oldest first: ``checkpoint-N``
    directories with a readable Trainer state and run state."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CHECKPOINT.fullmatch(p.name)
        trainer = _read_json(p / TRAINER_STATE_NAME) if m else None
        run = _read_json(p / RUN_STATE_NAME) if m else None
        if trainer is None or run is None:
            continue
        local = int(trainer.get("global_step", m.group(1)))
        offset = int(run.get("step_offset", 0))
        found.append(Checkpoint(p, offset + local, int(run.get("phase", 1)), local,
                                int(run.get("world_size", 1))))  # fmt: skip
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
    """The records of a ``log.jsonl`` (a line cut by a hard kill is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def truncate_log(path: Path, step: int) -> None:
    """Keep only the records of steps ``<= step`` in ``log.jsonl`` (atomically), less the
    Trainer's end-of-training summary: a resumed run rewrites the steps after its
    checkpoint."""
    kept = [r for r in read_log(path) if r.get("step", 0) <= step and "train_runtime" not in r]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


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
    data = _read_json(path)
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
