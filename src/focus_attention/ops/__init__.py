"""Focus ops: routing, Sinkhorn, masks, the masked-attention primitive and the dense oracle
(:mod:`.reference`, the method in one file), soft gates, the log-sum-exp merge and exact
sparse attention. Each name is imported from its module on first access
(:mod:`focus_attention.utils.lazy`), so that the torch-free :mod:`.names` imports alone."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            ".names": ("GATES",),
            ".gates": ("gated_attention", "straight_through"),
            ".masks": ("focus_mask",),
            ".merge": ("merge_partials",),
            ".metrics": ("dominance", "group_shares", "pairs_retained"),
            ".reference": (
                "attention_probs",
                "dense_attention",
                "expand_kv_heads",
                "masked_attention",
                "masked_softmax",
            ),
            ".routing": (
                "causal_topk_groups",
                "causal_topk_groups_many",
                "group_scores",
                "sinkhorn",
                "topk_memberships",
            ),
            ".sparse": (
                "BACKENDS",
                "BackendUnavailable",
                "SparseBackend",
                "SparseRequest",
                "backend_names",
                "decode_attention",
                "fused_kernel_available",
                "register_backend",
                "resolve_backend",
                "sparse_attention",
            ),
        }
    ),
)
