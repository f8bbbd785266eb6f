"""Dense heads and head gates: the optional step of a Focus layer after routing, where some of
its heads attend densely (``FocusConfig.dense_heads``) or every head's output is mixed with
its dense output (:class:`~focus_attention.hf.head_gates.HeadGates`; docs/method.md §5 and §7).

The heads of ``dense_heads`` run the base model's attention beside the routed ones. A
decoding-sized call (:func:`~focus_attention.ops.sparse.decoding_sized`) routes every head
and then overwrites the dense heads' outputs: the op on a few extra heads costs less than
copying the routed heads' cached keys and values out of the cache at every step (routing is
per token, so the routed heads' outputs are those of the op on them alone). A longer call
runs the op on the routed heads only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.sparse import decoding_sized
from .base_attention import causal_maps
from .head_gates import mix_heads
from .layer_call import LayerCall

__all__ = ["HeadSplit", "head_split", "with_dense_heads"]

#: ``dense(query, key, value) -> out [B, H', Nq, D]``: the base attention on some heads
DenseAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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

    def focus_heads(self, call: LayerCall) -> LayerCall:
        """The call the Focus op runs: every head for a decoding-sized call, else the routed
        heads' queries, keys and values only."""
        if decoding_sized(call.query.shape[2]):
            return call
        return call.heads(call.query.index_select(1, self.routed_q),
                          call.key.index_select(1, self.routed_kv),
                          call.value.index_select(1, self.routed_kv))  # fmt: skip

    def merge(self, routed: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """``[B, H, Nq, ...]`` from the Focus op's ``routed`` output (every head, or the
        routed heads') and the dense heads' ``dense`` ``[B, H_dense, Nq, ...]``."""
        dense = dense.to(routed.dtype)
        if routed.shape[1] == self.routed_q.numel() + self.dense_q.numel():
            return routed.index_copy(1, self.dense_q, dense)
        out = routed.new_zeros(routed.shape[0], routed.shape[1] + dense.shape[1], *routed.shape[2:])  # fmt: skip
        return out.index_copy(1, self.routed_q, routed).index_copy(1, self.dense_q, dense)


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


def with_dense_heads(call: LayerCall, split: HeadSplit | None, alpha: torch.Tensor | None,
                     out: torch.Tensor, maps: torch.Tensor | None,
                     dense: DenseAttention) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The Focus op's ``(out, maps)`` (``[B, H', Nq, ...]``, every head or the routed heads
    of ``split``) completed to ``[B, H, Nq, ...]``: the dense heads' outputs (and their
    causal maps) from the base attention ``dense``; then, with head gates ``alpha``
    (``[H_kv]``, or None), every head's output mixed with its dense output (the maps stay
    the Focus layer's)."""
    if split is not None:
        q, k = split.dense_queries(call.query), split.dense_keys(call.key)
        out = split.merge(out, dense(q, k, split.dense_keys(call.value)))
        if maps is not None:
            maps = split.merge(maps, causal_maps(q, k, call.real, call.scale, call.softcap))
    if alpha is not None:
        out = mix_heads(alpha, dense(call.query, call.key, call.value), out)
    return out, maps
