"""The static KV cache of Focus layers: preallocated keys, values and group buckets, so that a
decoding step has no host synchronisation and no shape that depends on the routing, and can
be captured in a CUDA graph (docs/method.md §5, "Decoding with a static cache").

transformers' ``StaticCache`` (``generate(..., cache_implementation="static")``, or built by
hand) preallocates ``[B, H_kv, max_cache_len, D]`` keys and values per layer and writes the
new tokens in place. On a Focus layer :func:`focus_static_layer` swaps its empty layer for a
:class:`FocusStaticLayer` (a :class:`~focus_attention.hf.focus_cache.FocusCache`), which also
keeps, per cached key, its group memberships and, per group, the positions of its keys in the
order they were written (:class:`~focus_attention.ops.sparse.buckets.GroupBuckets`, appended
in place). A decoding-sized call then attends through
:func:`~focus_attention.ops.sparse.decode_attention` over the buckets, reading nothing back;
a longer call (a prompt) reads the number of cached keys back once and runs
:func:`~focus_attention.ops.sparse_attention` on them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from ..ops import sparse_attention
from ..ops.sparse import GroupBuckets, decode_attention, decoding_sized
from .focus_cache import over_groups

__all__ = ["FocusStaticLayer", "focus_static_layer", "is_static_layer"]


class FocusStaticLayer(StaticLayer):
    """A ``StaticLayer`` that also keeps the Focus groups of its cached keys.

    Beside ``keys`` / ``values`` ``[B, H_kv, C, D]`` (``C = max_cache_len``) and the
    number of cached tokens ``cumulative_length`` (a 0-d int64 tensor, as in
    ``StaticLayer``), it holds, once the first tokens are cached:

    - ``groups`` bool ``[B, C, K]``: the groups whose queries see each cached key (its
      top-k memberships; every group for one of the first ``sink_tokens`` real tokens), or
      ``[B, C, H_kv, K]`` for a routing per key-value head (query-key routers);
    - ``buckets``: the same memberships as per-group position lists
      (:class:`~focus_attention.ops.sparse.buckets.GroupBuckets`, one routing row, or one
      per key-value head);
    - ``real`` bool ``[B, C]`` (True = real token), only once a call passed a padding mask;
    - ``real_count`` int64 ``[B]``: real tokens cached so far per row (for the sinks);
    - ``grouped``: a 0-d int64 tensor, the tokens whose groups were recorded (a prompt's
      call checks it equals ``cumulative_length``).

    Every buffer is written in place, at the positions of the new tokens, by a fixed
    sequence of device operations. Beam reordering (in place), cropping (in place, as
    ``StaticLayer``'s: the buckets forget the removed keys), batch repetition and selection,
    and reset apply to this state as to the keys and values.
    """

    is_sliding = False
    is_cache = True
    static = True

    def __init__(self, max_cache_len: int, **kwargs: Any) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.groups: torch.Tensor | None = None
        self.buckets: GroupBuckets | None = None
        self.real: torch.Tensor | None = None
        self.real_count: torch.Tensor | None = None
        self.grouped: torch.Tensor | None = None
        self.sink_tokens: int | None = None

    def check_keys(self, num_keys: int, num_new: int, layer_idx: int) -> None:
        """Nothing to check without reading back: :meth:`key_groups` checks at a prompt."""

    def append_groups(self, key_groups: torch.Tensor, sink_tokens: int = 0, *,
                      real_new: torch.Tensor | None = None,
                      sinks_new: torch.Tensor | None = None) -> None:  # fmt: skip
        """Record the key groups of the ``N`` tokens just cached (``update`` ran first, so
        they sit at ``cumulative_length - N .. cumulative_length - 1``).

        Args:
            key_groups: bool ``[B, N, K]``, the new tokens' top-k memberships as keys (a
                padding token's are ignored), or ``[B, N, H_kv, K]`` per key-value head;
                every call of a cache has the same layout.
            sink_tokens: the first ``sink_tokens`` real tokens of a row join every group
                (counted here from ``real_count``; ``sinks_new`` is not read).
            real_new: bool ``[B, N]`` (True = real) or None when every new token is real.

        Raises:
            ValueError: the cached groups were computed with another ``sink_tokens``,
                another number of groups or heads, or the batch differs from the cache's.
        """
        bsz, n = key_groups.shape[:2]
        self._check_groups(bsz, tuple(key_groups.shape[2:]), sink_tokens)
        device = key_groups.device
        positions = self.cumulative_length - n + torch.arange(n, device=device)
        if real_new is not None and self.real is None:  # padding from now on: earlier keys real
            self.real = torch.ones(bsz, self.max_cache_len, dtype=torch.bool, device=device)
        real = torch.ones(bsz, n, dtype=torch.bool, device=device) if real_new is None else real_new  # fmt: skip
        index = self.real_count[:, None] + real.long().cumsum(dim=1) - 1  # among real tokens
        sinks = real & (index < sink_tokens)
        rank = key_groups.dim()
        keys = (key_groups | over_groups(sinks, rank)) & over_groups(real, rank)
        self.real_count.add_(real.long().sum(dim=1))
        self.grouped.add_(n)
        if self.real is not None:
            self.real.index_copy_(1, positions, real)
        self.groups.index_copy_(1, positions, keys)
        self.buckets.append_(positions, keys[:, None] if keys.dim() == 3 else keys.transpose(1, 2))

    def _check_groups(self, bsz: int, layout: tuple[int, ...], sink_tokens: int) -> None:
        """Allocate the group buffers on the first call (``layout``: ``(K,)`` or ``(H_kv,
        K)``); refuse a change of ``sink_tokens``, of the layout or of the batch afterwards."""
        if self.groups is None:
            device = self.keys.device
            self.groups = torch.zeros(bsz, self.max_cache_len, *layout, dtype=torch.bool, device=device)  # fmt: skip
            rows = 1 if len(layout) == 1 else layout[0]
            self.buckets = GroupBuckets.empty(bsz, rows, layout[-1], self.max_cache_len, device)
            self.real_count = torch.zeros(bsz, dtype=torch.long, device=device)
            self.grouped = torch.zeros((), dtype=torch.long, device=device)
            self.sink_tokens = sink_tokens
            return
        if self.sink_tokens != sink_tokens:
            raise ValueError(
                f"the KV cache holds Focus groups computed with sink_tokens={self.sink_tokens}, "
                f"this call has sink_tokens={sink_tokens}; start from an empty cache"
            )
        held = (self.groups.shape[0], *self.groups.shape[2:])
        if held != (bsz, *layout):
            raise ValueError(
                f"the KV cache holds Focus groups of batch and (H_kv,) K {held}, this call has "
                f"{(bsz, *layout)}; start from an empty cache"
            )

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               query_groups: torch.Tensor, *, window: int, scale: float,
               softcap: float | None, key_padding_mask: torch.Tensor | None,
               backend: str) -> torch.Tensor:  # fmt: skip
        """Attention of the ``Nq`` newest tokens' queries over the cached keys under the Focus
        mask: ``out [B, H, Nq, D]`` in the query's dtype.

        Args:
            query: ``[B, H, Nq, D]``, the last ``Nq`` cached tokens' queries.
            key, value: ``[B, H_kv, C, D]``, this layer's ``keys`` and ``values`` (or some of
                their heads).
            query_groups: bool ``[B, Nq, K]``, their memberships as queries (``[B, Nq,
                H_kv, K]`` with per-head key groups).
            window, scale, softcap: as in :func:`~focus_attention.ops.sparse_attention`.
            key_padding_mask: not read (the layer keeps which keys are real).
            backend: ``FocusConfig.attention_backend``. With ``"auto"`` a decoding-sized call
                (:func:`~focus_attention.ops.sparse.decoding_sized`) runs
                :func:`~focus_attention.ops.sparse.decode_attention` over the buckets, reading
                nothing back; a longer call, or another backend, runs ``sparse_attention``
                with that backend on the cached keys (their number read back once).
        """
        if backend == "auto" and decoding_sized(query.shape[2]):
            lengths = self.cumulative_length.expand(query.shape[0])
            return decode_attention(
                query, key, value, query_groups, self.buckets, lengths, window, scale=scale,
                key_padding_mask=self.real, softcap=softcap,
            )  # fmt: skip
        groups, padding = self.key_groups(None)  # the number of cached keys read back once
        n = groups.shape[1]
        return sparse_attention(
            query, key[:, :, :n], value[:, :, :n], query_groups, groups, window, scale=scale,
            key_padding_mask=padding, softcap=softcap, backend=backend,
        )  # fmt: skip

    def key_groups(self, key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``(groups bool [B, N, K] or [B, N, H_kv, K], real bool [B, N] or None)`` of the
        ``N`` cached keys (their number read back to the host; ``key_padding_mask`` is not
        read).

        Raises:
            ValueError: keys were cached without their groups (written while Focus was
                disabled or the layer was in ``FocusConfig.dense_layers``).
        """
        n = int(self.cumulative_length)
        if int(self.grouped) != n:
            raise ValueError(
                f"the static KV cache holds {n} keys but the Focus groups of {int(self.grouped)} "
                "(keys added with Focus disabled or while the layer was in "
                "FocusConfig.dense_layers?); start from an empty cache"
            )
        return self.groups[:, :n], None if self.real is None else self.real[:, :n]

    def reset(self) -> None:
        super().reset()
        if self.groups is not None:
            self.groups.zero_()
            self.buckets.count.zero_()
            self.real_count.zero_()
            self.grouped.zero_()
            self.real = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` cached tokens in place (``StaticLayer``'s
        rule: a negative int), their groups and bucket entries with them (assisted decoding).

        Raises:
            RuntimeError: a positive ``tokens_to_remove`` (as ``StaticLayer``).
        """
        super().crop(tokens_to_remove)
        if self.groups is None or not tokens_to_remove:
            return
        self.grouped.sub_(abs(tokens_to_remove))
        kept = torch.arange(self.max_cache_len, device=self.groups.device) < self.cumulative_length  # fmt: skip
        self.buckets.crop_(self.cumulative_length.expand(self.groups.shape[0]))
        self.groups.masked_fill_(~over_groups(kept[None], self.groups.dim()), False)
        real = kept[None, :] if self.real is None else self.real & kept
        self.real_count.copy_(real.long().sum(dim=1).expand_as(self.real_count))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows for beam search, in place (the buffers keep their
        addresses): keys, values and every Focus buffer."""
        if not self.is_initialized:
            return
        index = beam_idx.to(self.keys.device)
        for t in (self.keys, self.values, self.groups, self.real, self.real_count):
            if t is not None:
                t.copy_(t.index_select(0, index))
        if self.buckets is not None:
            self.buckets.reorder_(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (new buffers of ``repeats x B`` rows)."""
        self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (new buffers)."""
        self._select_rows(lambda t: t[indices.to(t.device)])

    def _select_rows(self, rows) -> None:
        """Replace every per-row buffer ``t`` by ``rows(t)``."""
        if not self.is_initialized:
            return
        self.keys, self.values = rows(self.keys), rows(self.values)
        self.batch_size = self.keys.shape[0]
        if self.groups is None:
            return
        self.groups, self.real_count = rows(self.groups), rows(self.real_count)
        self.real = None if self.real is None else rows(self.real)
        buckets = self.buckets
        self.buckets = GroupBuckets(rows(buckets.index), rows(buckets.count), rows(buckets.codes))


def is_static_layer(layer: Any) -> bool:
    """Whether ``layer`` is a cache layer of transformers' static caches."""
    return isinstance(layer, StaticLayer)


def focus_static_layer(cache: Any, layer_idx: int) -> FocusStaticLayer:
    """Make layer ``layer_idx`` of a static ``cache`` a :class:`FocusStaticLayer` and return it.

    An empty ``StaticLayer`` is replaced by one of the same ``max_cache_len``; an empty
    ``StaticSlidingWindowLayer`` (a sliding-window layer of the base model) whose window is
    shorter than the cache by one of the longest full layer's ``max_cache_len``, so the Focus
    layer keeps every key.

    Raises:
        ValueError: the layer already holds keys computed without Focus; a sliding layer in
            a cache with no full-attention layer to take the length from.
    """
    layer = cache.layers[layer_idx]
    if isinstance(layer, FocusStaticLayer):
        return layer
    if layer.is_initialized and int(layer.cumulative_length):
        raise ValueError(
            f"KV cache layer {layer_idx} already holds keys computed without Focus (filled with "
            "Focus disabled, with the layer in FocusConfig.dense_layers, or by another model); "
            "start from an empty cache"
        )
    length = layer.max_cache_len
    # a sliding layer whose window is shorter than the cache holds only the window's length
    if isinstance(layer, StaticSlidingWindowLayer) and not getattr(layer, "_is_croppable", False):
        full = [x.max_cache_len for x in cache.layers if not isinstance(x, StaticSlidingWindowLayer)]  # fmt: skip
        if not full:
            raise ValueError(
                f"KV cache layer {layer_idx} is a sliding-window static layer of "
                f"{layer.max_cache_len} tokens and the cache has no full layer to take its "
                "length from: a Focus layer keeps every key (load the model with "
                "sliding_window=None, which Focus layers replace anyway, and build the StaticCache "
                "from its config; or use a dynamic cache)"
            )
        length = max(full)
    fresh = FocusStaticLayer(length)
    cache.layers[layer_idx] = fresh
    return fresh
