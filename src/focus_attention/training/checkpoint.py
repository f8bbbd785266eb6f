"""Files of a training run and their crash-safe handling: step checkpoints (adapter +
trainer state), RNG state, the step log, and the rule that an output directory holds one
run.

Layout under the run's ``out``: the final adapter (``focus_config.json`` +
``focus_model.safetensors``; ``lora/`` and ``model/`` for the methods that train LoRA or
base weights, :mod:`focus_attention.evaluation.trained`), ``train_config.json``, ``log.jsonl`` (one JSON object per
step), ``train_result.json``, ``train.png`` and ``checkpoints/step-NNNNNNN/`` (adapter +
``trainer_state.pt``: optimizer, scheduler, RNG states, step, seconds, trained values). Every file is written
atomically and a checkpoint directory is renamed into place only when complete, so an
interrupted save never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..evaluation.trained import LORA_DIR, MODEL_DIR
from ..hf.model import CONFIG_NAME, WEIGHTS_NAME
from ..utils.io import (
    TRAIN_CONFIG_NAME,
    atomic_write,
    atomic_write_text,
    staged_directory,
    unreadable,
)

__all__ = [
    "CHECKPOINT_DIR",
    "LOG_NAME",
    "RESULT_NAME",
    "STATE_NAME",
    "checkpoint_path",
    "latest_checkpoint",
    "load_state",
    "prepare_out",
    "read_log",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
    "seed_everything",
    "truncate_log",
]

#: sub-directory of ``out`` holding the step checkpoints
CHECKPOINT_DIR = "checkpoints"
#: trainer state file inside a checkpoint directory
STATE_NAME = "trainer_state.pt"
#: version of the trainer state layout
STATE_FORMAT = 1
#: files of a run directory besides the adapter
LOG_NAME = "log.jsonl"
RESULT_NAME = "train_result.json"
CONFIG_FILE = TRAIN_CONFIG_NAME
PLOT_NAME = "train.png"
#: what ``--overwrite`` deletes (with the checkpoints)
RUN_FILES = (LOG_NAME, CONFIG_NAME, WEIGHTS_NAME, RESULT_NAME, PLOT_NAME, CONFIG_FILE)
#: sub-directories that ``--overwrite`` deletes (LoRA adapter, trained base weights)
RUN_DIRS = (CHECKPOINT_DIR, LORA_DIR, MODEL_DIR)
#: the files whose presence marks a directory as holding a run
RUN_MARKERS = (CHECKPOINT_DIR, LOG_NAME, CONFIG_NAME, RESULT_NAME)
_STEP_DIR = re.compile(r"step-(\d+)")


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (CPU and CUDA)."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The state of Python's, torch's and NumPy's random generators (to :func:`torch.save`
    with ``weights_only=True``)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    except ImportError:  # pragma: no cover
        pass
    return state


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first: ``step-N`` directories holding a
    trainer state."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and (p / STATE_NAME).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(out: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory under ``out/checkpoints`` (or ``None``)."""
    found = _step_dirs(Path(out) / CHECKPOINT_DIR)
    return found[-1][1] if found else None


def checkpoint_path(out: Path, step: int) -> Path:
    """The directory of the checkpoint of ``step``: ``out/checkpoints/step-NNNNNNN``."""
    return out / CHECKPOINT_DIR / f"step-{step:07d}"


def save_checkpoint(
    model: Any, trainer_state: dict[str, Any], step: int, out: Path, keep: int
) -> Path:
    """Write ``out/checkpoints/step-NNNNNNN`` (what ``model.save_pretrained`` writes: the
    adapter, LoRA or trained weights of the run; + ``trainer_state`` with
    the step, the RNG states and :data:`STATE_FORMAT` added) atomically, and delete the
    older checkpoints beyond the newest ``keep``. An existing checkpoint of the same step is
    kept as it is (a directory without a state there is replaced)."""
    root = out / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(out, step)
    if not (final / STATE_NAME).is_file():
        with staged_directory(final, root, prefix=f".tmp-step-{step:07d}-") as tmp:
            model.save_pretrained(tmp)
            state = {"format": STATE_FORMAT, "step": step, "rng": rng_state(), **trainer_state}
            atomic_write(tmp / STATE_NAME, lambda path: torch.save(state, path))
    found = _step_dirs(root)
    for _, p in found[: max(0, len(found) - keep)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def load_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint directory.

    Raises:
        FileNotFoundError: no state file.
        UnreadableFileError: an empty, truncated, garbage or unreadable state file, or a
            directory in its place (a ``ValueError``; the message names the file).
        ValueError: a state of another format version.
    """
    path = checkpoint / STATE_NAME
    expected = f"the trainer state of a focus train checkpoint (torch.save, format {STATE_FORMAT})"
    if path.is_dir():
        raise unreadable(path, "a directory", expected)
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # torch.load raises many types for a damaged file
        raise unreadable(path, f"not a readable torch.save file ({type(err).__name__}: {err})", expected) from err  # fmt: skip
    if not isinstance(state, dict):
        raise unreadable(path, f"a {type(state).__name__}", expected)
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{checkpoint}: trainer state format {state.get('format')!r} unsupported")
    return state


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a ``log.jsonl`` (a line cut by a hard kill is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_log(path: Path, step: int) -> None:
    """Keep only the records of steps ``<= step`` in ``log.jsonl`` (atomically): a resumed
    run rewrites the steps after its checkpoint."""
    kept = [r for r in read_log(path) if r.get("step", 0) <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def prepare_out(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to mix runs: ``out`` may hold an earlier run only with ``resume`` (continue)
    or ``overwrite`` (its log, checkpoints, adapter, plot and results are deleted).

    Raises:
        ValueError: ``out`` holds a run and neither flag is set.
    """
    existing = [name for name in RUN_MARKERS if (out / name).exists()]
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
