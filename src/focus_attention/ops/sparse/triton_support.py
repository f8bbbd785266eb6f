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

A launcher decides each launch as a :class:`KernelLaunch` (kernel, grid, arguments, launch
options) before running it, so the launches of a call can also be built without running
them (:mod:`.triton_compile` compiles them for GPU targets on any machine). Grids are checked
against CUDA's limits (:func:`check_grid`) from shapes alone.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from ..checks import fail
from ..masks import CODE_BITS, group_codes

__all__ = [
    "MAX_GRID",
    "MAX_KERNEL_GROUPS",
    "KernelLaunch",
    "check_grid",
    "group_codes",
    "interpreting",
    "triton_installed",
    "triton_reason",
]

#: most groups ``K`` the Triton kernels take (one int64 code word, its sign bit unused).
MAX_KERNEL_GROUPS = CODE_BITS
#: most programs along the x, y and z axes of a CUDA launch grid (every compute capability
#: since 3.0: CUDA C++ Programming Guide, "Features and Technical Specifications").
MAX_GRID = (2**31 - 1, 65_535, 65_535)


def check_grid(owner: str, kernel: str, grid: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, ...]:  # fmt: skip
    """``grid`` itself when each of its sizes is within :data:`MAX_GRID`, else a
    ``ValueError`` naming the input ``owner`` and what the axis counts (``axes``, e.g.
    ``"batch B"``). Shapes only: no host synchronisation."""
    for size, limit, axis in zip(grid, MAX_GRID, axes, strict=False):
        if size > limit:
            fail(owner, f"{axis} = {size:,}",
                 f"at most {limit:,} (one axis of {kernel}'s CUDA launch grid)")  # fmt: skip
    return grid


@dataclass(frozen=True)
class KernelLaunch:
    """One launch of a Triton kernel as its launcher decided it.

    Attributes:
        kernel: the kernel's name in its module (e.g. ``"group_prefill_fwd"``).
        grid: programs along x, y, z (one to three sizes, within :data:`MAX_GRID`).
        args: the positional arguments (tensors and numbers).
        kwargs: the compile-time arguments and the launch options (``num_warps``,
            ``num_stages``).
    """

    kernel: str
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)

    def start(self, module: ModuleType) -> None:
        """Launch the kernel of this name in ``module`` (a kernels module).

        Raises:
            RuntimeError: the device cannot hold the launch's tile (Triton's
                ``OutOfResources``: shared memory or registers), naming the kernel, the
                inputs' dtype and tile and what to use instead.
        """
        try:
            getattr(module, self.kernel)[self.grid](*self.args, **self.kwargs)
        except Exception as err:
            if not _out_of_resources(err):
                raise
            dtype = next((a.dtype for a in self.args if isinstance(a, torch.Tensor)), None)
            tile = {k: v for k, v in self.kwargs.items() if k.startswith("BLOCK_") or k == "num_warps"}  # fmt: skip
            raise RuntimeError(
                f"{self.kernel}: this GPU cannot hold the kernel's tile for {dtype} inputs "
                f"({tile}): {err}. bfloat16 or float16 inputs take smaller tiles; or choose "
                "another attention_backend (flex, gather, masked)"
            ) from err


def _out_of_resources(err: Exception) -> bool:
    """Whether ``err`` is Triton's ``OutOfResources`` (a tile the device cannot hold)."""
    if not triton_installed():
        return False
    from triton.runtime.errors import OutOfResources  # optional: Triton

    return isinstance(err, OutOfResources)


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
