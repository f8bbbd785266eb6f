"""What a Focus layer asks of the keys it attends: one protocol that every cache layer of a Focus
layer implements (docs/method.md §5 and §8).

A Focus layer routes the new tokens of a call, hands their key memberships to its cache,
and asks the cache to attend: the layer never asks which cache it has. Four classes implement
:class:`FocusCache`:

- :class:`CallKeys`: no KV cache, the keys of this call only;
- :class:`~focus_attention.hf.cache.FocusCacheLayer`: transformers' dynamic cache (every key,
  buffered);
- :class:`~focus_attention.hf.static_cache.FocusStaticLayer`: the static cache (preallocated
  keys, values and group buckets; a decoding step reads nothing back to the host);
- :class:`~focus_attention.hf.paged.SequenceGroups`: one packed sequence (or a batch of
  decoding steps) of transformers' continuous batching, over the paged cache.

Every key's groups are those of its ``top_k`` memberships, and every group for one of the
first ``sink_tokens`` real tokens of its row (docs/method.md §3); a padding key is in none.
The dynamic and the static cache also follow transformers' cache operations (beam
reordering, cropping, batch repetition and selection, reset): each keeps its groups in step
with its keys; the paged cache copies a forked request's groups with its blocks
(:func:`~focus_attention.hf.paged.copy_groups_with_blocks`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..ops import sparse_attention

__all__ = ["CallKeys", "FocusCache", "KeyGroups", "over_groups"]


def over_groups(mask: torch.Tensor, groups_dim: int) -> torch.Tensor:
    """``mask`` (bool ``[B, N]``, or ``[1, N]``) indexed to broadcast over the group axes of
    memberships of rank ``groups_dim``: ``[B, N, K]`` (3) or, per key-value head,
    ``[B, N, H_kv, K]`` (4)."""
    return mask[(..., *(None,) * (groups_dim - 2))]


class FocusCache(Protocol):
    """The keys a Focus-layer call attends and their groups.

    Attributes:
        is_cache: whether the groups outlive the call (a KV cache).
        static: whether ``key`` and ``value`` arrive as the cache's whole preallocated
            buffers ``[B, H_kv, C, D]``, the cache itself keeping which keys are real and
            which are sinks (the static cache); otherwise they hold exactly the keys so far.
    """

    is_cache: bool
    static: bool

    def check_keys(self, num_keys: int, num_new: int, layer_idx: int) -> None:
        """Raise ``ValueError`` unless ``num_keys`` keys are the cached ones plus ``num_new``."""

    def append_groups(self, key_groups: torch.Tensor, sink_tokens: int = 0, *,
                      real_new: torch.Tensor | None = None,
                      sinks_new: torch.Tensor | None = None) -> None:  # fmt: skip
        """Record the groups of the call's ``N`` new tokens as keys: their memberships bool
        ``[B, N, K]`` (a padding token in none), computed with ``sink_tokens`` sink tokens;
        which of them are real (bool ``[B, N]``, or None: all) and which are sinks (bool
        ``[B, N]``, or None: none; a static cache counts its sinks itself).

        Raises:
            ValueError: groups cached earlier were computed with another ``sink_tokens`` (or
                another batch or number of groups).
        """

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               query_groups: torch.Tensor, *, window: int, scale: float,
               softcap: float | None, key_padding_mask: torch.Tensor | None,
               backend: str) -> torch.Tensor:  # fmt: skip
        """Exact attention of the call's queries ``[B, H, Nq, D]`` (memberships
        ``query_groups`` bool ``[B, Nq, K]``) over the keys under the Focus mask:
        ``out [B, H, Nq, D]`` in the query's dtype, through the op's one dispatcher
        (:func:`~focus_attention.ops.sparse_attention` or
        :func:`~focus_attention.ops.sparse.decode_attention`)."""

    def key_groups(self, key_padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``(groups bool [B, Nk, K], real bool [B, Nk] or None)`` of every key attended (the
        static cache reads the number of its keys back to the host)."""


class KeyGroups:
    """The :class:`FocusCache` methods of a cache whose calls hold exactly the keys so far
    (no KV cache, the dynamic one, a packed sequence): its ``groups`` bool ``[B, Nk, K]`` are
    every key's, the attention is :func:`~focus_attention.ops.sparse_attention` on them.
    A subclass stores the new rows in :meth:`store_groups` and says how many it holds in
    ``group_length``."""

    static = False
    is_cache = True
    groups: torch.Tensor | None
    group_length: int

    def store_groups(self, groups: torch.Tensor, sink_tokens: int) -> None:
        """Append the new keys' groups bool ``[B, N, K]`` (sinks included) to ``groups``."""
        raise NotImplementedError

    def check_keys(self, num_keys: int, num_new: int, layer_idx: int) -> None:
        """See :meth:`FocusCache.check_keys`."""
        if self.group_length + num_new != num_keys:
            raise ValueError(
                f"Focus layer {layer_idx}: {num_keys} keys but {self.group_length} cached group "
                f"rows + {num_new} new tokens (keys without a Focus cache layer, or added while "
                "the layer was in FocusConfig.dense_layers?); start from an empty cache"
            )

    def append_groups(self, key_groups: torch.Tensor, sink_tokens: int = 0, *,
                      real_new: torch.Tensor | None = None,
                      sinks_new: torch.Tensor | None = None) -> None:  # fmt: skip
        """See :meth:`FocusCache.append_groups`: a sink joins every group (of every head,
        for memberships per key-value head ``[B, N, H_kv, K]``)."""
        if sinks_new is not None:
            sinks_new = over_groups(sinks_new, key_groups.dim())
        groups = key_groups if sinks_new is None else key_groups | sinks_new
        self.store_groups(groups, sink_tokens)

    def attend(self, query, key, value, query_groups, *, window, scale, softcap,
               key_padding_mask, backend) -> torch.Tensor:  # fmt: skip
        """See :meth:`FocusCache.attend`."""
        return sparse_attention(
            query, key, value, query_groups, self.groups, window, scale=scale,
            key_padding_mask=key_padding_mask, softcap=softcap, backend=backend,
        )  # fmt: skip

    def key_groups(self, key_padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """See :meth:`FocusCache.key_groups`."""
        return self.groups, key_padding_mask


class CallKeys(KeyGroups):
    """The :class:`FocusCache` of a call without a KV cache: the call's own keys."""

    is_cache = False

    def __init__(self) -> None:
        self.groups = None
        self.group_length = 0

    def store_groups(self, groups: torch.Tensor, sink_tokens: int) -> None:
        self.groups = groups
