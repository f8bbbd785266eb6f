"""The ``"focus"`` attention implementation for transformers (docs/method.md §3, §4 and §8).

Two functions are registered under the same name, as transformers requires (docs/method.md
§8): :func:`~focus_attention.hf.masks.focus_mask_interface` with ``AttentionMaskInterface``
(without it the mask silently arrives as ``None`` and causality is lost) and
:func:`focus_attention_forward` with ``AttentionInterface``. On a Focus layer the latter
routes the tokens and runs soft-gated attention (soft routing) or exact sparse attention
(top-k routing); on any other layer it builds the base implementation's mask from the
:class:`~focus_attention.hf.masks.FocusMask` and calls the base implementation.

The router needs the hidden state entering the attention module, which the attention
function does not receive: a forward pre-hook on each Focus attention module captures it
(and the KV cache, whose layer it turns into a :class:`~focus_attention.hf.cache.FocusCacheLayer`
that keeps every key and the group memberships of the cached keys).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..ops import (
    BackendUnavailable,
    focus_mask,
    gated_attention,
    sparse_attention,
    straight_through,
    topk_memberships,
)
from ..utils.compile import eager_only
from ..utils.precision import autocast_dtype
from .cache import FocusCacheLayer, focus_cache_layer
from .compiled import plain_call, register_layer, traced_call, traced_capture
from .head_gates import mix_heads
from .masks import FocusMask, focus_mask_interface, sink_keys, unsupported_mask_message
from .paged import (
    PackedSequence,
    PagedGroups,
    SequenceGroups,
    check_topk,
    is_paged_cache,
    is_paged_call,
    paged_groups,
    run_packed,
)
from .router import FocusRouter
from .runtime import ATTN_IMPLEMENTATION, FocusRuntime, overrides_open
from .static_cache import FocusStaticLayer

#: attribute (in ``module.__dict__``) holding a :class:`LayerHandle` on attention modules
HANDLE_ATTR = "_focus_handle"


class FocusAttentionDropoutWarning(UserWarning):
    """The base model asked for attention dropout, which Focus layers do not apply."""


@dataclass(eq=False)
class LayerHandle:
    """Per-attention-layer state kept on the attention module as ``module._focus_handle``.

    Every attention module of a wrapped model has one; ``router`` is None on the layers
    without Focus. ``pending`` maps a thread to the :class:`Captured` inputs the pre-hook
    took for the one attention call of that thread that follows (consumed by
    :func:`focus_attention_forward`), so threads sharing a model do not see each other's;
    ``unmasked_state`` is ``(model call, routing state)`` of the latest call that passed no
    :class:`FocusMask` to the layer (see :func:`call_state`). Under ``torch.compile``
    ``compiled_key`` names the layer to the ``focus_layer`` operator and ``traced_hidden``
    passes the captured hidden state from the traced pre-hook to the traced attention call
    (:mod:`focus_attention.hf.compiled`).
    """

    layer_idx: int
    router: FocusRouter | None
    runtime: FocusRuntime
    pending: dict = field(default_factory=dict, repr=False)
    unmasked_state: tuple[int, dict] = field(default_factory=lambda: (-1, {}), repr=False)
    hook: Any = field(default=None, repr=False)
    module: Any = field(default=None, repr=False)

    @property
    def routed(self) -> bool:
        """Whether this call of the layer goes through Focus: a router, Focus enabled and the
        layer not among ``FocusConfig.dense_layers``."""
        runtime = self.runtime
        return (
            self.router is not None
            and runtime.current("enabled")
            and self.layer_idx not in runtime.focus_config.dense_layers
        )

    def __post_init__(self) -> None:
        self.compiled_key = register_layer(self)
        self.traced_hidden: torch.Tensor | None = None
        self.head_splits: dict[tuple, HeadSplit | None] = {}

    def head_split(self, num_heads: int, num_kv_heads: int, device: Any) -> HeadSplit | None:
        """:func:`head_split` of this layer under the current ``dense_heads``, built once per
        setting, shape and device (its index tensors are then not copied to the device at
        every call: a decoding step captured in a CUDA graph must not copy from the host)."""
        dense_heads = self.runtime.focus_config.dense_heads
        key = (dense_heads, num_heads, num_kv_heads, str(device))
        if key not in self.head_splits:
            self.head_splits[key] = head_split(self.layer_idx, dense_heads, num_heads,
                                               num_kv_heads, device)  # fmt: skip
        return self.head_splits[key]

    def __setstate__(self, state: dict) -> None:
        # an unpickled model in a fresh process needs "focus" registered with transformers;
        # a copy is a layer of its own for the compiled operator
        self.__dict__.update(state)
        self.__post_init__()
        register_focus_attention()

    def run_operator(self, query, key, value, hidden, padding, local_size, scaling,
                     softcap) -> torch.Tensor:  # fmt: skip
        """What the ``focus_layer`` operator runs (:mod:`focus_attention.hf.compiled`): this
        layer's eager call (Focus, or its base attention in ``dense_layers``) on ``hidden``
        ``[B, N, d_model]`` without a cache, under the causal (sliding-window causal over
        ``local_size`` tokens) mask with the 2-D ``padding`` bool ``[B, N]`` or None;
        ``out [B, N, H, D]``."""
        runtime = self.runtime
        mask = FocusMask.of_call(padding, query, runtime.model_config, local_size)
        kwargs = {} if softcap is None else {"softcap": softcap}
        args = (self.module, query, key, value, mask, 0.0, scaling, kwargs)
        if not self.routed:
            return base_call(runtime, *args)[0]
        self.pending[threading.get_ident()] = Captured(hidden, None, False)
        return _focus_call(self, *args)[0]


@dataclass
class Captured:
    """What the pre-hook captured for one Focus-layer call: the hidden state entering the
    attention module ``[B, N, d_model]``, the layer's cache layer (or None; under continuous
    batching the layer's :class:`~focus_attention.hf.paged.PagedGroups`, then per packed
    sequence its :class:`~focus_attention.hf.paged.SequenceGroups`) and whether the call has
    a KV cache at all."""

    hidden: torch.Tensor
    cache_layer: FocusCacheLayer | PagedGroups | SequenceGroups | None
    has_cache: bool


def handle_of(module: torch.nn.Module) -> LayerHandle | None:
    """The :class:`LayerHandle` of an attention module, or None."""
    return module.__dict__.get(HANDLE_ATTR)


def focus_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on a Focus attention module: capture the hidden state entering it
    (``[B, N, d_model]``) and prepare its KV-cache layer (docs/method.md §8).

    Under ``torch.compile`` a call the ``focus_layer`` operator can run is traced
    (:func:`~focus_attention.hf.compiled.traced_capture`); any other runs eagerly behind a
    graph break, like the Focus layer: see :func:`focus_attention_forward`."""
    if torch.compiler.is_compiling() and traced_capture(handle_of(module), args, kwargs):
        return
    eager_pre_hook(module, args, kwargs)


@eager_only
def eager_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """:func:`focus_pre_hook`'s eager body (a graph break under ``torch.compile``)."""
    handle = handle_of(module)
    if handle is None or not handle.routed:
        return
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(
            f"Focus could not find the hidden state entering {type(module).__name__} "
            "(expected the first positional argument or `hidden_states=`)"
        )
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    cache_layer = None
    if cache is not None:
        cfg = handle.runtime.focus_config
        topk = handle.runtime.mode(handle.router) == "topk"
        if topk and cfg.inference_routing == "sequence":
            raise ValueError(
                "inference_routing='sequence' (the paper's sequence-wide Sinkhorn) is not causal: "
                "a token's groups depend on later tokens, so it cannot use a KV cache. Call the "
                "model with use_cache=False, or use inference_routing='causal'."
            )
        paged = is_paged_cache(cache)  # continuous batching: the groups by physical slot
        cache_layer = (paged_groups if paged else focus_cache_layer)(cache, handle.layer_idx)
        if isinstance(cache_layer, FocusStaticLayer) and not topk:
            raise ValueError(
                "soft (Sinkhorn) routing cannot fill a static KV cache: use eval() or "
                "set_routing('topk') to decode with it"
            )
    handle.pending[threading.get_ident()] = Captured(hidden, cache_layer, cache is not None)


# --------------------------------------------------------------------------------------------
# the attention function
# --------------------------------------------------------------------------------------------


def _base_attention(impl: str, module: torch.nn.Module) -> Callable:
    if impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    if impl == "eager" and getattr(module, "reorder_and_upcast_attn", False):
        return _gpt2_upcast_attention  # what GPT-2 runs itself under eager with this flag
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"no eager attention function found for {type(module).__name__}")
    return eager


def _gpt2_upcast_attention(module, query, key, value, mask, dropout=0.0, scaling=None, **kw):
    """GPT-2's ``reorder_and_upcast_attn`` path (fp32 logits with the scale folded into the
    matmul), which GPT-2 calls instead of the attention interface under eager."""
    return module._upcast_and_reordered_attn(query, key, value, mask)


def _no_adapter_error() -> ValueError:
    return ValueError(
        f"attn_implementation {ATTN_IMPLEMENTATION!r} is set on a model that has no Focus "
        "adapter attached: wrap the model with focus_attention.get_focus_model(model, config). "
        "A model built from a Focus model's config (from_config(focus_model.config)) inherits "
        "it and shares the config object: for a plain model pass a copy, "
        "from_config(copy.deepcopy(focus_model.config), attn_implementation='sdpa')"
    )


def focus_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function registered as ``"focus"`` with ``AttentionInterface``.

    Args:
        module: the attention module (``module.scaling``, ``module.layer_idx``).
        query: ``[B, H, Nq, D]``; key, value: ``[B, H_kv, Nk, D]`` (un-expanded GQA, past and
            new keys when a cache is used; queries are bottom-right aligned).
        attention_mask: a :class:`FocusMask` (from ``focus_mask_interface``), or None.
        dropout: attention dropout of the base model; not applied on Focus layers (the base
            weights are frozen; a :class:`FocusAttentionDropoutWarning` says so once per model).
        scaling: logit scale the model passes (GPT-2's inverse-layer scaling, Gemma's
            ``query_pre_attn_scalar``); default ``module.scaling`` or ``D ** -0.5``.
        kwargs: ``softcap`` (Gemma-2 logit soft-capping) is honoured; ``sliding_window`` is
            ignored on Focus layers; the rest is passed to the base implementation on other
            layers.

    Returns:
        ``(out [B, Nq, H, D] in the query's dtype, maps)`` where ``maps`` is None, or, when the
        model call asked for ``output_attentions``, the attention probabilities
        ``[B, H, Nq, Nk]`` (query dtype) under the layer's top-k Focus mask. On non-Focus
        layers whatever the base implementation returns.

    Raises:
        ValueError: no Focus adapter attached; unsupported masks or caches (see
            :mod:`focus_attention.hf.masks`); soft routing with a non-empty KV cache;
            ``inference_routing="sequence"`` with a KV cache.

    Under ``torch.compile`` (docs/method.md §8, "torch.compile") a call without gradients,
    cache or open switch is traced as one ``focus_layer`` operator that reads the settings
    when it runs (:mod:`focus_attention.hf.compiled`), and a layer without Focus routing as
    its base attention: the model compiles to one graph however the settings change. Any
    other call runs :func:`eager_focus_attention` behind a graph break.
    """
    if torch.compiler.is_compiling():
        traced = _traced_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs)  # fmt: skip
        if traced is not None:
            return traced
    return eager_focus_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)  # fmt: skip


def _traced_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """The traced call of :func:`focus_attention_forward`, or None for the eager one."""
    handle = handle_of(module)
    if handle is None:
        return None
    hidden = handle.traced_hidden  # None when the eager pre-hook ran
    handle.traced_hidden = None
    runtime = handle.runtime
    eager = overrides_open() or is_paged_call(kwargs) or runtime.dense_recorder is not None
    if not eager and handle.router is None:
        return base_call(runtime, module, query, key, value, attention_mask, dropout, scaling, kwargs)  # fmt: skip
    if hidden is None:
        return None
    if eager or not plain_call(handle, (query, key, value), attention_mask, dropout):
        _capture_eagerly(handle, hidden)
        return None
    return traced_call(handle, query, key, value, hidden, attention_mask, scaling, kwargs), None


@eager_only
def _capture_eagerly(handle: LayerHandle, hidden: torch.Tensor) -> None:
    """Hand the hidden state the traced pre-hook kept to the eager call (no cache)."""
    handle.pending[threading.get_ident()] = Captured(hidden, None, False)


@eager_only
def eager_focus_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs: Any) -> tuple:  # fmt: skip
    """:func:`focus_attention_forward`'s eager body (a graph break under ``torch.compile``)."""
    handle = handle_of(module)
    if handle is None:
        raise _no_adapter_error()
    if is_paged_call(kwargs):  # transformers' continuous batching: each packed sequence alone
        return packed_call(handle, module, query, key, value, dropout, scaling, kwargs)
    runtime = handle.runtime
    if handle.routed and runtime.current("dense_recorder") is not None:
        _record_dense(handle, module, query, key, attention_mask, scaling, kwargs)
    elif handle.routed:
        return _focus_call(handle, module, query, key, value, attention_mask, dropout, scaling, kwargs)  # fmt: skip
    return base_call(runtime, module, query, key, value, attention_mask, dropout, scaling, kwargs)


def packed_call(handle: LayerHandle, module: torch.nn.Module, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, dropout: float, scaling: float | None,
                kwargs: dict) -> tuple[torch.Tensor, None]:  # fmt: skip
    """A packed batch of transformers' continuous batching (:mod:`focus_attention.hf.paged`):
    each sequence through this layer's call alone, its keys' groups in the paged cache;
    ``(out [1, N_total, H, D], None)``.

    Raises:
        ValueError: soft routing or ``inference_routing="sequence"`` on a routed layer; see
            also :func:`~focus_attention.hf.paged.run_packed`.
    """
    captured = handle.pending.pop(threading.get_ident(), None) if handle.routed else None
    if captured is not None:
        check_topk(handle.runtime, handle.router)

    def one(seq: PackedSequence) -> tuple:
        if captured is not None:
            groups = seq.groups(captured.cache_layer)
            handle.pending[threading.get_ident()] = Captured(seq.rows(captured.hidden), groups, True)  # fmt: skip
        return focus_attention_forward(module, seq.query, seq.key, seq.value, seq.mask,
                                       dropout, scaling, **seq.kwargs)  # fmt: skip

    return run_packed(one, module, query, key, value, kwargs, captured is not None)


def base_call(runtime: FocusRuntime, module: torch.nn.Module, query: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor, attention_mask: Any, dropout: float,
              scaling: float | None, kwargs: dict) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """The base model's own attention implementation on ``query`` ``[B, H, Nq, D]``, ``key``
    and ``value`` ``[B, H_kv, Nk, D]`` under the base mask (a :class:`FocusMask` is turned
    into the implementation's own): ``(out [B, Nq, H, D], maps or None)`` as the
    implementation returns them. Layers without Focus routing, ``dense_layers`` and the
    dense heads of ``dense_heads`` run through it."""
    impl = runtime.base_impl
    mask = attention_mask.base_mask(impl) if isinstance(attention_mask, FocusMask) else attention_mask  # fmt: skip
    fn = _base_attention(impl, module)
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _focus_call(handle, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """A Focus layer's call: ``(out [B, Nq, H, D], maps or None)``."""
    runtime = handle.runtime
    if dropout and "dropout" not in runtime.warned:
        runtime.warned.add("dropout")
        warnings.warn(
            f"the base model asks for attention dropout (p={dropout}) in training mode; Focus "
            "layers do not apply it (the base weights are frozen; the soft gate regularises the "
            "routers). Other layers and the residual dropouts apply theirs.",
            FocusAttentionDropoutWarning,
            stacklevel=2,
        )
    out, maps = _focus_layer(handle, module, query, key, value, attention_mask, scaling, kwargs)
    return out.transpose(1, 2).contiguous(), maps


def _record_dense(handle, module, query, key, attention_mask, scaling, kwargs) -> None:
    """Append the inputs of this layer's dense attention to the runtime's dense recorder
    (see ``FocusModel.record_dense_attention``); the caller then runs the base attention."""
    captured = handle.pending.get(threading.get_ident())
    if captured is not None and captured.has_cache:
        handle.pending.pop(threading.get_ident(), None)
        raise ValueError(
            "record_dense_attention() records whole sequences: call the model with "
            "use_cache=False inside it"
        )
    call = _resolve_call(handle, module, query, key, key, attention_mask, scaling, kwargs)
    handle.runtime.current("dense_recorder").append(
        {
            "layer": handle.layer_idx,
            "hidden": call.hidden.detach(),
            "query": call.query.detach(),
            "key": call.key.detach(),
            "scale": call.scale,
            "softcap": call.softcap,
            "key_padding": call.real,
            "sinks": call.sinks,
        }
    )


# --------------------------------------------------------------------------------------------
# one Focus-layer call, step by step
# --------------------------------------------------------------------------------------------


@dataclass
class LayerCall:
    """The inputs of one Focus-layer call, resolved (shapes as in :func:`focus_attention_forward`).

    ``real`` bool ``[B, Nk]`` (True = real key) or None; ``real_q`` its query rows; ``sinks``
    bool ``[B, Nk]`` or None, from the first ``sink_tokens`` real tokens; ``state`` the
    routing state of this model call (:func:`call_state`)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    hidden: torch.Tensor
    real: torch.Tensor | None
    real_q: torch.Tensor | None
    sinks: torch.Tensor | None
    scale: float
    softcap: float | None
    cache_layer: FocusCacheLayer | FocusStaticLayer | None
    has_cache: bool
    sink_tokens: int
    state: dict

    @property
    def static(self) -> bool:
        """Whether the call writes a static KV cache (keys and values of its capacity)."""
        return isinstance(self.cache_layer, FocusStaticLayer)


def _take_captured(handle: LayerHandle, query: torch.Tensor) -> Captured:
    """What the pre-hook captured for this call of this thread (removed from the handle)."""
    captured = handle.pending.pop(threading.get_ident(), None)
    hidden = None if captured is None else captured.hidden
    bsz, _, nq, _ = query.shape
    if hidden is None or tuple(hidden.shape[:2]) != (bsz, nq):
        got = None if hidden is None else tuple(hidden.shape)
        raise ValueError(
            f"Focus layer {handle.layer_idx}: captured hidden state {got} does not match the "
            f"query [B={bsz}, N={nq}] (was the attention module called without its pre-hook?)"
        )
    return captured


def _key_masks(attention_mask: Any, nk: int, bsz: int, sink_tokens: int, device) -> tuple:
    """``(real, sinks)`` of the keys from the mask the model passed."""
    if isinstance(attention_mask, FocusMask):
        attention_mask.check_causal()
        real, sinks = attention_mask.keys(nk, sink_tokens)
    elif attention_mask is None:
        real, sinks = None, sink_keys(None, nk, sink_tokens, device)
    else:
        raise ValueError(
            unsupported_mask_message(f"a prepared {type(attention_mask).__name__} mask")
            + "; pass the 2-D attention_mask to the model instead"
        )
    if sinks is not None and sinks.shape[0] != bsz:
        sinks = sinks.expand(bsz, nk)
    return real, sinks


def _autocast_inputs(query, key, value) -> tuple[torch.Tensor, ...]:
    """Under ``torch.autocast`` the projections arrive in mixed dtypes (a rotary embedding
    returns float32 queries and keys beside a bfloat16 value): attention then runs in the
    autocast dtype, as the base implementations' matmuls do. Outside autocast the tensors
    are returned as they are (mismatched dtypes are an error of the op)."""
    dtype = autocast_dtype(query.device.type)
    if dtype is None:
        return query, key, value
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _resolve_call(handle, module, query, key, value, attention_mask, scaling, kwargs) -> LayerCall:
    """Gather and check everything one Focus-layer call needs."""
    query, key, value = _autocast_inputs(query, key, value)
    captured = _take_captured(handle, query)
    hidden, cache_layer, has_cache = captured.hidden, captured.cache_layer, captured.has_cache
    handle.router.check_ready(hidden)
    bsz, _, nq, head_dim = query.shape
    nk = key.shape[2]
    cfg = handle.runtime.focus_config
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    scale = head_dim**-0.5 if scale is None else float(scale)
    if isinstance(cache_layer, FocusStaticLayer):
        return _static_call(handle, query, key, value, captured, attention_mask, scale, kwargs)
    real, sinks = _key_masks(attention_mask, nk, bsz, cfg.sink_tokens, query.device)
    past_len = 0 if cache_layer is None else cache_layer.group_length
    if past_len + nq != nk:
        raise ValueError(
            f"Focus layer {handle.layer_idx}: {nk} keys but {past_len} cached group rows + "
            f"{nq} new tokens (keys without a Focus cache layer, or added while the layer was "
            "in FocusConfig.dense_layers?); start from an empty cache"
        )
    real_q = None if real is None else real[:, nk - nq :]
    return LayerCall(
        query, key, value, hidden, real, real_q, sinks, scale, kwargs.get("softcap"),
        cache_layer, has_cache, cfg.sink_tokens, call_state(handle, attention_mask),
    )  # fmt: skip


def _static_call(handle, query, key, value, captured: Captured, attention_mask, scale: float,
                 kwargs) -> LayerCall:  # fmt: skip
    """The :class:`LayerCall` of a call that writes a static KV cache: ``key`` and ``value``
    are the cache's whole buffers, the layer's :class:`FocusStaticLayer` keeps which keys are
    real and which are sinks, and ``real_q`` marks the new tokens that are real (the last
    columns of the 2-D padding mask, when the model was given one)."""
    if not isinstance(attention_mask, FocusMask | None):
        raise ValueError(
            unsupported_mask_message(f"a prepared {type(attention_mask).__name__} mask")
            + "; pass the 2-D attention_mask to the model instead"
        )
    if attention_mask is not None:
        attention_mask.check_causal()
    padding = None if attention_mask is None else attention_mask.padding
    nq = query.shape[2]
    real_q = None if padding is None else padding[:, padding.shape[1] - nq :]
    sink_tokens = handle.runtime.focus_config.sink_tokens
    return LayerCall(
        query, key, value, captured.hidden, None, real_q, None, scale, kwargs.get("softcap"),
        captured.cache_layer, True, sink_tokens, call_state(handle, attention_mask),
    )  # fmt: skip


def _soft_attention(handle: LayerHandle, call: LayerCall, scores: torch.Tensor, record: dict):
    """Soft Sinkhorn routing and the soft-gated dense attention (docs/method.md §2-§3, and
    §6 for straight-through routing); returns ``(out [B, H, Nq, D], query groups, new key
    groups)``: with ``straight_through`` the hard groups it attended with, otherwise the
    causal top-``top_k`` groups twice (for the KV cache and the routing records; None when
    neither needs them)."""
    router, runtime = handle.router, handle.runtime
    cfg = runtime.focus_config
    nq, nk = call.query.shape[2], call.key.shape[2]
    if nk != nq:
        raise ValueError(
            "soft (Sinkhorn) routing normalises over the whole sequence and cannot "
            f"continue from a KV cache holding {nk - nq} tokens; use eval() or "
            "set_routing('topk') to decode"
        )
    probs, column_bias = router.soft(scores, cfg.sinkhorn_iters, call.real_q)
    bias = _routing_bias_of_call(handle, call, column_bias)
    groups = _straight_through_groups(router, scores, bias, cfg) if cfg.straight_through else None
    rows = (probs, probs)
    if groups is not None:
        rows = (straight_through(groups[0], probs), straight_through(groups[1], probs))
    out = gated_attention(
        call.query, call.key, call.value, rows[0], rows[1], cfg.window,
        gate=cfg.gate, sharpness=cfg.gate_sharpness, scale=call.scale, softcap=call.softcap,
        key_padding_mask=call.real, always_visible=call.sinks,
        chunk_size=cfg.soft_chunk_size or None,
    )  # fmt: skip
    record["probs"] = probs.detach()
    if groups is not None:  # the groups this forward attended with
        return out, _real_only(groups[0], call), _real_only(groups[1], call)
    if call.cache_layer is None and runtime.current("recorder") is None:
        return out, None, None
    # keep the cache consistent should decoding continue in top-k mode
    q_groups = _real_only(router.causal_groups(scores.detach(), cfg.top_k), call)
    return out, q_groups, q_groups


def call_state(handle: LayerHandle, attention_mask: Any) -> dict:
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


def _routing_bias_of_call(handle: LayerHandle, call: LayerCall, column_bias: torch.Tensor):
    """The routing bias ``[K]`` float32 a soft call routes with: in training, the bias before
    this call's batch is folded in (the fold happens here, once per model call); in the
    recomputed forward of activation checkpointing, the same bias the first forward used,
    without folding the batch in again (docs/method.md §6)."""
    router = handle.router
    if not router.training:
        return router.routing_bias
    saved = call.state.get(handle.layer_idx)
    if saved is not None:  # the recomputed forward
        return saved
    bias = router.routing_bias.detach().clone()
    call.state[handle.layer_idx] = bias
    router.update_bias(column_bias.detach(), call.real_q)
    return bias


def _real_only(groups: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """``groups`` bool ``[B, Nq, K]`` with padding queries in no group."""
    return groups if call.real_q is None else groups & call.real_q[..., None]


def _straight_through_groups(router, scores: torch.Tensor, bias: torch.Tensor, cfg) -> tuple:
    """``(query groups, key groups)`` bool ``[B, N, K]`` of straight-through routing
    (docs/method.md §6): the causal top-k memberships of ``scores + bias`` (the routing bias
    before this batch's update), ``query_top_k`` groups for the queries and ``top_k`` for the
    keys.

    Raises:
        ValueError: settings it cannot run with (:meth:`FocusConfig.check_straight_through`).
    """
    cfg.check_straight_through()
    keys = router.causal_groups(scores.detach(), cfg.top_k, bias)
    if cfg.resolved_query_top_k == cfg.top_k:
        return keys, keys
    return router.causal_groups(scores.detach(), cfg.resolved_query_top_k, bias), keys


def _topk_groups(handle: LayerHandle, call: LayerCall):
    """``(query groups [B, Nq, K], key groups [B, Nk, K])`` of top-k routing (docs/method.md
    §4): causal (own scores + calibrated bias) or the paper's sequence-wide Sinkhorn; the
    new tokens join their ``top_k`` best groups as keys and their ``query_top_k`` best as
    queries."""
    cfg = handle.runtime.focus_config
    top_ks = (cfg.top_k, cfg.resolved_query_top_k)
    new_key_groups, q_groups = _new_token_groups(handle, call, top_ks)
    if call.static:  # the static layer adds the sinks and keeps the keys' groups
        call.cache_layer.append_groups(new_key_groups, call.real_q, call.sink_tokens)
        return q_groups, None
    if call.cache_layer is None:
        return q_groups, _key_groups(call, new_key_groups)
    # the cache then holds every key's groups, sinks included: nothing of size Nk is copied
    call.cache_layer.append_groups(_key_groups(call, new_key_groups), call.sink_tokens)
    return q_groups, call.cache_layer.groups


def _new_token_groups(handle: LayerHandle, call: LayerCall, top_ks: tuple[int, int]):
    """Memberships bool ``[B, Nq, K]`` of this call's tokens for each of ``top_ks`` (the
    same tensor twice when the two are equal); padding joins no group."""
    router, cfg = handle.router, handle.runtime.focus_config
    if cfg.inference_routing == "streaming":
        return _streaming_groups(call, router.num_groups)
    if cfg.inference_routing == "sequence":
        if call.has_cache:
            raise ValueError("inference_routing='sequence' cannot use a KV cache")
        # top-k of the Sinkhorn rows == top-k of scores + the sequence's column bias
        scores = router.scores(call.hidden)
        _, column_bias = router.soft(scores, cfg.sinkhorn_iters, call.real_q)
        biased = scores + column_bias[:, None, :]
        groups = {k: topk_memberships(biased, k) for k in set(top_ks)}
    else:
        groups = dict(zip(top_ks, router.topk_group_sets(call.hidden, top_ks), strict=True))
    if call.real_q is not None:
        groups = {k: g & call.real_q[..., None] for k, g in groups.items()}
    return groups[top_ks[0]], groups[top_ks[1]]


def _streaming_groups(call: LayerCall, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key memberships, query memberships)`` bool ``[B, Nq, K]`` of
    ``inference_routing="streaming"``: no key joins a group and every real query joins group
    0, which then holds the sink tokens only (:func:`_key_groups` puts them in every group),
    so a query sees its window and the sinks."""
    bsz, nq = call.hidden.shape[:2]
    keys = torch.zeros(bsz, nq, num_groups, dtype=torch.bool, device=call.hidden.device)
    queries = keys.clone()
    queries[..., 0] = True
    return keys, _real_only(queries, call)


def _key_groups(call: LayerCall, memberships: torch.Tensor) -> torch.Tensor:
    """The groups whose queries see this call's new tokens as keys, bool ``[B, Nq, K]``:
    their ``top_k`` memberships ``memberships``, and every group for a sink token
    (docs/method.md §3)."""
    nq, nk = memberships.shape[1], call.key.shape[2]
    if call.sinks is None or (call.real is None and nk - nq >= call.sink_tokens):
        return memberships  # without padding the sinks are the first positions: none is new
    return memberships | call.sinks[:, nk - nq :, None]


def attention_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention probabilities under a boolean mask, the maps a Focus layer returns
    for ``output_attentions`` (the same logits as ``focus_attention.ops.dense_attention``).

    Args:
        query: ``[B, H, Nq, D]``; key: ``[B, H_kv, Nk, D]``; mask: bool ``[B, Nq, Nk]``.
        scale: logit scale; softcap: optional logit soft-capping.

    Returns:
        ``[B, H, Nq, Nk]`` in the query's dtype, computed in float32 (float64 for float64
        inputs); a row with no visible key is all zeros.
    """
    heads = query.shape[1]
    k = key.repeat_interleave(heads // key.shape[1], dim=1)
    ct = torch.promote_types(query.dtype, torch.float32)
    logits = (query.to(ct) @ k.to(ct).transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    visible = mask[:, None]
    logits = logits.masked_fill(~visible, -math.inf)
    probs = torch.softmax(logits.masked_fill(~visible.any(-1, keepdim=True), 0.0), dim=-1)
    return probs.masked_fill(~visible, 0.0).to(query.dtype)


def _topk_attention(handle: LayerHandle, call: LayerCall):
    """Top-k routing and exact sparse attention (docs/method.md §4-§5); returns
    ``(out [B, H, Nq, D], query groups, key groups, maps or None)``."""
    cfg = handle.runtime.focus_config
    q_groups, k_groups = _topk_groups(handle, call)
    if call.static:
        if handle.runtime.wants_attentions():
            raise ValueError("output_attentions is not supported with a static KV cache")
        out = call.cache_layer.attend(call.query, call.key, call.value, q_groups, cfg.window,
                                      call.scale, call.softcap, cfg.attention_backend)  # fmt: skip
        return out, q_groups, None, None
    try:
        out = sparse_attention(
            call.query, call.key, call.value, q_groups, k_groups, cfg.window,
            scale=call.scale, key_padding_mask=call.real, softcap=call.softcap,
            backend=cfg.attention_backend,
        )  # fmt: skip
    except BackendUnavailable as err:
        if cfg.attention_backend == "auto":
            raise
        raise BackendUnavailable(f"FocusConfig.attention_backend={cfg.attention_backend!r} "
                                 f"cannot run layer {handle.layer_idx}'s call: {err}") from err  # fmt: skip
    maps = None
    if handle.runtime.wants_attentions():
        mask = focus_mask(q_groups, k_groups, cfg.window, call.real)
        maps = attention_probs(call.query, call.key, mask, call.scale, call.softcap)
    return out, q_groups, k_groups, maps


#: calls of at most this many queries (decoding steps) route every head and then overwrite
#: the dense heads' outputs: the op on a few extra heads costs less than copying the routed
#: heads' cached keys and values out of the cache at every step
ROUTE_ALL_HEADS_QUERIES = 8


@dataclass
class HeadSplit:
    """The heads of a layer with ``FocusConfig.dense_heads``: int64 indices of the routed
    and the dense query heads ``[H_routed]``, ``[H_dense]`` and of their key-value heads,
    and ``(start, length)`` of the dense heads when they are consecutive (a view then
    selects them, no copy), else None."""

    routed_q: torch.Tensor
    routed_kv: torch.Tensor
    dense_q: torch.Tensor
    dense_kv: torch.Tensor
    dense_kv_span: tuple[int, int] | None = None
    dense_q_span: tuple[int, int] | None = None

    def dense_keys(self, t: torch.Tensor) -> torch.Tensor:
        """The dense key-value heads of ``t [B, H_kv, N, D]`` (a view when consecutive)."""
        span = self.dense_kv_span
        return t.narrow(1, *span) if span else t.index_select(1, self.dense_kv)

    def dense_queries(self, t: torch.Tensor) -> torch.Tensor:
        """The dense query heads of ``t [B, H, N, D]`` (a view when consecutive)."""
        span = self.dense_q_span
        return t.narrow(1, *span) if span else t.index_select(1, self.dense_q)


def head_split(layer_idx: int, dense_heads: tuple, num_heads: int, num_kv_heads: int,
               device: Any) -> HeadSplit | None:  # fmt: skip
    """The :class:`HeadSplit` of layer ``layer_idx`` (None when none of its heads is dense):
    key-value head ``h`` and its query heads ``h * G .. h * G + G - 1`` (``G = num_heads //
    num_kv_heads``, grouped-query attention) attend densely.

    Raises:
        ValueError: a dense head beyond the layer's key-value heads.
    """
    dense = [h for layer, h in dense_heads if layer == layer_idx]
    if not dense:
        return None
    beyond = [h for h in dense if h >= num_kv_heads]
    if beyond:
        raise ValueError(
            f"FocusConfig.dense_heads: layer {layer_idx} has {num_kv_heads} key-value heads "
            f"(0..{num_kv_heads - 1}); received heads {beyond}"
        )
    group = num_heads // num_kv_heads
    is_dense = torch.zeros(num_kv_heads, dtype=torch.bool)
    is_dense[dense] = True
    kv = torch.arange(num_kv_heads)
    q = torch.arange(num_heads)
    q_dense = is_dense[q // group]
    heads = sorted(set(dense))
    consecutive = heads[-1] - heads[0] + 1 == len(heads)
    kv_span = (heads[0], len(heads)) if consecutive else None
    q_span = (heads[0] * group, len(heads) * group) if consecutive else None
    return HeadSplit(q[~q_dense].to(device), kv[~is_dense].to(device), q[q_dense].to(device),
                     kv[is_dense].to(device), kv_span, q_span)  # fmt: skip


def _routed_heads(call: LayerCall, split: HeadSplit) -> LayerCall:
    """``call`` with the routed heads' queries, keys and values only."""
    return dataclasses.replace(
        call,
        query=call.query.index_select(1, split.routed_q),
        key=call.key.index_select(1, split.routed_kv),
        value=call.value.index_select(1, split.routed_kv),
    )


def _dense_heads_attention(handle, module, call: LayerCall, split: HeadSplit, attention_mask,
                           kwargs) -> torch.Tensor:  # fmt: skip
    """The dense heads' attention ``[B, H_dense, Nq, D]``: the base implementation on their
    queries, keys and values under the base mask (as a layer in ``dense_layers`` runs)."""
    q = split.dense_queries(call.query)
    k = split.dense_keys(call.key)
    v = split.dense_keys(call.value)
    out, _ = base_call(handle.runtime, module, q, k, v, attention_mask, 0.0, call.scale, kwargs)
    return out.transpose(1, 2)


def _merge_heads(split: HeadSplit, routed: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``[B, H, Nq, D]`` from the routed heads' ``[B, H_routed, Nq, D]`` and the dense
    heads' ``[B, H_dense, Nq, D]`` outputs."""
    bsz, _, nq, dim = routed.shape
    heads = split.routed_q.numel() + split.dense_q.numel()
    out = routed.new_zeros(bsz, heads, nq, dim)
    return out.index_copy(1, split.routed_q, routed).index_copy(1, split.dense_q, dense.to(routed.dtype))  # fmt: skip


def _dense_maps(call: LayerCall, split: HeadSplit) -> torch.Tensor:
    """Attention probabilities ``[B, H_dense, Nq, Nk]`` of the dense heads: every earlier
    real key (bottom-right aligned queries)."""
    nq, nk = call.query.shape[2], call.key.shape[2]
    rows = torch.arange(nk - nq, nk, device=call.query.device)[:, None]
    visible = (torch.arange(nk, device=call.query.device)[None, :] <= rows)[None]
    if call.real is not None:
        visible = visible & call.real[:, None, :]
    visible = visible.expand(call.query.shape[0], nq, nk)
    q = split.dense_queries(call.query)
    k = split.dense_keys(call.key)
    return attention_probs(q, k, visible, call.scale, call.softcap)


def _focus_layer(handle, module, query, key, value, attention_mask, scaling, kwargs):
    """One Focus-layer call: ``(out [B, H, Nq, D], maps or None)``; the heads of
    ``FocusConfig.dense_heads`` attend densely beside the routed ones, and with head gates
    attached (:mod:`.head_gates`) every head's output is mixed with its dense output."""
    full = _resolve_call(handle, module, query, key, value, attention_mask, scaling, kwargs)
    split = handle.head_split(full.query.shape[1], full.key.shape[1], full.query.device)
    if split is not None:
        out, maps = _split_layer(handle, module, full, split, attention_mask, kwargs)
    else:
        out, maps = _routed_layer(handle, full)
    gates = handle.runtime.head_gates
    alpha = None if gates is None else gates.alpha(handle.layer_idx)
    if alpha is not None:  # maps stay the Focus layer's
        dense, _ = base_call(handle.runtime, module, full.query, full.key, full.value,
                             attention_mask, 0.0, full.scale, kwargs)  # fmt: skip
        out = mix_heads(alpha, dense.transpose(1, 2), out)
    return out, maps


def _split_layer(handle, module, call: LayerCall, split: HeadSplit, attention_mask, kwargs):
    """A layer with dense heads: ``(out [B, H, Nq, D], maps or None)``, the routed heads'
    from the Focus op and the dense heads' from the base attention. A call of at most
    :data:`ROUTE_ALL_HEADS_QUERIES` queries routes every head and overwrites the dense ones
    (routing is per token, so the routed heads' outputs are those of the op on them alone);
    a longer one runs the op on the routed heads only."""
    route_all = call.query.shape[2] <= ROUTE_ALL_HEADS_QUERIES
    out, maps = _routed_layer(handle, call if route_all else _routed_heads(call, split))
    dense = _dense_heads_attention(handle, module, call, split, attention_mask, kwargs)
    dense_maps = None if maps is None else _dense_maps(call, split)
    if route_all:
        out = out.index_copy(1, split.dense_q, dense.to(out.dtype))
        maps = None if maps is None else maps.index_copy(1, split.dense_q, dense_maps.to(maps.dtype))  # fmt: skip
        return out, maps
    maps = None if maps is None else _merge_heads(split, maps, dense_maps)
    return _merge_heads(split, out, dense), maps


def _routed_layer(handle: LayerHandle, call: LayerCall):
    """Routing and the routed attention of one call: ``(out [B, H, Nq, D], maps or None)``
    over the heads of ``call``."""
    runtime = handle.runtime
    mode = runtime.mode(handle.router)
    record: dict[str, Any] = {"layer": handle.layer_idx, "mode": mode}
    maps = k_groups = None
    if mode == "soft":
        scores = handle.router.scores(call.hidden)  # [B, Nq, K] fp32
        out, q_groups, new_keys = _soft_attention(handle, call, scores, record)
        keys = None if new_keys is None else _key_groups(call, new_keys)
        if runtime.focus_config.straight_through:  # the key groups it attended with
            k_groups = keys
        if call.cache_layer is not None:  # top-k appends its own
            call.cache_layer.append_groups(keys, call.sink_tokens)
    else:
        out, q_groups, k_groups, maps = _topk_attention(handle, call)
    recorder = runtime.current("recorder")
    if recorder is not None:
        padding = call.real
        if call.static:  # read back: records are for inspection, not for captured steps
            k_groups, padding = call.cache_layer.cached_groups()
        record.update(
            query_groups=q_groups.detach(),
            key_groups=None if k_groups is None else k_groups.detach(),
            key_padding=padding,
            sinks=call.sinks,
            num_keys=call.key.shape[2] if k_groups is None else k_groups.shape[1],
        )
        recorder.append(record)
    return out, maps


def register_focus_attention() -> None:
    """Register :func:`focus_attention_forward` and ``focus_mask_interface`` under the name
    ``"focus"`` (both, or transformers silently drops the causal mask; docs/method.md §8).
    Idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, focus_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, focus_mask_interface)
