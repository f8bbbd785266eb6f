"""``torch.autocast`` helpers: which dtype an autocast region computes in, and a decorator that
switches autocast off where an op must compute in its inputs' dtype."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype of an active ``torch.autocast`` region on ``device_type``, or None (also
    for device types autocast does not know, such as ``meta``)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(device_type)


def without_autocast(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate an op taking tensors so that it computes as written (in its inputs' dtype,
    or the dtype it casts to) also when called inside ``torch.autocast``; autocast is
    switched off on the device of the first tensor argument."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None:
            tensors = (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            first = next(tensors, None)
        device = first.device.type if first is not None else "cpu"
        if autocast_dtype(device) is None:  # the common case: no context to enter
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper
