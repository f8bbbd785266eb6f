"""A Focus layer's attention under a mask given from outside its routing:
``FocusModel.override_visibility()``, for diagnostics (which keys a query would need, what
another choice of keys gives; docs/method.md §9)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops import masked_attention, masked_softmax
from .layer_call import LayerCall
from .layer_handle import LayerHandle
from .route import Routing

__all__ = ["attention_under", "visible_attention"]


def visible_attention(handle: LayerHandle, call: LayerCall, routing: Routing,
                      visibility: Callable[[int, LayerCall], torch.Tensor]) -> tuple:  # fmt: skip
    """The attention of ``call``'s heads under the mask ``visibility(layer_idx, call)`` of
    ``FocusModel.override_visibility()``: ``(out [B, H', Nq, D] in the query's dtype, maps
    [B, H', Nq, Nk] or None)``.

    Raises:
        ValueError: a static KV cache (its buffers are not the keys so far) or soft routing.
    """
    if call.cache.static or routing.soft_rows is not None:
        raise ValueError("FocusModel.override_visibility() needs top-k routing (eval()) and "
                         "no static KV cache")  # fmt: skip
    mask = visibility(handle.layer_idx, call)
    out = attention_under(call, mask)
    maps = None
    if handle.runtime.wants_attentions():
        maps = masked_softmax(call.query, call.key, mask, scale=call.scale, softcap=call.softcap,
                              eager=True)[0].to(call.query.dtype)  # fmt: skip
    return out.to(call.query.dtype), maps


def attention_under(call: LayerCall, mask: torch.Tensor) -> torch.Tensor:
    """``out [B, H, Nq, D]`` of ``call`` under the bool ``mask`` (``[B, Nq, Nk]``, ``[B,
    H_kv, Nq, Nk]`` or ``[B, H, Nq, Nk]``): PyTorch's fused scaled-dot-product attention,
    or the package's :func:`~focus_attention.ops.masked_attention` under a logit soft cap; a
    query with no visible key outputs zeros."""
    if call.softcap is not None:
        return masked_attention(call.query, call.key, call.value, mask, scale=call.scale,
                                softcap=call.softcap)[0]  # fmt: skip
    h, h_kv = call.query.shape[1], call.key.shape[1]
    mask = mask[:, None] if mask.dim() == 3 else mask
    if mask.shape[1] == h_kv and h != h_kv:
        mask = mask.repeat_interleave(h // h_kv, dim=1)
    seen = mask.any(dim=-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(
        call.query, call.key.to(call.query.dtype), call.value.to(call.query.dtype),
        attn_mask=mask | ~seen, scale=call.scale, enable_gqa=h != h_kv,
    )  # fmt: skip
    return out.masked_fill(~seen, 0.0)
