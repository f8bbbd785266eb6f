"""A Focus layer as one operator under ``torch.compile`` (docs/method.md §8, "torch.compile").

Under ``torch.compile`` the common call of a Focus layer (no gradients to compute, no router
in training mode, no KV cache, no switch open, a causal mask with or without padding) is
traced as one call of the custom operator ``torch.ops.focus_attention.focus_layer``: its
inputs are the layer's query, key, value, the hidden state the router reads and the 2-D
padding mask, plus an integer that names the layer (:func:`register_layer`) and the logit
scale; its fake implementation gives the output's shape. Dynamo sees no graph break in the
model, so it traces the model (transformers' own wrappers included) as one graph, and the
Focus settings (``top_k``, ``window``, ``sink_tokens``, ``dense_layers``, ``dense_heads``,
the routing mode, ...) are read by the operator when it runs: changing them compiles
nothing. The operator runs the eager ``"focus"`` attention function, the hidden state passed
as an argument, so a compiled model gives the eager result.

Whether a call can run as the operator is decided by values dynamo guards on (no setting
among them); any other call (gradients, a router in training mode, a KV cache, an open
switch or recorder, attention maps, autocast, a mask that is not plain causal) runs the
eager layer behind a graph break. Layers without a router are traced as their base
attention.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..utils.precision import autocast_dtype
from .base_attention import base_call
from .layer_call import CACHE_LAYER, HIDDEN_STATES
from .masks import FocusMask
from .paged import is_paged_call
from .runtime import ATTN_IMPLEMENTATION, overrides_open

#: the layers the operator can run, by the integer it names them with (weakly held)
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()

_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor hidden, Tensor? padding, "
    "int? local_size, int layer, float? scaling, float? softcap) -> Tensor"
)


def register_layer(layer: Any) -> int:
    """A new integer naming ``layer`` (a Focus layer handle with ``module`` and ``runtime``,
    held weakly) for the operator."""
    key = next(_KEYS)
    _LAYERS[key] = layer
    return key


@torch.library.custom_op("focus_attention::focus_layer", mutates_args=(), schema=_SCHEMA)
def focus_layer_op(query, key, value, hidden, padding, local_size, layer, scaling, softcap):  # fmt: skip
    """One Focus-layer call without gradients, as an opaque operator.

    Args:
        query: ``[B, H, Nq, D]``; key, value: ``[B, H_kv, Nk, D]`` (``Nk == Nq``: no cache).
        hidden: the hidden state entering the attention module ``[B, Nq, d_model]``.
        padding: bool ``[B, Nk]`` (True = real token) or None.
        local_size: the window of a sliding-window causal mask, None for a causal one.
        layer: the integer :func:`register_layer` gave the layer.
        scaling: the logit scale the model passed, or None; softcap: logit soft-capping or
            None.

    Returns:
        ``out [B, Nq, H, D]`` in the query's dtype, contiguous: the eager layer's output
        (the Focus layer's, or the base attention's while the layer is in ``dense_layers``;
        every setting is read here, when the operator runs).

    Raises:
        ValueError: no layer registered under ``layer`` (a model freed meanwhile), and
            whatever the eager layer raises.
    """
    handle = _LAYERS.get(layer)
    if handle is None:
        raise ValueError(f"focus_layer: no Focus layer is registered as {layer}")
    mask = FocusMask.of_call(padding, query, handle.runtime.model_config, local_size)
    kwargs = {HIDDEN_STATES: hidden} | ({} if softcap is None else {"softcap": softcap})
    attention = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
    out, _ = attention(handle.module, query, key, value, mask, 0.0, scaling, **kwargs)
    return out.contiguous()


@focus_layer_op.register_fake
def _focus_layer_fake(query, *rest):
    b, h, nq, d = query.shape
    return query.new_empty(b, nq, h, d)


def traceable(handle: Any, hidden: Any, has_cache: bool) -> bool:
    """Whether a Focus-layer call under ``torch.compile`` can be traced: as the operator for
    a layer with a router, as its base attention for one without. Not when a switch is open
    (:func:`overrides_open`) or a recorder is on, nor, for a layer with a router, with a KV
    cache, a router in training mode, a query-key router, or gradients to the hidden state
    or the router.

    Reads only values dynamo guards on and no setting: the switches, the recorders, the
    router's training mode and ``requires_grad``, grad mode, and whether there is a cache."""
    if handle is None or overrides_open():
        return False
    runtime = handle.runtime
    if runtime.recorder is not None or runtime.dense_recorder is not None:
        return False
    router = handle.router
    if router is None:
        return True
    if not isinstance(hidden, torch.Tensor) or has_cache or router.training:
        return False
    if router.reads_query_key:  # query-key routers run eagerly
        return False
    return not torch.is_grad_enabled() or not (
        hidden.requires_grad or any(p.requires_grad for p in router.parameters())
    )


def plain_call(handle: Any, qkv: tuple[torch.Tensor, ...], attention_mask: Any,
               dropout: float) -> bool:  # fmt: skip
    """Whether a traced Focus-layer call on ``qkv`` (query, key, value) can run as the
    operator: no gradient to any of them (the operator has no backward), a plain causal or
    sliding-window causal mask (with or without padding, see :func:`plain_mask`) or none, no
    dropout, no autocast and no attention maps asked for in any thread (values dynamo
    guards on)."""
    runtime = handle.runtime
    if dropout or runtime.want_attentions or autocast_dtype(qkv[0].device.type) is not None:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in qkv):
        return False
    return attention_mask is None or plain_mask(attention_mask)


def plain_mask(attention_mask: Any) -> bool:
    """Whether ``attention_mask`` is a :class:`FocusMask` of a plain causal or sliding-window
    causal pattern: transformers' causal mask function itself, or the mask of its
    sliding-window causal helper, told by what that helper passes (``local_size`` equal to
    the config's ``sliding_window``, no vmap overlay for ``or``/``and`` masks, and the causal
    skip allowed, which packed sequences, block overlays and bidirectional masks forbid).
    Anything else is checked eagerly (a graph break)."""
    if not isinstance(attention_mask, FocusMask):
        return False
    kw = attention_mask.kwargs
    if kw.get("mask_function") is causal_mask_function:
        return True
    local = kw.get("local_size")
    return (
        local is not None
        and local == getattr(kw.get("config"), "sliding_window", None)
        and kw.get("allow_is_causal_skip") is True
        and not kw.get("use_vmap")
    )


def traced_call(handle: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                hidden: torch.Tensor, attention_mask: Any, scaling: float | None,
                kwargs: dict) -> torch.Tensor:  # fmt: skip
    """The operator's call for one traced Focus-layer call (see :func:`plain_call`):
    ``out [B, Nq, H, D]``."""
    scaling = None if scaling is None else float(scaling)
    masked = isinstance(attention_mask, FocusMask)
    padding = attention_mask.padding if masked else None
    local_size = attention_mask.kwargs.get("local_size") if masked else None
    local_size = None if local_size is None else int(local_size)
    softcap = kwargs.get("softcap")
    softcap = None if softcap is None else float(softcap)
    return focus_layer_op(query, key, value, hidden, padding, local_size, handle.compiled_key,
                          scaling, softcap)  # fmt: skip


def traced_attention(handle: Any, module: torch.nn.Module, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor, attention_mask: Any, dropout: float,
                     scaling: float | None, kwargs: dict) -> tuple | None:  # fmt: skip
    """Under ``torch.compile``, the traced call of the ``"focus"`` attention function, or None
    when the call must run eagerly: a layer without a router as its base attention, a Focus
    layer as the ``focus_layer`` operator (see :func:`traceable` and :func:`plain_call`)."""
    if handle is None or overrides_open() or is_paged_call(kwargs):
        return None
    if handle.runtime.dense_recorder is not None:
        return None
    if handle.router is None:
        return base_call(handle.runtime, module, query, key, value, attention_mask, dropout,
                         scaling, kwargs)  # fmt: skip
    hidden = kwargs.get(HIDDEN_STATES)
    if not traceable(handle, hidden, kwargs.get(CACHE_LAYER) is not None):
        return None
    if not plain_call(handle, (query, key, value), attention_mask, dropout):
        return None
    return traced_call(handle, query, key, value, hidden, attention_mask, scaling, kwargs), None
