"""The KV cache of Focus layers: every key kept, with the group memberships of the cached keys
(docs/method.md §5 and §8). :func:`focus_cache_layer` gives a Focus layer its
:class:`~focus_attention.hf.focus_cache.FocusCache` in any cache it can use: a
:class:`FocusCacheLayer` in a dynamic cache, a
:class:`~focus_attention.hf.static_cache.FocusStaticLayer` in a static one, the
:class:`~focus_attention.hf.paged.PagedGroups` of continuous batching's paged cache."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
)

from .focus_cache import KeyGroups
from .paged import PagedGroups, is_paged_cache, paged_groups
from .static_cache import FocusStaticLayer, focus_static_layer, is_static_layer

#: spare rows a cache buffer gets when it grows, as a share of the rows it holds (and at
#: least :data:`MIN_SPARE_ROWS`): appending one token then costs no copy of the cache,
#: and a buffer holds at most about 1/8 more rows than it is filled with.
SPARE_SHARE = 8
MIN_SPARE_ROWS = 256


def _is_prefix(storage: torch.Tensor | None, held: torch.Tensor, dim: int) -> bool:
    """Whether ``held`` is ``storage.narrow(dim, 0, n)``, a prefix view of the buffer."""
    if storage is None or held.dim() != storage.dim() or held.data_ptr() != storage.data_ptr():
        return False
    if held.dtype != storage.dtype or held.stride() != storage.stride():
        return False
    return all(
        a == b for i, (a, b) in enumerate(zip(held.shape, storage.shape, strict=True)) if i != dim
    )


def append_rows(
    storage: torch.Tensor | None,
    held: torch.Tensor | None,
    new: torch.Tensor,
    dim: int,
    *,
    known_prefix: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Append ``new`` to ``held`` along ``dim`` in a preallocated buffer.

    Args:
        storage: the buffer ``held`` may be a prefix view of (or None).
        held: the rows held so far; None, or ``DynamicLayer``'s empty 1-D placeholder,
            for none.
        new: rows to append, shaped as ``held`` but along ``dim``.
        dim: the sequence dimension.
        known_prefix: the caller knows ``held`` is the rows this function last returned for
            ``storage`` (the same tensor object), so the prefix test is skipped.

    Returns:
        ``(storage, rows)``: ``rows`` equals ``torch.cat([held, new], dim)`` and is a prefix
        view of ``storage``. The buffer is reused while ``held`` is still its prefix (not
        replaced by a beam reordering, a batch selection, an offload...) and has room;
        otherwise a new one with spare rows is allocated and ``held`` copied once. Under
        autograd (``new`` or ``held`` requiring grad) it is ``torch.cat`` and no buffer.
    """
    if held is None or held.dim() != new.dim():  # DynamicLayer starts from an empty 1-D tensor
        held = new.narrow(dim, 0, 0)
    if torch.is_grad_enabled() and (new.requires_grad or held.requires_grad):
        return None, torch.cat([held, new], dim=dim)
    n, m = held.shape[dim], new.shape[dim]
    prefix = storage is not None and (known_prefix or _is_prefix(storage, held, dim))
    reusable = prefix and n + m <= storage.shape[dim]
    if reusable and storage.is_inference() and not torch.is_inference_mode_enabled():
        reusable = False  # an inference tensor cannot be written outside inference mode
    if not reusable:
        shape = list(new.shape)
        shape[dim] = n + m + max(MIN_SPARE_ROWS, (n + m) // SPARE_SHARE)
        storage = new.new_empty(shape)
        storage.narrow(dim, 0, n).copy_(held)
    storage.narrow(dim, n, m).copy_(new)
    return storage, storage.narrow(dim, 0, n + m)


class BufferedDynamicLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are prefix views of buffers with spare rows
    (:func:`append_rows`), so a decoding step appends its token without copying the cache
    (a ``DynamicLayer`` concatenates: a copy of every cached key and value per step). Rows
    once returned are never written again (after a ``crop`` the next append copies), so
    tensors handed out earlier keep their values, as with a ``DynamicLayer``. Usable by any
    model: ``cache.layers[i] = BufferedDynamicLayer()`` on an empty ``DynamicCache``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._storage: dict[str, torch.Tensor | None] = {}
        self._rows: dict[str, torch.Tensor] = {}  # what _append last returned, per name

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states [B, H_kv, N_new, D]``; returns every cached
        ``(keys, values) [B, H_kv, N_cached, D]`` (prefix views of the layer's buffers)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append("keys", self.keys, key_states, 2)
        self.values = self._append("values", self.values, value_states, 2)
        return self.keys, self.values

    def _append(self, name: str, held, new: torch.Tensor, dim: int) -> torch.Tensor:
        known = held is not None and held is self._rows.get(name)
        self._storage[name], rows = append_rows(
            self._storage.get(name), held, new, dim, known_prefix=known
        )
        self._rows[name] = rows
        return rows

    def reset(self) -> None:
        super().reset()
        self._storage, self._rows = {}, {}

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove:  # rows handed out before the crop are never written again
            self._storage, self._rows = {}, {}


class FocusCacheLayer(BufferedDynamicLayer, KeyGroups):
    """A full (never window-truncated) dynamic cache layer that also keeps, per cached key,
    the groups whose queries see it, bool ``[B, N_cached, K]`` in ``groups``: the key's
    top-k memberships, and every group for one of the first ``sink_tokens`` real tokens
    (docs/method.md §3 and §5); a :class:`~focus_attention.hf.focus_cache.FocusCache`.
    Cropping, beam reordering, batch repetition and selection apply to the groups as to the
    keys; offloading moves the keys and values only (the groups stay where they are). Keys,
    values and groups are appended without copying the cache (:class:`BufferedDynamicLayer`)."""

    is_sliding = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.groups: torch.Tensor | None = None
        self.sink_tokens: int | None = None

    @property
    def group_length(self) -> int:
        """Number of cached tokens whose groups are held."""
        return 0 if self.groups is None else int(self.groups.shape[1])

    def store_groups(self, groups: torch.Tensor, sink_tokens: int = 0) -> None:
        """Append the key groups bool ``[B, N_new, K]`` of the tokens just cached (sinks
        included), computed with ``sink_tokens`` sink tokens.

        Raises:
            ValueError: the cached groups were computed with another ``sink_tokens``.
        """
        if self.group_length and self.sink_tokens != sink_tokens:
            raise ValueError(
                f"the KV cache holds Focus groups computed with sink_tokens={self.sink_tokens}, "
                f"this call has sink_tokens={sink_tokens}; start from an empty cache"
            )
        self.sink_tokens = sink_tokens
        self.groups = self._append("groups", self.groups, groups.detach(), 1)

    def reset(self) -> None:
        super().reset()
        self.groups = None
        self.sink_tokens = None

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
#: default dynamic cache (None / ``"dynamic"``), its CPU-offloaded variant, and the static
#: cache (:mod:`.static_cache`: preallocated, for decoding steps captured in CUDA graphs).
CACHE_IMPLEMENTATIONS = (None, "dynamic", "offloaded", "static")
#: the dynamic cache layer types a Focus layer can take over (FocusCacheLayer is a DynamicLayer)
DYNAMIC_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
#: empty cache layers a Focus layer replaces by a :class:`FocusCacheLayer`
_REPLACEABLE = (*DYNAMIC_LAYERS, BufferedDynamicLayer)
#: what a KV cache of Focus layers must be, for the messages that refuse others
_NEED = (
    "Focus layers need a KV cache that keeps every key: transformers.DynamicCache (the "
    "default) or StaticCache"
)


def check_cache(cache: Any = None, cache_implementation: str | None = None) -> None:
    """Refuse, before any forward, a KV cache Focus layers cannot use.

    Args:
        cache: a ``past_key_values`` / ``cache`` object, or None.
        cache_implementation: ``generate``'s ``cache_implementation``, or None.

    Raises:
        ValueError: a ``cache_implementation`` other than those in
            :data:`CACHE_IMPLEMENTATIONS` (``"offloaded_static"``, ``"sliding_window"``,
            ``"hybrid"``, ``"quantized"``, ``"paged"``...), or a cache with a layer that is
            neither a dynamic nor a static one (``QuantizedLayer``...).
    """
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"{_NEED}; cache_implementation={cache_implementation!r} is not supported: leave "
            "cache_implementation unset (or 'dynamic'), or 'static'"
        )
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if isinstance(cache, Cache):
        if getattr(cache, "offloading", False) and any(is_static_layer(x) for x in cache.layers):
            raise ValueError(f"{_NEED}; an offloaded static cache is not supported")
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, DYNAMIC_LAYERS) and not is_static_layer(layer):
                raise ValueError(
                    f"{_NEED}; layer {i} of the given {type(cache).__name__} is a "
                    f"{type(layer).__name__} (quantized and offloaded-static caches are not "
                    "supported)"
                )


def focus_cache_layer(cache: Any, layer_idx: int) -> FocusCacheLayer | FocusStaticLayer | PagedGroups:  # fmt: skip
    """Make layer ``layer_idx`` of ``cache`` a :class:`FocusCacheLayer` (a dynamic cache) or a
    :class:`~focus_attention.hf.static_cache.FocusStaticLayer` (a static one) and return it;
    of continuous batching's paged cache, the layer's
    :class:`~focus_attention.hf.paged.PagedGroups` (the groups by physical slot).

    An empty ``DynamicLayer``, ``BufferedDynamicLayer`` or ``DynamicSlidingWindowLayer``
    (transformers builds the latter for layers its config marks sliding, e.g. Mistral with
    ``sliding_window``) is replaced, so a Focus layer keeps every key; a static layer is
    replaced by :func:`~focus_attention.hf.static_cache.focus_static_layer`.

    Raises:
        ValueError: a cache that is neither a dynamic nor a static ``Cache`` (quantized, ...),
            or a layer that already holds keys without Focus groups; see also
            :func:`~focus_attention.hf.paged.paged_groups`.
    """
    if is_paged_cache(cache):
        return paged_groups(cache, layer_idx)
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
    if is_static_layer(layer):
        return focus_static_layer(cache, layer_idx)
    if isinstance(layer, FocusCacheLayer):
        if layer.group_length != layer.get_seq_length():
            raise ValueError(
                f"KV cache layer {layer_idx} holds {layer.get_seq_length()} keys but "
                f"{layer.group_length} Focus group rows (keys added with Focus disabled or "
                "while the layer was in FocusConfig.dense_layers?); start from an empty cache"
            )
        return layer
    if type(layer) in _REPLACEABLE:
        held = layer.get_seq_length()
        if held:
            raise ValueError(
                f"KV cache layer {layer_idx} already holds {held} keys computed without Focus "
                "(filled with Focus disabled, with the layer in FocusConfig.dense_layers, or by "
                "another model); start from an empty cache"
            )
        fresh = FocusCacheLayer()
        cache.layers[layer_idx] = fresh
        return fresh
    raise ValueError(
        f"{_NEED}; layer {layer_idx} of the given cache is a {type(layer).__name__}. Quantized "
        "and offloaded-static caches are not supported."
    )
