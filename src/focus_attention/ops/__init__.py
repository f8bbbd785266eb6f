"""Focus ops: routing, Sinkhorn, masks, the dense oracle, soft gates and exact sparse attention."""

from .gates import GATES, gated_attention
from .masks import focus_mask
from .metrics import dominance, group_shares, pairs_retained
from .reference import dense_attention, expand_kv_heads
from .routing import group_scores, sinkhorn, topk_memberships
from .sparse import BACKENDS, fused_kernel_available, sparse_attention

__all__ = [
    "BACKENDS",
    "GATES",
    "dense_attention",
    "dominance",
    "expand_kv_heads",
    "focus_mask",
    "fused_kernel_available",
    "gated_attention",
    "group_scores",
    "group_shares",
    "pairs_retained",
    "sinkhorn",
    "sparse_attention",
    "topk_memberships",
]
