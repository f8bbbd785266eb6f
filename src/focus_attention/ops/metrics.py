"""Routing and sparsity metrics (docs/method.md §2, §4 and §9)."""

from __future__ import annotations

import torch

from ..utils.checks import check_int
from .checks import check_shape, check_tensor
from .masks import check_groups, focus_mask


def group_shares(
    assignments: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Share of routing mass held by each group over all real tokens of the batch.

    Args:
        assignments: ``[B, N, K]`` bool memberships (top-k) or float routing rows (Sinkhorn).
        padding_mask: optional bool ``[B, N]``, True = real token; padding is not counted.

    Returns:
        float32 ``[K]`` summing to 1 (all zeros if there is no real token).

    Raises:
        ValueError: ``assignments`` not of rank 3, ``padding_mask`` not ``[B, N]``.
    """
    check_tensor("assignments", assignments, 3)
    x = assignments.float()
    if padding_mask is not None:
        check_shape("padding_mask", padding_mask, tuple(x.shape[:2]), "[B, N]")
        x = x * padding_mask[..., None].float()
    mass = x.sum(dim=(0, 1))
    total = mass.sum()
    return mass / total if total > 0 else mass


def dominance(assignments: torch.Tensor, padding_mask: torch.Tensor | None = None) -> float:
    """Share of tokens in the largest group (docs/method.md §2): ``1/K`` is perfectly balanced,
    1.0 is total collapse. Same arguments as :func:`group_shares`."""
    return float(group_shares(assignments, padding_mask).max())


def pairs_retained(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    window: int,
    key_padding_mask: torch.Tensor | None = None,
    *,
    block_size: int = 1024,
) -> float:
    """Fraction of causal (query, real key) pairs that the Focus mask keeps.

    Computed block by block over queries (memory ``O(block_size * Nk)``), so it also serves
    sequences too long for :func:`focus_mask`. Arguments as :func:`focus_mask`; with
    per key-value head memberships ``[B, N, H_kv, K]``, the share of every head's pairs.

    Returns:
        a float in ``[0, 1]`` (1.0 for dense causal attention; 0.0 if there is no pair).

    Raises:
        ValueError: as :func:`focus_mask`; ``block_size`` not an int >= 1.
    """
    check_groups(query_groups, key_groups, key_padding_mask, window, owner="pairs_retained")
    check_int("pairs_retained", "block_size", block_size, 1)
    nq, nk = query_groups.shape[1], key_groups.shape[1]
    heads = query_groups.shape[2] if query_groups.dim() == 4 else 1
    kept = 0
    total = 0
    for start in range(0, nq, block_size):
        stop = min(nq, start + block_size)
        # a block of queries is the tail of a shorter sequence ending at its last query
        keys_end = nk - nq + stop
        kpm = None if key_padding_mask is None else key_padding_mask[:, :keys_end]
        mask = focus_mask(query_groups[:, start:stop], key_groups[:, :keys_end], window, kpm)
        causal = focus_mask(
            query_groups[:, start:stop].new_ones(query_groups.shape[0], stop - start, 1),
            key_groups.new_ones(key_groups.shape[0], keys_end, 1),
            window,
            kpm,
        )
        kept += int(mask.sum())
        total += heads * int(causal.sum())
    return kept / total if total else 0.0
