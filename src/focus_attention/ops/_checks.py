"""Input validation shared by the ops: every failure is a ``ValueError`` that names the
argument, what was received and what was expected (product decision)."""

from __future__ import annotations

import torch

from ..utils.checks import is_number


def fail(name: str, received: object, expected: str) -> None:
    raise ValueError(f"{name}: received {received}, expected {expected}")


def check_tensor(name: str, x: object, ndim: int, *, floating: bool | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        fail(name, type(x).__name__, f"a torch.Tensor of rank {ndim}")
    assert isinstance(x, torch.Tensor)
    if x.ndim != ndim:
        fail(name, f"a tensor of shape {tuple(x.shape)} (rank {x.ndim})", f"rank {ndim}")
    if floating is True and not x.is_floating_point():
        fail(name, f"dtype {x.dtype}", "a floating-point dtype")
    return x


def check_bool(name: str, x: torch.Tensor) -> None:
    if x.dtype != torch.bool:
        fail(name, f"dtype {x.dtype}", "torch.bool (True = member / real token)")


def check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        fail(name, f"shape {tuple(x.shape)}", f"shape {tuple(shape)} ({what})")


def check_device(name: str, tensor: torch.Tensor, device: torch.device, owner: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` lies on ``device`` (that of ``owner``)."""
    if tensor.device != device:
        fail(name, f"a tensor on {tensor.device}", f"the device of {owner} ({device})")


def check_finite(name: str, x: torch.Tensor) -> None:
    if torch.isnan(x).any():
        fail(name, "a tensor containing NaN", "finite scores")


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, repr(value), "an int")
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in {low}..{high}"
        fail(name, value, f"an int {rng}")
    return value


def check_positive(name: str, value: object) -> float | None:
    """``None`` or a finite real number > 0 (a logit ``scale`` or ``softcap``): PyTorch's
    CPU flash kernel returns NaN for a causal call with ``scale <= 0``, and ``softcap <= 0``
    is meaningless, so both are refused rather than answered wrongly."""
    if value is None:
        return None
    if not is_number(value):
        fail(name, repr(value), "a finite number > 0 (or None for the default)")
    return float(value)
