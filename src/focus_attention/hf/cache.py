"""The KV cache of Focus layers: every key kept, with the group memberships of the cached keys
(docs/method.md §5 and §8)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
)


class FocusCacheLayer(DynamicLayer):
    """A full (never window-truncated) dynamic cache layer that also keeps the top-k group
    memberships of its cached keys, bool ``[B, N_cached, K]`` in ``groups`` (docs/method.md
    §5). Cropping, beam reordering and batch selection apply to the groups as to the keys."""

    is_sliding = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.groups: torch.Tensor | None = None

    @property
    def group_length(self) -> int:
        """Number of cached tokens whose groups are held."""
        return 0 if self.groups is None else int(self.groups.shape[1])

    def append_groups(self, groups: torch.Tensor) -> None:
        """Append the memberships bool ``[B, N_new, K]`` of the tokens just cached."""
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
#: the cache layer types a Focus layer can take over (FocusCacheLayer is a DynamicLayer)
DYNAMIC_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


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
            if not isinstance(layer, DYNAMIC_LAYERS):
                raise ValueError(
                    f"{need}; layer {i} of the given {type(cache).__name__} is a "
                    f"{type(layer).__name__} (static, quantized and offloaded-static caches are "
                    "not supported)"
                )


def focus_cache_layer(cache: Any, layer_idx: int) -> FocusCacheLayer:
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
                f"{layer.group_length} Focus group rows (keys added with Focus disabled or "
                "while the layer was in FocusConfig.dense_layers?); start from an empty cache"
            )
        return layer
    if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
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
        f"Focus layers need a dynamic KV cache (transformers.DynamicCache); layer {layer_idx} "
        f"of the given cache is a {type(layer).__name__}. Static, quantized and offloaded-static "
        "caches are not supported."
    )
