"""What a result was measured with: library versions, hardware, the git commit of the code,
and a hash of a model's weights. Every JSON result of the package records these. The
torch-free part (versions, CPU, commit) lives in :mod:`.versions` and is importable from
here too."""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import torch

from .versions import (
    PACKAGE_VERSION,
    RESULT_DISTRIBUTIONS,
    cpu_name,
    git_commit,
    library_versions,
)

__all__ = [
    "RESULT_DISTRIBUTIONS",
    "cpu_name",
    "environment",
    "git_commit",
    "hash_tensor",
    "library_versions",
    "state_sha256",
    "weights_sha256",
]


def environment() -> dict[str, Any]:
    """Hardware and run context of a result: package and torch versions, platform, CPU
    model and count, torch intra-op threads, CUDA device (or None), git commit, UTC date,
    and the ``FOCUS_*`` environment variables set (``FOCUS_NO_EXTENSION`` changes the path
    a run takes)."""
    return {
        "focus_attention": PACKAGE_VERSION,
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


def hash_tensor(digest: Any, tensor: torch.Tensor, label: str) -> None:
    """Feed ``label`` (UTF-8) and then the raw bytes of ``tensor`` (detached, on the CPU,
    contiguous, flattened; nothing for an empty tensor) into the ``hashlib`` object
    ``digest``. The one way the package hashes a weight."""
    digest.update(label.encode())
    t = tensor.detach()
    if t.numel():
        flat = t.to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy())


def state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of the tensors of ``state`` (a state dict): each one's name, dtype,
    shape and raw bytes, in name order (:func:`hash_tensor`)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        hash_tensor(digest, t, f"{name}:{t.dtype}:{tuple(t.shape)}\n")
    return digest.hexdigest()


def weights_sha256(model: Any) -> str:
    """SHA-256 (hex) of every tensor of ``model.state_dict()`` (parameters and persistent
    buffers): names, dtypes, shapes and raw bytes, in name order (:func:`state_sha256`).
    Tied tensors are hashed under each of their names. Reads every weight (about a second
    per 500 MB)."""
    return state_sha256(model.state_dict())
