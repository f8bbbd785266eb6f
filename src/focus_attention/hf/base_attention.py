"""The base model's own attention, which a Focus model runs where it does not route (layers
without a router, ``dense_layers``, the dense heads of ``dense_heads``, ``disable_focus()``),
and the attention maps a Focus layer returns for ``output_attentions`` (docs/method.md §8)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops.reference import attention_probs
from .masks import FocusMask
from .runtime import ATTN_IMPLEMENTATION

__all__ = ["attention_probs", "base_call", "causal_maps", "dense_attention", "no_adapter_error"]


def base_attention(impl: str, module: torch.nn.Module) -> Callable:
    """The attention function of implementation ``impl`` for ``module``: transformers'
    registered one, or the module's own eager function under ``"eager"``.

    Raises:
        ValueError: no eager attention function in the module's modelling file.
    """
    if impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    if impl == "eager" and getattr(module, "reorder_and_upcast_attn", False):
        return gpt2_upcast_attention  # what GPT-2 runs itself under eager with this flag
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"no eager attention function found for {type(module).__name__}")
    return eager


def gpt2_upcast_attention(module, query, key, value, mask, dropout=0.0, scaling=None, **kw):
    """GPT-2's ``reorder_and_upcast_attn`` path (fp32 logits with the scale folded into the
    matmul), which GPT-2 calls instead of the attention interface under eager."""
    return module._upcast_and_reordered_attn(query, key, value, mask)


def base_call(runtime: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: Any, dropout: float, scaling: float | None,
              kwargs: dict) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """The base model's own attention implementation (``runtime.base_impl``) on ``query``
    ``[B, H, Nq, D]``, ``key`` and ``value`` ``[B, H_kv, Nk, D]`` under the base mask (a
    :class:`FocusMask` is turned into the implementation's own): ``(out [B, Nq, H, D], maps
    or None)`` as the implementation returns them."""
    impl = runtime.base_impl
    mask = attention_mask.base_mask(impl) if isinstance(attention_mask, FocusMask) else attention_mask  # fmt: skip
    fn = base_attention(impl, module)
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def dense_attention(runtime: Any, module: torch.nn.Module, attention_mask: Any, scale: float,
                    kwargs: dict) -> Callable[..., torch.Tensor]:  # fmt: skip
    """``dense(query, key, value) -> out [B, H', Nq, D]``: the base attention of one call of a
    Focus layer on some of its heads (dense heads, head gates), without dropout."""

    def dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out, _ = base_call(runtime, module, query, key, value, attention_mask, 0.0, scale, kwargs)
        return out.transpose(1, 2)

    return dense


def no_adapter_error() -> ValueError:
    """The error for the ``"focus"`` implementation on a model without a Focus adapter."""
    return ValueError(
        f"attn_implementation {ATTN_IMPLEMENTATION!r} is set on a model that has no Focus "
        "adapter attached: wrap the model with focus_attention.get_focus_model(model, config). "
        "A model built from a Focus model's config (from_config(focus_model.config)) inherits "
        "it and shares the config object: for a plain model pass a copy, "
        "from_config(copy.deepcopy(focus_model.config), attn_implementation='sdpa')"
    )


def causal_maps(query: torch.Tensor, key: torch.Tensor, real: torch.Tensor | None,
                scale: float, softcap: float | None) -> torch.Tensor:  # fmt: skip
    """Attention probabilities ``[B, H, Nq, Nk]`` of dense causal attention: every earlier
    real key (``real`` bool ``[B, Nk]`` or None; bottom-right aligned queries)."""
    nq, nk = query.shape[2], key.shape[2]
    rows = torch.arange(nk - nq, nk, device=query.device)[:, None]
    visible = (torch.arange(nk, device=query.device)[None, :] <= rows)[None]
    if real is not None:
        visible = visible & real[:, None, :]
    visible = visible.expand(query.shape[0], nq, nk)
    return attention_probs(query, key, visible, scale, softcap)
