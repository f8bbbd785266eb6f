"""The ``gather`` backend: attention that reads only the keys it attends, chosen by
``"auto"`` for decoding-sized calls (:func:`~.dispatch.decoding_sized`; docs/method.md §5,
"Decoding"). Asked for by name it runs any call, exactly, in ``O(Nq x Nk)`` memory.

For a call with ``Nq`` queries, the keys visible to at least one of them (causal, real, and
inside the window or sharing a group) are found from the membership masks alone (``Nk x K``
booleans, no key is read), gathered into a dense ``[B, H_kv, M, D]`` block with
``index_select`` (only those ``M`` key and value rows are read), and attended with a
per-query mask over the block (:func:`focus_attention.ops.reference.masked_attention`): the
visible set of every query is a subset of the block, so the result is exact. A decoding step
of top-1 routing reads about ``window + Nk / K`` keys instead of ``Nk``. Any device and
floating dtype (computed in float32, float64 for float64 inputs), soft-capping,
differentiable.

``"auto"`` chooses it on CUDA only: on the CPU the fused kernel's scan of the key codes was
faster at every context length measured (docs/method.md §5, "Backends").
"""

from __future__ import annotations

import dataclasses

import torch

from ..reference import masked_attention
from .dispatch import (
    MAX_DECODE_QUERIES,
    SparseBackend,
    SparseInputs,
    SparseRequest,
    decoding_sized,
    register_backend,
)

__all__ = ["gather_indices", "query_rows", "run_gather", "visible_keys"]


def visible_keys(inputs: SparseInputs) -> torch.Tensor:
    """bool ``[B, Nq, Nk]``: key ``j`` is visible to query ``t`` (at position
    ``Nk - Nq + t``) under the Focus mask (docs/method.md §4). Built on the device from the
    memberships, in a fixed number of operations (nothing read back)."""
    qg, kg = inputs.query_groups, inputs.key_groups
    nq, nk = qg.shape[1], kg.shape[1]
    dev = qg.device
    if nq == 1:  # a decoding step: the last position, so every key is causal
        share = (kg & qg).any(dim=-1)  # [B, Nk]
        vis = (share | (torch.arange(nk, device=dev) >= nk - inputs.window))[:, None, :]
    else:  # distance from query t to key j, negative for a later key
        distance = torch.arange(nk - nq, nk, device=dev)[:, None] - torch.arange(nk, device=dev)
        share = (qg.to(torch.float32) @ kg.to(torch.float32).transpose(1, 2)) > 0  # [B, Nq, Nk]
        vis = (share | (distance < inputs.window)) & (distance >= 0)
    if inputs.key_padding_mask is not None:
        vis = vis & inputs.key_padding_mask[:, None, :]
    return vis


def query_rows(inputs: SparseInputs, start: int, stop: int) -> SparseInputs:
    """``inputs`` for queries ``start .. stop - 1`` alone, with the keys up to the last of
    them (the later ones are invisible to all): a call of its own, bottom-right aligned as
    the whole one."""
    nq, nk = inputs.query.shape[2], inputs.key.shape[2]
    last = nk - nq + stop  # keys a query of the block can see: 0 .. last - 1
    padding = inputs.key_padding_mask
    return dataclasses.replace(
        inputs,
        query=inputs.query[:, :, start:stop],
        key=inputs.key[:, :, :last],
        value=inputs.value[:, :, :last],
        query_groups=inputs.query_groups[:, start:stop],
        key_groups=inputs.key_groups[:, :last],
        key_padding_mask=None if padding is None else padding[:, :last],
    )


def gather_indices(union: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B, M], valid [B, M])`` of the keys in bool ``union [B, Nk]``, in increasing
    position, ``M`` the largest count over the batch (shorter rows padded with key 0,
    ``valid`` False)."""
    if union.shape[0] == 1:
        index = union[0].nonzero().squeeze(1)[None]
        return index, torch.ones_like(index, dtype=torch.bool)
    counts = union.sum(dim=-1)
    m = int(counts.max())
    order = torch.argsort((~union).to(torch.uint8), dim=-1, stable=True)[:, :m]
    valid = torch.arange(m, device=union.device)[None, :] < counts[:, None]
    return torch.where(valid, order, torch.zeros_like(order)), valid


def _gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t [B, H_kv, Nk, D]`` at ``index [B, M]`` along the keys: ``[B, H_kv, M, D]``."""
    b, h, _, d = t.shape
    if b == 1:
        return t.index_select(2, index[0])
    return t.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))


def run_gather(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``gather`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse [B, Nq, H])``,
    token-major; a query with no visible key gives zeros and ``-inf``."""
    q = inputs.query
    b, nq = q.shape[0], q.shape[2]
    vis = visible_keys(inputs)
    index, valid = gather_indices(vis.any(dim=1))
    k = _gather_rows(inputs.key, index)
    v = _gather_rows(inputs.value, index)
    mask = vis.gather(2, index[:, None, :].expand(b, nq, index.shape[1])) & valid[:, None, :]
    out, lse = masked_attention(q, k, v, mask, scale=inputs.scale, softcap=inputs.softcap)
    return out.transpose(1, 2).contiguous().to(q.dtype), lse.transpose(1, 2).contiguous()


def _decode_sized(request: SparseRequest) -> str | None:
    if request.num_queries < 1 or not decoding_sized(request.num_queries):
        return (f"is chosen by 'auto' for at most {MAX_DECODE_QUERIES} queries per call (a "
                f"decoding step), received {request.num_queries}")  # fmt: skip
    return None


BACKEND = SparseBackend(
    name="gather",
    run=run_gather,
    priority=8,
    differentiable=True,
    softcap=True,
    auto_devices=("cuda",),
    auto_check=_decode_sized,
    summary=f"gathers the visible keys of at most {MAX_DECODE_QUERIES} queries (decoding)",
)
register_backend(BACKEND)
