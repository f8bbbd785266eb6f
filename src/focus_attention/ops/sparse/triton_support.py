"""Where this package's Triton kernels can run, and the group codes they read.

The Triton kernels (:mod:`.triton_decode`, :mod:`.triton_prefill`) run on CUDA tensors where
Triton is installed (it ships with PyTorch's CUDA builds), and on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` in the environment before the kernels are first used):
slow, for testing the kernels on a machine without a GPU. The kernel modules are imported
only when a kernel is first launched, because Triton decides between compiling and
interpreting when a kernel is defined.

Group memberships reach the kernels as one int64 bit code per token (bit ``g`` set iff the
token is in group ``g``; :func:`~focus_attention.ops.masks.group_codes`, imported here for
the kernels' modules), so the kernels take at most :data:`MAX_KERNEL_GROUPS` groups.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..masks import CODE_BITS, group_codes

__all__ = [
    "MAX_KERNEL_GROUPS",
    "group_codes",
    "interpreting",
    "triton_installed",
    "triton_reason",
]

#: most groups ``K`` the Triton kernels take (one int64 code word, its sign bit unused).
MAX_KERNEL_GROUPS = CODE_BITS


def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported here."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_reason(device: torch.device) -> str | None:
    """Why this package's Triton kernels cannot run on ``device`` (a sentence in the style of
    the backends' refusals), or None if they can: CUDA with Triton installed, or the CPU
    under Triton's interpreter."""
    if not triton_installed():
        return "needs Triton, which is not installed (it ships with PyTorch's CUDA builds)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    return (
        f"runs on CUDA tensors (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1), "
        f"received {device}"
    )
