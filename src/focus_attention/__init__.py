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

# The Hugging Face adapter is imported lazily so that `import focus_attention` does not
# pay for importing transformers.
_HF_EXPORTS = ("FocusConfig", "FocusModel", "get_focus_model")
__all__ += list(_HF_EXPORTS)


def __getattr__(name: str):
    if name in _HF_EXPORTS:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
