"""The ``cpu_flash`` backend: the decomposition of docs/method.md §5 as calls of PyTorch's
CPU flash-attention kernel (native GQA, log-sum-exp output), merged in place in float32.

Inference only; the fallback of ``"auto"`` on CPU when the fused kernel cannot be built.
"""

from __future__ import annotations

import math

import torch

from ..merge import merge_partials
from .decomposition import Decomposition
from .dispatch import CPU_DTYPES, SparseBackend, SparseInputs, register_backend

__all__ = ["InPlaceMerge", "attend_cpu_flash", "run_cpu_flash"]


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # boolean logic decides visibility; this only converts it to the kernel's format
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def attend_cpu_flash(q, k, v, mask, causal, scale: float):
    """One PyTorch CPU flash-attention call (native GQA). ``q [(nb,) H, n, D]``,
    ``k/v [(nb,) H_kv, m, D]``, bool ``mask`` broadcastable to ``[(nb,) 1, n, m]`` or None.
    Returns ``(out like q, lse [(nb,) H, n] float32)``; a query with no visible key gives
    0 and ``-inf``."""
    batched = q.ndim == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    attn_mask = None if mask is None else _float_mask(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale
    )[:2]
    if not batched:
        out, lse = out[0], lse[0]
    lse = lse.float()
    if mask is not None:  # the kernel reports lse 0 and a finite row when nothing is visible
        empty = ~mask.any(dim=-1)
        if bool(empty.any()):
            lse = lse.masked_fill(empty, -math.inf)
            out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


class InPlaceMerge:
    """Accumulator of ``cpu_flash``: every piece is merged at once into token-major float32
    buffers ``out [Nq, H, D]`` and ``lse [Nq, H]`` (overwritten), so the op needs the memory
    of one float32 output. Token-major rows make the gathers and scatters contiguous
    copies. Rows no piece has reached yet hold output 0 and log-sum-exp ``-inf``; a piece
    for such rows only is copied (the merge with an empty part is that copy)."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.out = out.zero_()
        self.lse = lse.fill_(-math.inf)
        self.touched = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)

    def add(self, part, block, rows, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge ``out [H, n, D]``, ``lse [H, n]`` into query ``rows`` (a slice or indices)."""
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)  # [n, H, D], [n, H] views
        if isinstance(rows, slice):
            if bool(self.touched[rows].any()):
                out, lse = merge_partials(self.out[rows], self.lse[rows], out, lse)
            self.out[rows], self.lse[rows] = out, lse
        else:
            if bool(self.touched[rows].any()):
                old_out, old_lse = self.out.index_select(0, rows), self.lse.index_select(0, rows)
                out, lse = merge_partials(old_out, old_lse, out, lse)
            self.out.index_copy_(0, rows, out.to(self.out.dtype))
            self.lse.index_copy_(0, rows, lse)
        self.touched[rows] = True


def run_cpu_flash(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cpu_flash`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse
    [B, Nq, H] float32)``, token-major."""
    # one copy into [B, H, N, D] rows makes every later gather a contiguous row copy
    # (transformers hands over transposed [B, N, H, D] views)
    query, key, value = (t.contiguous() for t in (inputs.query, inputs.key, inputs.value))
    b, h, nq, d = query.shape
    out = torch.empty(b, nq, h, d, dtype=torch.float32, device=query.device)
    lse = torch.empty(b, nq, h, dtype=torch.float32, device=query.device)

    def attend(q, k, v, mask, causal):
        return attend_cpu_flash(q, k, v, mask, causal, inputs.scale)

    for i in range(b):
        real = None if inputs.key_padding_mask is None else inputs.key_padding_mask[i]
        run = Decomposition(query[i], key[i], value[i], attend, InPlaceMerge(out[i], lse[i]))
        run.group_part(inputs.query_groups[i], inputs.key_groups[i], real)
        run.local_part(inputs.query_groups[i], inputs.key_groups[i], real, inputs.window)
    return out.to(query.dtype), lse


BACKEND = SparseBackend(
    name="cpu_flash",
    run=run_cpu_flash,
    priority=20,
    devices=("cpu",),
    dtypes=CPU_DTYPES,
    summary="calls of PyTorch's CPU flash-attention kernel, merged in float32; inference only",
)
register_backend(BACKEND)
