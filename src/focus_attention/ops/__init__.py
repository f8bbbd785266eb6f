"""Focus ops: routing, Sinkhorn, masks, the dense oracle, soft gates, the log-sum-exp merge
and exact sparse attention."""

from .gates import GATES, gated_attention, straight_through
from .masks import focus_mask
from .merge import merge_partials
from .metrics import dominance, group_shares, pairs_retained
from .reference import dense_attention, expand_kv_heads
from .routing import (
    causal_topk_groups,
    causal_topk_groups_many,
    group_scores,
    sinkhorn,
    topk_memberships,
)
from .sparse import (
    BACKENDS,
    SparseBackend,
    SparseRequest,
    backend_names,
    fused_kernel_available,
    register_backend,
    resolve_backend,
    sparse_attention,
)

__all__ = [
    "BACKENDS",
    "GATES",
    "SparseBackend",
    "SparseRequest",
    "backend_names",
    "causal_topk_groups",
    "causal_topk_groups_many",
    "dense_attention",
    "dominance",
    "expand_kv_heads",
    "focus_mask",
    "fused_kernel_available",
    "gated_attention",
    "group_scores",
    "group_shares",
    "merge_partials",
    "pairs_retained",
    "register_backend",
    "resolve_backend",
    "sinkhorn",
    "sparse_attention",
    "straight_through",
    "topk_memberships",
]
