"""Input validation shared by the ops.

Every failure is a ``ValueError`` that names the argument, what was received and what was
expected (``"<name>: received <value>, expected <what>"``). Integer arguments are checked by
:func:`focus_attention.utils.checks.check_int`, with the op's name as the owner
(``"<op>.<name>: received ..."``).
"""

from __future__ import annotations

import torch

from ..utils.checks import check_int, is_number

__all__ = [
    "check_bool",
    "check_count",
    "check_device",
    "check_finite",
    "check_positive",
    "check_qkv",
    "check_shape",
    "check_tensor",
    "fail",
]


def fail(name: str, received: object, expected: str) -> None:
    """Raise ``ValueError("<name>: received <received>, expected <expected>")``."""
    raise ValueError(f"{name}: received {received}, expected {expected}")


def check_tensor(name: str, x: object, ndim: int, *, floating: bool | None = None) -> torch.Tensor:
    """``x`` is a tensor of rank ``ndim`` (and of a floating dtype with ``floating=True``)."""
    if not isinstance(x, torch.Tensor):
        fail(name, type(x).__name__, f"a torch.Tensor of rank {ndim}")
    assert isinstance(x, torch.Tensor)
    if x.ndim != ndim:
        fail(name, f"a tensor of shape {tuple(x.shape)} (rank {x.ndim})", f"rank {ndim}")
    if floating is True and not x.is_floating_point():
        fail(name, f"dtype {x.dtype}", "a floating-point dtype")
    return x


def check_bool(name: str, x: torch.Tensor) -> None:
    """``x`` has dtype ``torch.bool``."""
    if x.dtype != torch.bool:
        fail(name, f"dtype {x.dtype}", "torch.bool (True = member / real token)")


def check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """``x`` has exactly ``shape`` (``what`` names the dimensions in the message)."""
    if tuple(x.shape) != tuple(shape):
        fail(name, f"shape {tuple(x.shape)}", f"shape {tuple(shape)} ({what})")


def check_device(name: str, tensor: torch.Tensor, device: torch.device, owner: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` lies on ``device`` (that of ``owner``)."""
    if tensor.device != device:
        fail(name, f"a tensor on {tensor.device}", f"the device of {owner} ({device})")


def check_finite(name: str, x: torch.Tensor) -> None:
    """``x`` holds no NaN (infinities are allowed)."""
    if torch.isnan(x).any():
        fail(name, "a tensor containing NaN", "finite scores")


def check_count(owner: str, name: str, value: object, low: int, high: int) -> None:
    """``value`` is an int in ``low..high`` (``owner.name`` in the message)."""
    check_int(owner, name, value, low)
    assert isinstance(value, int)
    if value > high:
        fail(f"{owner}.{name}", repr(value), f"an int in {low}..{high}")


def check_positive(name: str, value: object) -> float | None:
    """``None`` or a finite real number > 0 (a logit ``scale`` or ``softcap``): PyTorch's
    CPU flash kernel returns NaN for a causal call with ``scale <= 0``, and ``softcap <= 0``
    is meaningless, so both are refused rather than answered wrongly."""
    if value is None:
        return None
    if not is_number(value):
        fail(name, repr(value), "a finite number > 0 (or None for the default)")
    return float(value)


def check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Query ``[B, H, Nq, D]``, key and value ``[B, H_kv, Nk, D]`` of one floating dtype and
    device, ``D >= 1`` and ``H % H_kv == 0`` (``H = H_kv = 0`` is an empty call)."""
    check_tensor("query", query, 4, floating=True)
    check_tensor("key", key, 4, floating=True)
    check_tensor("value", value, 4, floating=True)
    b, h, _, d = query.shape
    if key.shape[0] != b or key.shape[-1] != d:
        fail("key", f"shape {tuple(key.shape)}", f"[B={b}, H_kv, Nk, D={d}]")
    if value.shape != key.shape:
        fail("value", f"shape {tuple(value.shape)}", f"the key's shape {tuple(key.shape)}")
    h_kv = key.shape[1]
    if (h_kv < 1 and h > 0) or (h_kv > 0 and h % h_kv != 0):
        fail("key", f"H_kv = {h_kv} for H = {h} query heads", "H % H_kv == 0")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        fail("key/value", f"dtypes {key.dtype}/{value.dtype}", f"the query's dtype {query.dtype}")
    if d < 1:
        fail("query", f"head_dim D = {d}", "D >= 1")
    check_device("key", key, query.device, "query")
    check_device("value", value, query.device, "query")
