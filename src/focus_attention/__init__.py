"""focus-attention: learned-grouping sparse attention for pretrained causal LMs (Focus)."""

from .ops import (
    dense_attention,
    dominance,
    focus_mask,
    gated_attention,
    group_scores,
    group_shares,
    pairs_retained,
    sinkhorn,
    sparse_attention,
    topk_memberships,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "dense_attention",
    "dominance",
    "focus_mask",
    "gated_attention",
    "group_scores",
    "group_shares",
    "pairs_retained",
    "sinkhorn",
    "sparse_attention",
    "topk_memberships",
]
