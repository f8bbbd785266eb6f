"""The ``"focus"`` attention implementation for transformers: a Focus layer, top to bottom
(docs/method.md §3-§5 and §8).

:func:`register_focus_attention` registers :func:`focus_attention_forward` with transformers'
``AttentionInterface`` and :func:`~.masks.focus_mask_interface` with ``AttentionMaskInterface``
(without it the mask silently arrives as ``None``). The router reads the hidden state entering
the attention module, which transformers does not hand to the attention function: a
pre-hook on each Focus attention module (:func:`focus_pre_hook`) adds it, and the layer's
cache, to the module's keyword arguments, which every supported architecture passes on to the
attention function (as PEFT's hooks pass ``adapter_names``). A call (:func:`focus_layer`):
resolve its inputs (:mod:`.layer_call`), route the new tokens (:func:`~.route.route`), hand
their key groups to the cache and attend through it (:class:`~.focus_cache.FocusCache`),
complete the dense heads and head gates (:mod:`.heads`), record. A layer without Focus, in
``dense_layers`` or ``disable_focus()`` runs the base attention (:mod:`.base_attention`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..ops import BackendUnavailable, focus_mask, gated_attention
from ..utils.compile import eager_only
from .base_attention import attention_probs, base_call, dense_attention, no_adapter_error
from .cache import focus_cache_layer
from .compiled import traceable, traced_attention
from .heads import with_dense_heads
from .layer_call import CACHE_LAYER, HIDDEN_STATES, LayerCall, resolve_call, warn_dropout
from .layer_handle import LayerHandle, handle_of
from .masks import focus_mask_interface
from .paged import is_paged_call, run_packed
from .records import dense_record, routing_record
from .route import Routing, check_cache_routing, route
from .runtime import ATTN_IMPLEMENTATION
from .visibility import visible_attention


def focus_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """Forward pre-hook (``with_kwargs=True``) on each Focus attention module: its call gets
    the hidden state entering it (``[B, N, d_model]``) and its cache layer as keyword
    arguments (:data:`~.layer_call.HIDDEN_STATES`, :data:`~.layer_call.CACHE_LAYER`).
    Traced under ``torch.compile`` when the layer can run as the compiled operator
    (:func:`~.compiled.traceable`), else eager behind a graph break."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    has_cache = kwargs.get("cache", kwargs.get("past_key_values")) is not None
    if torch.compiler.is_compiling() and traceable(handle_of(module), hidden, has_cache):
        return args, {**kwargs, HIDDEN_STATES: hidden}
    return eager_pre_hook(module, args, kwargs)


@eager_only
def eager_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """:func:`focus_pre_hook`'s eager body: on a routed layer, the hidden state and the
    layer's :func:`~.cache.focus_cache_layer` (None without a cache) added to ``kwargs``."""
    handle = handle_of(module)
    if handle is None or not handle.routed:
        return None
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(f"Focus could not find the hidden state entering {type(module).__name__} "
                         "(expected the first positional argument or `hidden_states=`)")  # fmt: skip
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layer = None if cache is None else focus_cache_layer(cache, handle.layer_idx)
    if layer is not None:
        check_cache_routing(handle.runtime.mode(handle.router), handle.runtime.focus_config, layer)
    return args, {**kwargs, HIDDEN_STATES: hidden, CACHE_LAYER: layer}


def focus_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs: Any) -> tuple:  # fmt: skip
    """The attention function registered as ``"focus"`` with ``AttentionInterface``.

    Args:
        module: the attention module. query: ``[B, H, Nq, D]``; key, value:
            ``[B, H_kv, Nk, D]`` (un-expanded GQA; past and new keys with a cache; queries
            bottom-right aligned). attention_mask: a :class:`~.masks.FocusMask`, or None.
        dropout: the base model's attention dropout: not applied on Focus layers (a
            :class:`~.layer_call.FocusAttentionDropoutWarning` says so once).
        scaling: the logit scale the model passes (GPT-2's inverse-layer scaling, Gemma's
            ``query_pre_attn_scalar``); default ``module.scaling`` or ``D ** -0.5``.
        kwargs: the pre-hook's hidden state and cache layer; ``softcap`` (Gemma-2) is
            honoured, ``sliding_window`` ignored on Focus layers; the rest goes to the base
            attention on other layers.

    Returns:
        ``(out [B, Nq, H, D] in the query's dtype, maps)``: ``maps`` None or, when the model
        call asked for ``output_attentions``, the probabilities ``[B, H, Nq, Nk]`` under the
        layer's Focus mask. On other layers what the base attention returns.

    Raises:
        ValueError: no Focus adapter attached; unsupported masks or caches; soft routing with
            a non-empty KV cache; ``inference_routing="sequence"`` with a KV cache.

    Under ``torch.compile`` a call without gradients, cache or open switch is traced
    (:func:`~.compiled.traced_attention`), any other runs eagerly behind a graph break.
    """
    if torch.compiler.is_compiling():
        traced = traced_attention(handle_of(module), module, query, key, value, attention_mask,
                                  dropout, scaling, kwargs)  # fmt: skip
        if traced is not None:
            return traced
    return eager_focus_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)  # fmt: skip


@eager_only
def eager_focus_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs: Any) -> tuple:  # fmt: skip
    """:func:`focus_attention_forward`'s eager body (a graph break under ``torch.compile``)."""
    hidden, cache = kwargs.pop(HIDDEN_STATES, None), kwargs.pop(CACHE_LAYER, None)
    handle = handle_of(module)
    if handle is None:
        raise no_adapter_error()
    runtime = handle.runtime
    if is_paged_call(kwargs):  # continuous batching: each packed sequence as if alone
        return run_packed(eager_focus_attention, module, query, key, value, dropout, scaling,
                          kwargs, hidden, cache)  # fmt: skip
    recorder = runtime.current("dense_recorder")
    if handle.routed and recorder is not None:  # the dense attention's inputs, for distillation
        recorder.append(dense_record(handle, module, query, key, attention_mask, scaling, kwargs,
                                     hidden, cache))  # fmt: skip
    if not handle.routed or recorder is not None:
        return base_call(runtime, module, query, key, value, attention_mask, dropout, scaling, kwargs)  # fmt: skip
    warn_dropout(runtime, dropout)
    call = resolve_call(handle, module, query, key, value, attention_mask, scaling, kwargs, hidden, cache)  # fmt: skip
    dense = dense_attention(runtime, module, attention_mask, call.scale, kwargs)
    out, maps = focus_layer(handle, call, dense)
    return out.transpose(1, 2).contiguous(), maps


def focus_layer(handle: LayerHandle, call: LayerCall, dense) -> tuple:
    """One Focus-layer call: ``(out [B, H, Nq, D], maps [B, H, Nq, Nk] or None)``; ``dense``
    runs the base attention on some heads (dense heads, head gates)."""
    runtime, router = handle.runtime, handle.router
    mode, recorder = runtime.mode(router), runtime.current("recorder")
    needs_groups = call.cache.is_cache or recorder is not None
    routing = route(router, call, runtime.focus_config, mode, needs_groups)
    if routing.key_groups is not None:
        call.cache.append_groups(routing.key_groups, call.sink_tokens, real_new=call.real_q,
                                 sinks_new=call.sinks_new)  # fmt: skip
    split = handle.head_split(call.query.shape[1], call.key.shape[1], call.query.device)
    out, maps = attend(handle, call if split is None else split.focus_heads(call), routing)
    gates = runtime.head_gates
    alpha = None if gates is None else gates.alpha(handle.layer_idx)
    out, maps = with_dense_heads(call, split, alpha, out, maps, dense)
    if recorder is not None:
        recorder.append(routing_record(handle.layer_idx, mode, call, routing))
    return out, maps


def attend(handle: LayerHandle, call: LayerCall, routing: Routing) -> tuple:
    """The attention of ``call``'s heads under ``routing``: ``(out [B, H', Nq, D], maps or
    None)``. Soft routing gates a dense attention (docs/method.md §3); top-k routing is exact
    sparse attention through the cache (§4-§5), with maps when the model call asks."""
    config = handle.runtime.focus_config
    if (visibility := handle.runtime.current("visibility")) is not None:
        return visible_attention(handle, call, routing, visibility)
    if routing.soft_rows is not None:
        out = gated_attention(
            call.query, call.key, call.value, *routing.soft_rows, config.window,
            gate=config.gate, sharpness=config.gate_sharpness, scale=call.scale,
            softcap=call.softcap, key_padding_mask=call.real, always_visible=call.sinks,
            chunk_size=config.soft_chunk_size or None,
        )  # fmt: skip
        return out, None
    wants_maps = handle.runtime.wants_attentions()
    if wants_maps and call.cache.static:
        raise ValueError("output_attentions is not supported with a static KV cache")
    backend = config.attention_backend
    try:
        out = call.cache.attend(call.query, call.key, call.value, routing.query_groups,
                                window=config.window, scale=call.scale, softcap=call.softcap,
                                key_padding_mask=call.real, backend=backend)  # fmt: skip
    except BackendUnavailable as err:
        if backend == "auto":
            raise
        raise BackendUnavailable(f"FocusConfig.attention_backend={backend!r} cannot run layer "
                                 f"{handle.layer_idx}'s call: {err}") from err  # fmt: skip
    if not wants_maps:
        return out, None
    key_groups, real = call.cache.key_groups(call.real)
    mask = focus_mask(routing.query_groups, key_groups, config.window, real)
    return out, attention_probs(call.query, call.key, mask, call.scale, call.softcap)


def register_focus_attention() -> None:
    """Register :func:`focus_attention_forward` and ``focus_mask_interface`` under the name
    ``"focus"`` (both, or transformers silently drops the causal mask; docs/method.md §8).
    Idempotent; done when this module is imported (a wrapped model's pre-hooks import it, so
    an unpickled model finds "focus" registered)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, focus_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, focus_mask_interface)


register_focus_attention()
