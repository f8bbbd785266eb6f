"""The inputs of one Focus-layer call, gathered and checked once (docs/method.md §3 and §8):
queries, keys and values, the hidden state the router reads, the keys' padding and sinks,
the logit scale, the layer's cache and the routing state of the model call."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..utils.precision import autocast_dtype
from .focus_cache import CallKeys, FocusCache, over_groups
from .masks import FocusMask, sink_keys, unsupported_mask_message

__all__ = [
    "CACHE_LAYER",
    "HIDDEN_STATES",
    "FocusAttentionDropoutWarning",
    "LayerCall",
    "call_state",
    "resolve_call",
    "warn_dropout",
]

#: the keyword arguments a Focus attention module's pre-hook adds to its call, which the
#: module passes on to the attention function (as PEFT's hooks pass ``adapter_names``): the
#: hidden state entering the module ``[B, N, d_model]`` and the layer's cache
#: (:class:`~focus_attention.hf.focus_cache.FocusCache`, or continuous batching's
#: :class:`~focus_attention.hf.paged.PagedGroups`)
HIDDEN_STATES = "focus_hidden_states"
CACHE_LAYER = "focus_cache_layer"


class FocusAttentionDropoutWarning(UserWarning):
    """The base model asked for attention dropout, which Focus layers do not apply."""


def warn_dropout(runtime: Any, dropout: float) -> None:
    """Say once per model that Focus layers do not apply the base model's attention dropout
    (:class:`FocusAttentionDropoutWarning`)."""
    if dropout and "dropout" not in runtime.warned:
        runtime.warned.add("dropout")
        warnings.warn(
            f"the base model asks for attention dropout (p={dropout}) in training mode; Focus "
            "layers do not apply it (the base weights are frozen; the soft gate regularises the "
            "routers). Other layers and the residual dropouts apply theirs.",
            FocusAttentionDropoutWarning,
            stacklevel=4,
        )


@dataclass
class LayerCall:
    """One Focus-layer call, resolved: ``query [B, H, Nq, D]``, ``key``/``value``
    ``[B, H_kv, Nk, D]`` (past and new keys; queries bottom-right aligned; a static cache's
    whole buffers), ``hidden [B, Nq, d_model]``, ``real`` bool ``[B, Nk]`` (True = real key)
    or None and ``real_q`` its query rows, ``sinks`` bool ``[B, Nk]`` (the first
    ``sink_tokens`` real tokens) or None and ``sinks_new`` its rows of the new tokens (None
    when none of them is a sink), the logit ``scale`` and ``softcap``, the layer's ``cache``
    (:class:`~focus_attention.hf.focus_cache.FocusCache`), the routing ``state`` of this
    model call (:func:`call_state`) and the attention ``module`` (a query-key router
    recomputes the pre-rotary queries and keys with it)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    hidden: torch.Tensor
    real: torch.Tensor | None
    real_q: torch.Tensor | None
    sinks: torch.Tensor | None
    sinks_new: torch.Tensor | None
    scale: float
    softcap: float | None
    cache: FocusCache
    sink_tokens: int
    state: dict
    module: Any = None

    def heads(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> LayerCall:
        """This call on other heads (``query``, ``key``, ``value`` of some heads)."""
        return replace(self, query=query, key=key, value=value)

    def real_only(self, groups: torch.Tensor) -> torch.Tensor:
        """``groups`` bool ``[B, Nq, K]`` (or ``[B, Nq, H_kv, K]``, per key-value head)
        with padding queries in no group."""
        if self.real_q is None:
            return groups
        return groups & over_groups(self.real_q, groups.dim())


def call_state(handle: Any, attention_mask: Any) -> dict:
    """The routing state of the model call ``attention_mask`` belongs to, a dict keyed by
    layer index: the call's :class:`FocusMask` carries it, so a forward that activation
    checkpointing recomputes finds its own state however many forwards ran after it. A call
    without a FocusMask (a model that builds no mask) keeps only the latest call's state."""
    if isinstance(attention_mask, FocusMask):
        return attention_mask.routing_state
    calls = handle.runtime.calls
    if handle.unmasked_state[0] != calls:
        handle.unmasked_state = (calls, {})
    return handle.unmasked_state[1]


def _autocast_inputs(query, key, value) -> tuple[torch.Tensor, ...]:
    """Under ``torch.autocast`` the projections arrive in mixed dtypes (a rotary embedding
    returns float32 queries and keys beside a bfloat16 value): attention then runs in the
    autocast dtype, as the base implementations' matmuls do. Outside autocast the tensors
    are returned as they are (mismatched dtypes are an error of the op)."""
    dtype = autocast_dtype(query.device.type)
    if dtype is None:
        return query, key, value
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _checked_mask(attention_mask: Any) -> FocusMask | None:
    """The call's :class:`FocusMask` (checked causal) or None.

    Raises:
        ValueError: a prepared mask of another kind, or a mask that is not causal.
    """
    if not isinstance(attention_mask, FocusMask | None):
        raise ValueError(
            unsupported_mask_message(f"a prepared {type(attention_mask).__name__} mask")
            + "; pass the 2-D attention_mask to the model instead"
        )
    if attention_mask is not None:
        attention_mask.check_causal()
    return attention_mask


def _key_masks(mask: FocusMask | None, nq: int, nk: int, bsz: int, sink_tokens: int,
               device: torch.device) -> tuple:  # fmt: skip
    """``(real, sinks, sinks_new)`` of the keys from the model's mask."""
    if mask is None:
        real, sinks = None, sink_keys(None, nk, sink_tokens, device)
    else:
        real, sinks = mask.keys(nk, sink_tokens)
    if sinks is not None and sinks.shape[0] != bsz:
        sinks = sinks.expand(bsz, nk)
    # without padding the sinks are the first positions: none is new once they are cached
    past_sinks = sinks is None or (real is None and nk - nq >= sink_tokens)
    return real, sinks, None if past_sinks else sinks[:, nk - nq :]


def resolve_call(handle: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, scaling: float | None, kwargs: dict,
                 hidden: Any, cache: FocusCache | None) -> LayerCall:  # fmt: skip
    """Gather and check everything one Focus-layer call of ``handle``'s layer needs.

    A static cache's keys and values are its whole buffers: the cache keeps which keys are
    real and which are sinks, and ``real_q`` marks the new tokens that are real (the last
    columns of the 2-D padding mask, when the model was given one).

    Raises:
        ValueError: a hidden state that does not match the query, a router that holds no
            values or sits on another device, an unsupported mask, keys that do not match
            the cache's groups.
    """
    query, key, value = _autocast_inputs(query, key, value)
    bsz, _, nq, head_dim = query.shape
    if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:2]) != (bsz, nq):
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else None
        raise ValueError(
            f"Focus layer {handle.layer_idx}: the hidden state {got} does not match the query "
            f"[B={bsz}, N={nq}] (was the attention module called without its pre-hook?)"
        )
    handle.router.check_ready(hidden)
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    scale = head_dim**-0.5 if scale is None else float(scale)
    cache = CallKeys() if cache is None else cache
    mask = _checked_mask(attention_mask)
    sink_tokens, nk = handle.runtime.focus_config.sink_tokens, key.shape[2]
    if cache.static:
        padding = None if mask is None else mask.padding
        real_q = None if padding is None else padding[:, padding.shape[1] - nq :]
        real = sinks = sinks_new = None
    else:
        real, sinks, sinks_new = _key_masks(mask, nq, nk, bsz, sink_tokens, query.device)
        cache.check_keys(nk, nq, handle.layer_idx)
        real_q = None if real is None else real[:, nk - nq :]
    return LayerCall(
        query, key, value, hidden, real, real_q, sinks, sinks_new, scale,
        kwargs.get("softcap"), cache, sink_tokens, call_state(handle, attention_mask), module,
    )  # fmt: skip
