"""What a result was measured with: library versions, hardware, the git commit of the code,
and a hash of a model's weights. Every JSON result of the package records these."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

#: distributions whose versions every result file records
RESULT_DISTRIBUTIONS = (
    "focus-attention",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
)


def library_versions(dists: Iterable[str] = RESULT_DISTRIBUTIONS) -> dict[str, str | None]:
    """The Python version and the installed version of each distribution in ``dists``.

    Returns:
        ``{"python": "3.11.7", dist: version or None (not installed), ...}``.
    """
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def cpu_name() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (or what :mod:`platform` knows)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            names = re.findall(r"model name\s*:\s*(.+)", fh.read())
        if names:
            cpu = names[0].strip()
    except OSError:
        pass
    return cpu


def git_commit() -> str | None:
    """HEAD of the git checkout this package runs from, with ``+dirty`` when tracked files
    have uncommitted changes; ``None`` outside a checkout or without git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment() -> dict[str, Any]:
    """Hardware and run context of a result: package and torch versions, platform, CPU
    model and count, torch intra-op threads, CUDA device (or None), git commit, UTC date,
    and the ``FOCUS_*`` environment variables set (``FOCUS_NO_EXTENSION`` changes the path
    a run takes)."""
    import torch

    from .. import __version__

    return {
        "focus_attention": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "focus_variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FOCUS_")},
    }


def weights_sha256(model: Any) -> str:
    """SHA-256 (hex) of every tensor of ``model.state_dict()`` (parameters and persistent
    buffers): names, dtypes, shapes and raw bytes, in name order. Tied tensors are hashed
    under each of their names. Reads every weight (about a second per 500 MB)."""
    import torch

    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        if t.numel():
            flat = t.to("cpu").contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()
