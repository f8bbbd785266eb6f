"""The state a wrapped model keeps on each of its attention modules (docs/method.md §8,
"Lifecycle"): everything a Focus layer needs is reachable from the module it runs in, so
copies and pickles of a model carry their own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .compiled import register_layer
from .heads import HeadSplit, head_split
from .router import FocusRouter
from .runtime import FocusRuntime

__all__ = ["HANDLE_ATTR", "LayerHandle", "handle_of"]

#: attribute (in ``module.__dict__``) holding a :class:`LayerHandle` on attention modules
HANDLE_ATTR = "_focus_handle"


@dataclass(eq=False)
class LayerHandle:
    """Per-attention-layer state, kept on every attention module of a wrapped model as
    ``module._focus_handle``: its layer index, router (None without Focus), the model's
    runtime, pre-hook and module; ``unmasked_state`` the routing state of the latest call
    without a mask (:func:`~.layer_call.call_state`); ``compiled_key`` names the layer to
    the compiled operator (:mod:`.compiled`). It carries no tensor from call to call."""

    layer_idx: int
    router: FocusRouter | None
    runtime: FocusRuntime
    unmasked_state: tuple[int, dict] = field(default_factory=lambda: (-1, {}), repr=False)
    hook: Any = field(default=None, repr=False)
    module: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.compiled_key = register_layer(self)
        self.head_splits: dict[tuple, HeadSplit | None] = {}

    @property
    def routed(self) -> bool:
        """Whether this call goes through Focus: a router, Focus enabled and the layer not
        among ``FocusConfig.dense_layers``."""
        runtime = self.runtime
        return (
            self.router is not None
            and runtime.current("enabled")
            and self.layer_idx not in runtime.focus_config.dense_layers
        )

    def head_split(self, num_heads: int, num_kv_heads: int, device: Any) -> HeadSplit | None:
        """:func:`~.heads.head_split` under the current ``dense_heads``, built once per
        setting, shape and device (its index tensors are then not copied to the device at
        every call: a decoding step captured in a CUDA graph must not copy from the host)."""
        dense_heads = self.runtime.focus_config.dense_heads
        key = (dense_heads, num_heads, num_kv_heads, str(device))
        if key not in self.head_splits:
            self.head_splits[key] = head_split(self.layer_idx, dense_heads, num_heads,
                                               num_kv_heads, device)  # fmt: skip
        return self.head_splits[key]

    def __setstate__(self, state: dict) -> None:
        # a copy is a layer of its own for the compiled operator (an unpickled model finds
        # "focus" registered: its pre-hooks import focus_attention.hf.attention, which
        # registers it)
        self.__dict__.update(state)
        self.__post_init__()


def handle_of(module: torch.nn.Module) -> LayerHandle | None:
    """The :class:`LayerHandle` of an attention module, or None."""
    return module.__dict__.get(HANDLE_ATTR)
