"""``torch.compile`` helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def eager_only(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``fn`` so that it always runs eagerly: under ``torch.compile`` through
    ``torch.compiler.disable`` (a graph break around the call), in eager calls directly, so
    that they do not pay the disabled frame's set-up on every call (about 5 us, many times
    per decoding step)."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
