"""The ``"focus"`` attention implementation for transformers (spec sections 3, 4 and 8).

Two functions are registered under the same name, as transformers requires (spec section 8):

- :func:`focus_mask_interface` with ``AttentionMaskInterface``: instead of materialising a
  mask it returns a :class:`FocusMask` holding what the model's mask helper computed (the raw
  2-D padding mask, the mask pattern, offsets). Without it the mask silently arrives as
  ``None`` and causality is lost.
- :func:`focus_attention_forward` with ``AttentionInterface``: on a Focus layer it routes
  the tokens and runs soft-gated attention (soft routing) or exact sparse attention (top-k
  routing); on any other layer it builds the base implementation's mask from the
  :class:`FocusMask` and calls the base implementation (``sdpa`` / ``eager`` / ...).

A Focus layer takes causality from positions (keys are every cached key, queries are
bottom-right aligned, as in ``sparse_attention``) and padding from the raw 2-D mask, so it
does not depend on which layer's cache sized the mask. It accepts only plain causal (or
sliding-window causal) mask patterns and raises on anything else (packed sequences,
bidirectional attention, or/and overlays, prepared 4-D masks): product decision.

The router needs the hidden state entering the attention module, which the attention
function does not receive: a forward pre-hook on each Focus attention module captures it
(and the KV cache, whose layer it turns into a :class:`FocusCacheLayer` that keeps every key
and the group memberships of the cached keys).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
)
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..ops import gated_attention, sparse_attention, topk_memberships
from .config import FocusConfig
from .router import FocusRouter

ATTN_IMPLEMENTATION = "focus"

#: queries per block when a non-trivial mask pattern is checked (bounds its memory).
_CHECK_BLOCK = 1024


# --------------------------------------------------------------------------------------------
# per-model runtime state
# --------------------------------------------------------------------------------------------


@dataclass
class FocusRuntime:
    """State shared by the Focus layers of one wrapped model (product decision).

    Attributes:
        focus_config: the :class:`FocusConfig` in use, read by every Focus-layer call (replaced
            as a whole when ``FocusModel.focus_config`` is assigned).
        base_impl: the model's attention implementation before Focus (``"sdpa"``, ``"eager"``...).
        enabled: False inside ``disable_focus()``.
        routing: ``"auto"``, ``"soft"`` or ``"topk"`` (see :class:`FocusConfig`).
        recorder: list receiving one record per Focus-layer call while recording, else None.
    """

    focus_config: FocusConfig
    base_impl: str
    enabled: bool = True
    routing: str = "auto"
    recorder: list | None = None

    def mode(self, router: FocusRouter) -> str:
        """``"soft"`` or ``"topk"`` for ``router`` under the current settings."""
        if self.routing == "auto":
            return "soft" if router.training else "topk"
        return self.routing


_RUNTIMES: dict[int, tuple[weakref.ref, FocusRuntime]] = {}


def register_runtime(model_config, runtime: FocusRuntime) -> None:
    """Attach ``runtime`` to a model config. Raises ``ValueError`` if one is attached."""
    if lookup_runtime(model_config) is not None:
        raise ValueError(
            "this model already has Focus attached (call unload() on its FocusModel first)"
        )
    _RUNTIMES[id(model_config)] = (weakref.ref(model_config), runtime)


def unregister_runtime(model_config) -> None:
    """Detach the runtime of ``model_config`` (no-op if none)."""
    _RUNTIMES.pop(id(model_config), None)


def lookup_runtime(model_config) -> FocusRuntime | None:
    """The runtime attached to ``model_config``, or None."""
    entry = _RUNTIMES.get(id(model_config))
    if entry is None:
        return None
    ref, runtime = entry
    if ref() is not model_config:  # a dead config whose id was reused
        _RUNTIMES.pop(id(model_config), None)
        return None
    return runtime


def _runtime_or_raise(model_config) -> FocusRuntime:
    runtime = lookup_runtime(model_config)
    if runtime is None:
        raise ValueError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} is set on a model that has no Focus "
            "adapter attached: wrap the model with focus_attention.get_focus_model(model, config)"
        )
    return runtime


@dataclass(eq=False)
class LayerHandle:
    """Per-Focus-layer state kept on the attention module as ``module._focus_handle``.

    ``hidden`` / ``cache`` / ``has_cache`` are set by the pre-hook for the one attention call
    that follows and consumed by :func:`focus_attention_forward`.
    """

    layer_idx: int
    router: FocusRouter
    runtime: FocusRuntime
    hidden: torch.Tensor | None = None
    cache_layer: FocusCacheLayer | None = None
    has_cache: bool = False
    hook: Any = field(default=None, repr=False)


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


class FocusCacheLayer(DynamicLayer):
    """A full (never window-truncated) dynamic cache layer that also keeps the top-k group
    memberships of its cached keys, bool ``[B, N_cached, K]`` in ``groups`` (product
    decision, issue 3 section 3). Cropping, beam reordering and batch selection apply to the
    groups as to the keys."""

    is_sliding = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.groups: torch.Tensor | None = None

    @property
    def group_length(self) -> int:
        return 0 if self.groups is None else int(self.groups.shape[1])

    def append_groups(self, groups: torch.Tensor) -> None:
        groups = groups.detach()
        self.groups = groups if self.groups is None else torch.cat([self.groups, groups], dim=1)

    def reset(self) -> None:
        super().reset()
        self.groups = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove and self.groups is not None:
            self.groups = self.groups[:, : -abs(tokens_to_remove)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.groups is not None:
            self.groups = self.groups.index_select(0, beam_idx.to(self.groups.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.groups is not None:
            self.groups = self.groups.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.groups is not None:
            self.groups = self.groups[indices, ...]


#: ``cache_implementation`` values (``generate``) whose caches Focus layers can use: the
#: default dynamic cache (None / ``"dynamic"``) and its CPU-offloaded variant.
DYNAMIC_CACHE_IMPLEMENTATIONS = (None, "dynamic", "offloaded")
_DYNAMIC_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # FocusCacheLayer included


def check_dynamic_cache(cache: Any = None, cache_implementation: str | None = None) -> None:
    """Refuse, before any forward, a KV cache Focus layers cannot use.

    Args:
        cache: a ``past_key_values`` object, or None.
        cache_implementation: ``generate``'s ``cache_implementation``, or None.

    Raises:
        ValueError: a ``cache_implementation`` other than those in
            :data:`DYNAMIC_CACHE_IMPLEMENTATIONS` (``"static"``, ``"offloaded_static"``,
            ``"sliding_window"``, ``"hybrid"``, ``"quantized"``, ``"paged"``...), or a cache
            with a layer that is not a dynamic one (``StaticLayer``, ``QuantizedLayer``...).
    """
    need = (
        "Focus layers need a dynamic KV cache that keeps every key (transformers.DynamicCache, "
        "the default)"
    )
    if cache_implementation not in DYNAMIC_CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"{need}; cache_implementation={cache_implementation!r} is not supported: leave "
            "cache_implementation unset (or 'dynamic')"
        )
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if isinstance(cache, Cache):
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, _DYNAMIC_LAYERS):
                raise ValueError(
                    f"{need}; layer {i} of the given {type(cache).__name__} is a "
                    f"{type(layer).__name__} (static, quantized and offloaded-static caches are "
                    "not supported)"
                )


def _focus_cache_layer(cache: Any, layer_idx: int) -> FocusCacheLayer:
    """Make layer ``layer_idx`` of ``cache`` a :class:`FocusCacheLayer` and return it.

    An empty ``DynamicLayer`` or ``DynamicSlidingWindowLayer`` (transformers builds the
    latter for layers its config marks sliding, e.g. Mistral with ``sliding_window``) is
    replaced, so a Focus layer keeps every key.

    Raises:
        ValueError: a cache that is not a dynamic ``Cache`` (static, quantized, ...), or a
            layer that already holds keys without Focus groups.
    """
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if not isinstance(cache, Cache):
        raise ValueError(
            f"Focus layers need a transformers Cache object, received {type(cache).__name__}"
        )
    if cache.layer_class_to_replicate is not None:
        while len(cache.layers) < layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
        if len(cache.layers) == layer_idx:
            cache.layers.append(FocusCacheLayer())
    if layer_idx >= len(cache.layers):
        raise ValueError(f"the KV cache has {len(cache.layers)} layers; Focus layer {layer_idx}")
    layer = cache.layers[layer_idx]
    if isinstance(layer, FocusCacheLayer):
        if layer.group_length != layer.get_seq_length():
            raise ValueError(
                f"KV cache layer {layer_idx} holds {layer.get_seq_length()} keys but "
                f"{layer.group_length} Focus group rows (was it filled with Focus disabled?)"
            )
        return layer
    if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
        held = layer.get_seq_length()
        if held:
            raise ValueError(
                f"KV cache layer {layer_idx} already holds {held} keys computed without Focus "
                "(filled with Focus disabled or by another model); start from an empty cache"
            )
        fresh = FocusCacheLayer()
        cache.layers[layer_idx] = fresh
        return fresh
    raise ValueError(
        f"Focus layers need a dynamic KV cache (transformers.DynamicCache); layer {layer_idx} "
        f"of the given cache is a {type(layer).__name__}. Static, quantized and offloaded-static "
        "caches are not supported."
    )


@torch.compiler.disable
def focus_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on a Focus attention module: capture the hidden state entering it
    (``[B, N, d_model]``) and prepare its KV-cache layer (spec section 8).

    Runs eagerly under ``torch.compile`` (``torch.compiler.disable``), like
    :func:`_focus_layer`: see :func:`focus_attention_forward`."""
    handle: LayerHandle | None = module.__dict__.get("_focus_handle")
    if handle is None or not handle.runtime.enabled:
        return
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(
            f"Focus could not find the hidden state entering {type(module).__name__} "
            "(expected the first positional argument or `hidden_states=`)"
        )
    handle.hidden = hidden
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    handle.has_cache = cache is not None
    handle.cache_layer = None
    if cache is not None:
        cfg = handle.runtime.focus_config
        topk = handle.runtime.mode(handle.router) == "topk"
        if topk and cfg.inference_routing == "sequence":
            raise ValueError(
                "inference_routing='sequence' (the paper's sequence-wide Sinkhorn) is not causal: "
                "a token's groups depend on later tokens, so it cannot use a KV cache. Call the "
                "model with use_cache=False, or use inference_routing='causal'."
            )
        handle.cache_layer = _focus_cache_layer(cache, handle.layer_idx)


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------


class FocusMask:
    """What the ``"focus"`` mask function hands to the ``"focus"`` attention function.

    Attributes:
        kwargs: the keyword arguments transformers passed to the mask function (batch size,
            lengths, offsets, ``mask_function``, 2-D ``attention_mask``...).
        base_impl: the base attention implementation, whose mask :meth:`base_mask` builds.
        padding: bool ``[B, L]`` (True = real token) over every token so far, or None.
    """

    def __init__(self, kwargs: dict, base_impl: str) -> None:
        self.kwargs = kwargs
        self.base_impl = base_impl
        pad = kwargs.get("attention_mask")
        self.padding: torch.Tensor | None = None if pad is None else pad.to(torch.bool)
        self._base: Any = self
        self._checked = False
        self._keys: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    def base_mask(self) -> Any:
        """The mask the base implementation would have received (built once, lazily)."""
        if self._base is self:
            fn = ALL_MASK_ATTENTION_FUNCTIONS[self.base_impl]
            self._base = fn(**self.kwargs)
        return self._base

    def check_causal(self) -> None:
        """Raise ``ValueError`` unless the mask pattern is plain causal or sliding-window
        causal (padding aside). Checked once per mask object."""
        if self._checked:
            return
        fn = self.kwargs.get("mask_function")
        if fn is not causal_mask_function:
            if self.kwargs.get("use_vmap"):
                raise ValueError(_unsupported_mask("a custom or/and mask overlay"))
            _check_pattern(fn, self.kwargs)
        self._checked = True

    def keys(self, nk: int, sink_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(real [B, Nk] bool or None, sinks [B, Nk] bool or None)`` for ``nk`` keys.

        Raises:
            ValueError: the 2-D mask does not cover exactly the ``nk`` keys.
        """
        if nk not in self._keys:
            real = self.padding
            if real is not None:
                if real.shape[1] != nk:
                    raise ValueError(
                        f"Focus: the 2-D attention_mask covers {real.shape[1]} tokens but the "
                        f"layer has {nk} keys (past + current); pass a mask over every token"
                    )
                if bool(real.all()):
                    real = None
            self._keys[nk] = (real, _sink_keys(real, nk, sink_tokens, self.kwargs["device"]))
        return self._keys[nk]


def _unsupported_mask(what: str) -> str:
    return (
        f"Focus layers support causal attention with a 2-D padding mask only; this call "
        f"carries {what} (packed sequences without attention_mask, bidirectional attention "
        "and mask overlays are not supported)"
    )


def _check_pattern(fn: Callable | None, kw: dict) -> None:
    """Evaluate ``fn`` block by block and compare it with causal / sliding-causal."""
    if fn is None:
        raise ValueError(_unsupported_mask("no mask function"))
    device = kw.get("device", "cpu")
    b, q_len, kv_len = kw["batch_size"], kw["q_length"], kw["kv_length"]
    q_off, kv_off = int(kw.get("q_offset", 0)), int(kw.get("kv_offset", 0))
    local = kw.get("local_size")
    bidx = torch.arange(b, device=device)[:, None, None, None]
    hidx = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    kv = torch.arange(kv_len, device=device) + kv_off
    causal_ok, sliding_ok = True, local is not None
    for start in range(0, q_len, _CHECK_BLOCK):
        q = torch.arange(start, min(q_len, start + _CHECK_BLOCK), device=device) + q_off
        try:
            got = fn(bidx, hidx, q[None, None, :, None], kv[None, None, None, :])
            got = torch.as_tensor(got, device=device).expand(b, 1, q.numel(), kv_len)
        except Exception as err:  # an index-based function that cannot broadcast
            raise ValueError(_unsupported_mask(f"a mask function that failed ({err})")) from err
        causal = (kv[None, :] <= q[:, None])[None, None]
        causal_ok = causal_ok and bool((got == causal).all())
        if sliding_ok:
            sliding = causal & (kv[None, :] > q[:, None] - int(local))[None, None]
            sliding_ok = bool((got == sliding).all())
        if not (causal_ok or sliding_ok):
            raise ValueError(_unsupported_mask("a mask pattern that is not causal"))


def _sink_keys(
    real: torch.Tensor | None, nk: int, sink_tokens: int, device: Any
) -> torch.Tensor | None:
    """Keys among the first ``sink_tokens`` real tokens of their sequence, bool ``[B, Nk]``."""
    if sink_tokens <= 0:
        return None
    if real is None:
        return (torch.arange(nk, device=device) < sink_tokens)[None, :]
    index = real.long().cumsum(dim=-1) - 1  # index among the real tokens
    return real & (index < sink_tokens)


def focus_mask_interface(**kwargs: Any) -> FocusMask:
    """Mask function registered as ``"focus"`` with ``AttentionMaskInterface``.

    Receives the keyword arguments transformers passes to every mask function
    (``batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
    attention_mask`` (2-D bool ``[B, L]`` or None), ``config``, ``device``, ...) and returns a
    :class:`FocusMask` wrapping them (spec section 8, product decision).

    Raises:
        ValueError: the model config has no Focus adapter attached.
    """
    runtime = _runtime_or_raise(kwargs.get("config"))
    return FocusMask(kwargs, runtime.base_impl)


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------


def _base_attention(impl: str, module: torch.nn.Module) -> Callable:
    if impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"no eager attention function found for {type(module).__name__}")
    return eager


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
        attention_mask: a :class:`FocusMask` (from :func:`focus_mask_interface`), or None.
        dropout: attention dropout of the base model; not applied on Focus layers (product
            decision: the base weights are frozen and the soft gate is the regulariser).
        scaling: logit scale the model passes (GPT-2's inverse-layer scaling, Gemma's
            ``query_pre_attn_scalar``); default ``module.scaling`` or ``D ** -0.5``.
        kwargs: ``softcap`` (Gemma-2 logit soft-capping) is honoured; ``sliding_window`` is
            ignored on Focus layers; the rest is passed to the base implementation on other
            layers.

    Returns:
        ``(out [B, Nq, H, D] in the query's dtype, None)``; on non-Focus layers whatever the
        base implementation returns.

    Raises:
        ValueError: unsupported masks or caches (see module docstring), soft routing with a
            non-empty KV cache, ``inference_routing="sequence"`` with a KV cache.

    Under ``torch.compile`` a Focus layer's routing and attention (and the pre-hook) run
    eagerly (``torch.compiler.disable``: dynamo breaks the graph around them):
    ``sparse_attention`` compiled by inductor gives wrong numbers (measured: max |diff| ~2
    on a 40-token call; ``aot_eager`` is exact, so the op's in-place merges are the suspect,
    not pinned down), and the routing state passes through Python objects. The rest of the
    model compiles as usual.
    """
    handle: LayerHandle | None = module.__dict__.get("_focus_handle")
    if handle is None or not handle.runtime.enabled:
        runtime = handle.runtime if handle is not None else _runtime_or_raise(module.config)
        mask = (
            attention_mask.base_mask() if isinstance(attention_mask, FocusMask) else attention_mask
        )
        fn = _base_attention(runtime.base_impl, module)
        return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    out = _focus_layer(handle, module, query, key, value, attention_mask, scaling, kwargs)
    return out.transpose(1, 2).contiguous(), None


@torch.compiler.disable
def _focus_layer(
    handle: LayerHandle,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None,
    kwargs: dict,
) -> torch.Tensor:
    runtime, router, cfg = handle.runtime, handle.router, handle.runtime.focus_config
    hidden, cache_layer, has_cache = handle.hidden, handle.cache_layer, handle.has_cache
    handle.hidden, handle.cache_layer, handle.has_cache = None, None, False
    bsz, _, nq, head_dim = query.shape
    nk = key.shape[2]
    if hidden is None or tuple(hidden.shape[:2]) != (bsz, nq):
        got = None if hidden is None else tuple(hidden.shape)
        raise ValueError(
            f"Focus layer {handle.layer_idx}: captured hidden state {got} does not match the "
            f"query [B={bsz}, N={nq}] (was the attention module called without its pre-hook?)"
        )
    if isinstance(attention_mask, FocusMask):
        attention_mask.check_causal()
        real, sinks = attention_mask.keys(nk, cfg.sink_tokens)
    elif attention_mask is None:
        real, sinks = None, _sink_keys(None, nk, cfg.sink_tokens, query.device)
    else:
        raise ValueError(
            _unsupported_mask(f"a prepared {type(attention_mask).__name__} mask")
            + "; pass the 2-D attention_mask to the model instead"
        )
    real_q = None if real is None else real[:, nk - nq :]
    if sinks is not None and sinks.shape[0] != bsz:
        sinks = sinks.expand(bsz, nk)
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    scale = head_dim**-0.5 if scale is None else float(scale)
    softcap = kwargs.get("softcap")
    mode = runtime.mode(router)
    scores = router.scores(hidden)  # [B, Nq, K] fp32
    past = None if cache_layer is None else cache_layer.groups
    past_len = 0 if past is None else past.shape[1]
    if past_len + nq != nk:
        raise ValueError(
            f"Focus layer {handle.layer_idx}: {nk} keys but {past_len} cached group rows + "
            f"{nq} new tokens (keys without a Focus cache layer?)"
        )
    record: dict[str, Any] = {"layer": handle.layer_idx, "mode": mode}
    if mode == "soft":
        if nk != nq:
            raise ValueError(
                "soft (Sinkhorn) routing normalises over the whole sequence and cannot "
                f"continue from a KV cache holding {nk - nq} tokens; use eval() or "
                "set_routing('topk') to decode"
            )
        probs, column_bias = router.soft(scores, cfg.sinkhorn_iters, real_q)
        if router.training:
            router.update_bias(column_bias.detach(), real_q)
        out = gated_attention(
            query,
            key,
            value,
            probs,
            probs,
            cfg.window,
            gate=cfg.gate,
            sharpness=cfg.gate_sharpness,
            scale=scale,
            softcap=softcap,
            key_padding_mask=real,
            always_visible=sinks,
        )
        q_groups = k_groups = None
        if cache_layer is not None or runtime.recorder is not None:
            # keep the cache consistent should decoding continue in top-k mode
            q_groups = router.causal_groups(scores.detach(), cfg.top_k)
            if real_q is not None:
                q_groups = q_groups & real_q[..., None]
        record["probs"] = probs.detach()
    else:
        if cfg.inference_routing == "sequence":
            if has_cache:
                raise ValueError("inference_routing='sequence' cannot use a KV cache")
            # top-k of the Sinkhorn rows == top-k of scores + the sequence's column bias
            _, column_bias = router.soft(scores, cfg.sinkhorn_iters, real_q)
            q_groups = topk_memberships(scores + column_bias[:, None, :], cfg.top_k)
        else:
            q_groups = router.causal_groups(scores, cfg.top_k)
        if real_q is not None:
            q_groups = q_groups & real_q[..., None]
        k_groups = q_groups if past is None else torch.cat([past, q_groups], dim=1)
        if sinks is not None:
            k_groups = k_groups | sinks[..., None]
        out = sparse_attention(
            query,
            key,
            value,
            q_groups,
            k_groups,
            cfg.window,
            scale=scale,
            key_padding_mask=real,
            softcap=softcap,
        )
    if cache_layer is not None:
        cache_layer.append_groups(q_groups)
    if runtime.recorder is not None:
        record.update(
            query_groups=q_groups.detach(),
            key_groups=None if k_groups is None else k_groups.detach(),
            key_padding=real,
            sinks=sinks,
            num_keys=nk,
        )
        runtime.recorder.append(record)
    return out


def register_focus_attention() -> None:
    """Register :func:`focus_attention_forward` and :func:`focus_mask_interface` under the name
    ``"focus"`` (both, or transformers silently drops the causal mask; spec section 8).
    Idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, focus_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, focus_mask_interface)
