"""Attention coverage: how much of a dense model's attention beyond the local window a
routing keeps (docs/method.md §6, "Objectives").

Top-k routing drops every distant pair ``(i, j)`` (outside the window, not a sink) whose query
and key share no group. What that costs the model depends on how much attention the dense
model put on those pairs. :func:`distant_attention` gives the dense model's attention
probabilities on distant pairs (averaged over the query heads, as all heads of a layer share
one routing); :func:`soft_coverage` and :func:`hard_coverage` weigh them by the soft
co-membership ``g_i . g_j`` of the Sinkhorn rows or by the hard top-k mask.
"""

from __future__ import annotations

import torch

from ..utils.precision import without_autocast
from .checks import check_bool, check_positive, check_qkv, check_shape, check_tensor, fail
from .masks import effective_window
from .reference import expand_kv_heads, masked_softmax

__all__ = ["distant_attention", "hard_coverage", "soft_coverage"]


def _check_rows(rows: torch.Tensor | None, nq: int, device: torch.device) -> torch.Tensor:
    """The query rows as int64 ``[R]`` (all ``Nq`` rows when None)."""
    if rows is None:
        return torch.arange(nq, device=device)
    check_tensor("rows", rows, 1)
    if rows.dtype != torch.long:
        fail("rows", f"dtype {rows.dtype}", "torch.int64 query indices")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= nq):
        fail("rows", f"indices in [{int(rows.min())}, {int(rows.max())}]", f"indices in [0, {nq})")
    return rows.to(device)


@torch.no_grad()
@without_autocast
def distant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    window: int,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    always_visible: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    chunk_size: int = 256,
    per_kv_head: bool = False,
) -> torch.Tensor:
    """Dense causal attention probabilities of the distant pairs, averaged over heads (or
    their maximum over the query heads of each key-value head).

    ``A_ij = mean_h softmax_j(scale * q_hi . k_hj)`` over the causal, real keys (queries
    bottom-right aligned, GQA keys shared as in the attention ops), then kept only where
    ``i - j >= window`` and key ``j`` is not always visible (a sink); zero elsewhere. Row sums
    are the share of the dense model's attention that top-k routing can drop.

    Args:
        query: ``[B, H, Nq, D]``; key: ``[B, H_kv, Nk, D]``, ``H % H_kv == 0``.
        window: local window in tokens (``>= 1``), as in the Focus mask (docs/method.md §3).
        scale: logit scale, default ``D ** -0.5``; softcap: optional Gemma-2 soft-capping.
        key_padding_mask: optional bool ``[B, Nk]``, True = real key.
        always_visible: optional bool ``[B, Nk]``: sink keys every query sees (never distant).
        rows: optional int64 ``[R]`` query indices to compute (default all ``Nq``), e.g. a
            random sample of queries to bound the cost.
        chunk_size: query rows per chunk (memory ``O(B * H * chunk_size * Nk)``).
        per_kv_head: the maximum over the query heads of each key-value head, not the mean.

    Returns:
        float32 ``[B, R, Nk]`` (``[B, H_kv, R, Nk]`` with ``per_kv_head``; float64 for
        float64 inputs), without gradient.

    Raises:
        ValueError: malformed shapes or dtypes, ``window < 1``, bad ``rows``, ``scale`` or
            ``softcap`` not a finite number > 0, ``chunk_size < 1``.
    """
    check_qkv(query, key, key)
    bsz, heads, nq, head_dim = query.shape
    nk = key.shape[2]
    if nq > nk:
        fail("query", f"Nq = {nq} queries for Nk = {nk} keys", "Nq <= Nk")
    if not isinstance(window, int) or window < 1:
        fail("window", repr(window), "an int >= 1")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        fail("chunk_size", repr(chunk_size), "an int >= 1")
    for name, mask in (("key_padding_mask", key_padding_mask), ("always_visible", always_visible)):
        if mask is not None:
            check_bool(name, mask)
            check_shape(name, mask, (bsz, nk), "[B, Nk]")
    scale = check_positive("scale", scale)
    softcap = check_positive("softcap", softcap)
    scale = head_dim**-0.5 if scale is None else scale
    rows = _check_rows(rows, nq, query.device)
    ct = torch.promote_types(query.dtype, torch.float32)
    k = expand_kv_heads(key, heads).to(ct)
    win = effective_window(window, nk)
    kpos = torch.arange(nk, device=query.device)
    out = []
    for start in range(0, rows.numel(), chunk_size):
        idx = rows[start : start + chunk_size]
        qpos = (nk - nq + idx)[:, None]  # [R, 1] absolute positions
        visible = (kpos[None] <= qpos)[None]  # [1, R, Nk]
        if key_padding_mask is not None:
            visible = visible & key_padding_mask[:, None, :]
        probs, _ = masked_softmax(query[:, :, idx].to(ct), k, visible, scale=scale,
                                  softcap=softcap, eager=True)  # fmt: skip
        distant = (qpos - kpos[None]) >= win
        if always_visible is not None:
            distant = distant & ~always_visible[:, None, :]
        out.append(_head_reduced(probs, distant, key.shape[1] if per_kv_head else None))
    if not out:
        shape = (bsz, key.shape[1], 0, nk) if per_kv_head else (bsz, 0, nk)
        return torch.zeros(shape, dtype=ct, device=query.device)
    return torch.cat(out, dim=-2)


def _head_reduced(probs: torch.Tensor, distant: torch.Tensor, kv_heads: int | None) -> torch.Tensor:  # fmt: skip
    """``probs`` ``[B, H, R, Nk]`` on the ``distant`` pairs (``[R, Nk]`` or ``[B, R, Nk]``):
    the mean over heads ``[B, R, Nk]``, or with ``kv_heads`` the maximum over the query heads
    of each key-value head ``[B, H_kv, R, Nk]``."""
    if kv_heads is None:
        return probs.mean(dim=1) * distant
    probs = probs.unflatten(1, (kv_heads, -1)).amax(dim=2)
    return probs * (distant[:, None] if distant.dim() == 3 else distant)


def _check_coverage(distant: torch.Tensor, rows: torch.Tensor | None, queries: tuple, keys: tuple) -> torch.Tensor:  # fmt: skip
    """Check ``distant`` against the query rows and the ``(name, tensor)`` routing of the
    queries ``[B, Nq, K]`` and keys ``[B, Nk, K]``; the rows as int64 ``[R]``."""
    check_tensor("distant", distant, 3, floating=True)
    rows = _check_rows(rows, queries[1].shape[1], distant.device)
    if distant.shape[1] != rows.numel():
        fail("distant", f"{distant.shape[1]} rows", f"one per query index in rows ({rows.numel()})")
    bsz, _, nk = distant.shape
    check_shape(keys[0], keys[1], (bsz, nk, queries[1].shape[-1]), "[B, Nk, K]")
    return rows


def soft_coverage(
    distant: torch.Tensor,
    query_probs: torch.Tensor,
    key_probs: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distant attention mass kept by soft routing: ``sum_ij A_ij (g_i . g_j)``.

    Args:
        distant: ``[B, R, Nk]`` from :func:`distant_attention` (no gradient needed).
        query_probs: ``[B, Nq, K]`` Sinkhorn rows of the queries (gradients flow here).
        key_probs: ``[B, Nk, K]`` Sinkhorn rows of the keys (gradients flow here).
        rows: the query indices ``distant`` was computed for (default all ``Nq``).

    Returns:
        ``(kept, total)`` float32 scalars: the kept mass and the whole distant mass
        ``sum_ij A_ij``; ``1 - kept / total`` is the share a soft routing drops. Rows of
        Sinkhorn output sum to 1, so ``g_i . g_j <= 1`` and ``kept <= total``.

    Raises:
        ValueError: shapes that do not match.
    """
    check_tensor("query_probs", query_probs, 3, floating=True)
    check_tensor("key_probs", key_probs, 3, floating=True)
    rows = _check_coverage(distant, rows, ("query_probs", query_probs), ("key_probs", key_probs))
    pulled = distant.to(key_probs.dtype) @ key_probs  # [B, R, K]
    kept = (query_probs[:, rows] * pulled).sum()
    return kept, distant.sum()


@torch.no_grad()
def hard_coverage(
    distant: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distant attention mass kept by top-k routing: ``sum_ij A_ij [i and j share a group]``.

    Args:
        distant: ``[B, R, Nk]`` from :func:`distant_attention`.
        query_groups: bool ``[B, Nq, K]``; key_groups: bool ``[B, Nk, K]`` (docs/method.md §4).
        rows: the query indices ``distant`` was computed for (default all ``Nq``).

    Returns:
        ``(kept, total)`` float32 scalars, as in :func:`soft_coverage`.

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    check_bool("query_groups", query_groups)
    check_bool("key_groups", key_groups)
    rows = _check_coverage(distant, rows, ("query_groups", query_groups), ("key_groups", key_groups))  # fmt: skip
    shared = (query_groups[:, rows].float() @ key_groups.float().transpose(1, 2)) > 0
    return (distant * shared).sum(), distant.sum()
