"""Attention coverage of an adapter: the share of the dense model's attention beyond the
window that its top-k routing keeps (docs/method.md §6 "Objectives", §9).

Perplexity says how much sparsity costs; coverage says why: a query whose dense attention
beyond the window falls on keys outside its groups loses that mass under top-k routing. For
each window, one gradient-free dense forward records every Focus layer's queries, keys and
the hidden state its router reads (``FocusModel.record_dense_attention``); the router's
causal top-k groups of that hidden state then decide which distant pairs are kept.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.coverage import distant_attention, hard_coverage

__all__ = ["evenly_spaced_rows", "recorded_distant", "recorded_groups", "topk_coverage"]


def evenly_spaced_rows(num_queries: int, window: int, count: int) -> torch.Tensor:
    """``count`` query indices evenly spaced from ``min(window, num_queries - 1)`` (the first
    query with keys beyond the window) to the last query, duplicates dropped; int64 ``[R]``."""
    first = min(window, num_queries - 1)
    return torch.linspace(first, num_queries - 1, count).long().unique()


def recorded_distant(rec: dict[str, Any], window: int, rows: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """:func:`~focus_attention.ops.coverage.distant_attention` of one record of
    ``FocusModel.record_dense_attention``: float32 ``[B, R, N]``."""
    return distant_attention(
        rec["query"], rec["key"], window, scale=rec["scale"], softcap=rec["softcap"],
        key_padding_mask=rec["key_padding"], always_visible=rec["sinks"], rows=rows,
    )  # fmt: skip


def recorded_groups(router: Any, scores: torch.Tensor, top_k: int, rec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Causal top-k memberships of a recorded layer call, as a Focus layer forms them
    (docs/method.md §4): ``(query groups, key groups)`` bool ``[B, N, K]``, padding in no
    group, the sink keys in every group."""
    real, sinks = rec["key_padding"], rec["sinks"]
    groups = router.causal_groups(scores, top_k)
    if real is not None:
        groups = groups & real[..., None]
    return groups, groups if sinks is None else groups | sinks[..., None]


def _layer_kept(fm: Any, rec: dict[str, Any], top_ks: list[int], rows: torch.Tensor | None) -> dict[int, tuple[float, float]]:  # fmt: skip
    """``{top_k: (kept, total)}`` distant mass of one recorded layer call."""
    router = fm.routers[str(rec["layer"])]
    distant = recorded_distant(rec, fm.focus_config.window, rows)
    scores = router.scores(rec["hidden"])
    out = {}
    for k in top_ks:
        kept, total = hard_coverage(distant, *recorded_groups(router, scores, k, rec), rows)
        out[k] = (float(kept), float(total))
    return out


@torch.no_grad()
def topk_coverage(
    fm: Any, blocks: torch.Tensor, top_ks: list[int], *, rows: torch.Tensor | None = None
) -> dict[str, Any]:
    """Share of the dense model's distant attention that top-k routing keeps.

    Args:
        fm: a ``FocusModel`` (its routers and causal routing bias are used as they are).
        blocks: int64 ``[n_windows, seq_len]`` token windows, each scored alone.
        top_ks: the ``top_k`` values to measure (each in ``1..num_groups``).
        rows: optional int64 query indices per window (default: every query).

    Returns:
        ``{"topk": {k: share}, "by_layer": {k: {layer: share}}, "distant_share": float}``:
        kept distant mass over all distant mass, pooled over windows and queries (layers
        averaged with equal weight), and the dense model's attention share beyond the window
        (mean over the measured queries and layers). The layers in ``dense_layers`` keep
        all their attention and are left out.

    Raises:
        ValueError: a ``top_k`` outside ``1..num_groups``; every Focus layer dense.
    """
    cfg = fm.focus_config
    bad = [k for k in top_ks if not 1 <= k <= cfg.num_groups]
    if bad:
        raise ValueError(f"top_k values {bad}: expected ints in 1..num_groups={cfg.num_groups}")
    kept: dict[int, dict[int, float]] = {k: {} for k in top_ks}
    total: dict[int, float] = {}
    device = next(fm.parameters()).device
    for i in range(blocks.shape[0]):
        with fm.record_dense_attention() as records:
            fm(input_ids=blocks[i : i + 1].to(device), use_cache=False)
        for rec in records:
            layer = rec["layer"]
            for k, (kk, tt) in _layer_kept(fm, rec, top_ks, rows).items():
                kept[k][layer] = kept[k].get(layer, 0.0) + kk
                if k == top_ks[0]:
                    total[layer] = total.get(layer, 0.0) + tt
        del records
    if not total:
        raise ValueError(
            "attention coverage: no routed Focus layer to measure (every Focus layer is in "
            f"dense_layers {list(cfg.dense_layers)}, where all attention is kept)"
        )
    by_layer = {str(k): {str(i): kept[k][i] / max(total[i], 1e-30) for i in total} for k in top_ks}
    n_rows = blocks.shape[1] if rows is None else rows.numel()
    return {
        "topk": {k: sum(v.values()) / len(v) for k, v in by_layer.items()},
        "by_layer": by_layer,
        "distant_share": sum(total.values()) / (len(total) * blocks.shape[0] * n_rows),
    }
