"""The ``math`` backend: the decomposition of docs/method.md §5 in blocked PyTorch code.

Differentiable, any device and floating dtype (computed in float32, float64 for float64
inputs), Gemma-2's logit soft-capping. Each piece of a part is attended by
:func:`focus_attention.ops.reference.masked_attention`; the pieces are assembled into one
``[H, Nq, D]`` result per part and the parts are merged with
:func:`focus_attention.ops.merge.merge_partials`, out of place, so autograd sees every step.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from ..merge import merge_partials
from ..reference import masked_attention
from .decomposition import Decomposition
from .dispatch import SparseBackend, SparseInputs, register_backend

__all__ = ["MATH_BLOCK", "PartsMerge", "attend_math", "run_math"]

#: queries per block inside the quadratic step (``O(MATH_BLOCK * m)`` memory per head).
MATH_BLOCK = 512


def attend_math(q, k, v, mask, causal, scale: float, softcap: float | None):
    """Differentiable attention: ``q [..., H, n, D]``, ``k/v [..., H_kv, m, D]``, bool
    ``mask [..., n, m]`` or None, ``causal`` (key ``j`` visible to query ``i`` iff
    ``j <= i``), in blocks of :data:`MATH_BLOCK` queries, each block by
    :func:`~focus_attention.ops.reference.masked_attention`. Returns ``(out [..., H, n, D],
    lse [..., H, n])`` in float32 (float64 for float64 inputs); a query with no visible key
    gives 0 and ``-inf``."""
    n, m = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for start in range(0, n, MATH_BLOCK):
        stop = min(n, start + MATH_BLOCK)
        hi = min(m, stop) if causal else m
        vis = None
        if causal:
            vis = (
                torch.arange(hi, device=q.device)[None, :]
                <= torch.arange(start, stop, device=q.device)[:, None]
            )
        elif mask is not None:
            vis = mask[..., start:stop, :]
        out, lse = masked_attention(q[..., start:stop, :], k[..., :hi, :], v[..., :hi, :], vis,
                                    scale=scale, softcap=softcap)  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


class PartsMerge:
    """Accumulator of the ``math`` backend (see :mod:`.decomposition`).

    Pieces of one ``(part, block)`` cover the same rows and are merged at once; the blocks
    of a part cover disjoint rows and are assembled into one ``[H, Nq, D]`` result (rows
    with no piece: output 0, log-sum-exp ``-inf``); :meth:`result` merges the parts.
    """

    def __init__(self, num_heads: int, nq: int, d: int, dtype: torch.dtype, device) -> None:
        self.h, self.nq, self.d, self.dtype, self.device = num_heads, nq, d, dtype, device
        self.parts: dict[str, dict[Hashable, tuple]] = {}

    def add(self, part: str, block: Hashable, rows, out, lse) -> None:
        """Merge one piece ``out [H, n, D]``, ``lse [H, n]`` of query ``rows``."""
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, device=self.device)
        blocks = self.parts.setdefault(part, {})
        if block in blocks:
            _, out0, lse0 = blocks[block]
            out, lse = merge_partials(out0, lse0, out, lse)
        blocks[block] = (rows, out, lse)

    def _assemble(self, blocks: dict) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.cat([b[0] for b in blocks.values()])
        out = torch.cat([b[1] for b in blocks.values()], dim=1)
        lse = torch.cat([b[2] for b in blocks.values()], dim=1)
        full_out = torch.zeros(self.h, self.nq, self.d, dtype=out.dtype, device=self.device)
        full_lse = torch.full((self.h, self.nq), -math.inf, dtype=lse.dtype, device=self.device)
        return full_out.index_copy(1, idx, out), full_lse.index_copy(1, idx, lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [H, Nq, D], lse [H, Nq])`` in the compute dtype: the merge of every part."""
        merged = None
        for blocks in self.parts.values():
            part = self._assemble(blocks)
            merged = part if merged is None else merge_partials(*merged, *part)
        if merged is None:
            ct = torch.promote_types(self.dtype, torch.float32)
            zeros = torch.zeros(self.h, self.nq, self.d, dtype=ct, device=self.device)
            return zeros, torch.full((self.h, self.nq), -math.inf, dtype=ct, device=self.device)
        return merged


def run_math(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``math`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse [B, Nq, H]
    float32, or float64 for float64 inputs)``, token-major."""
    query, key, value = inputs.query, inputs.key, inputs.value
    b, h, nq, d = query.shape
    rep = h // key.shape[1]

    def attend(q, k, v, mask, causal):
        if rep > 1:
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        return attend_math(q, k, v, mask, causal, inputs.scale, inputs.softcap)

    outs, lses = [], []
    for i in range(b):
        real = None if inputs.key_padding_mask is None else inputs.key_padding_mask[i]
        acc = PartsMerge(h, nq, d, query.dtype, query.device)
        run = Decomposition(query[i], key[i], value[i], attend, acc)
        run.group_part(inputs.query_groups[i], inputs.key_groups[i], real)
        run.local_part(inputs.query_groups[i], inputs.key_groups[i], real, inputs.window)
        out_i, lse_i = acc.result()
        outs.append(out_i.transpose(0, 1))
        lses.append(lse_i.transpose(0, 1))
    return torch.stack(outs).to(query.dtype), torch.stack(lses)


BACKEND = SparseBackend(
    name="math",
    run=run_math,
    priority=100,
    differentiable=True,
    softcap=True,
    summary="blocked PyTorch code: differentiable, any device and floating dtype",
)
register_backend(BACKEND)
