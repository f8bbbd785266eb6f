"""focus-attention: learned-grouping sparse attention for pretrained causal LMs (Focus).

The front door: :class:`FocusConfig`, :func:`get_focus_model` and :class:`FocusModel` (the
Hugging Face adapter, docs/method.md §8), :func:`export_model` (a model directory any
transformers tool loads, docs/deploy.md), :func:`sparse_attention` (exact sparse attention,
§5) and the routing helpers (§2-§4). Everything else lives in its subpackage. Each name is
imported on first access, so ``import focus_attention`` imports neither torch nor
transformers."""

from .utils.lazy import exports_of, lazy_exports
from .utils.versions import PACKAGE_VERSION as __version__

__getattr__, __dir__, _exported = lazy_exports(
    __name__,
    exports_of(
        {
            ".hf.config": ("FocusConfig",),
            ".hf.model": ("FocusModel", "get_focus_model"),
            ".deploy.export": ("export_model",),
            ".ops.sparse": ("sparse_attention",),
            ".ops.masks": ("focus_mask",),
            ".ops.metrics": ("dominance", "group_shares", "pairs_retained"),
            ".ops.reference": ("dense_attention",),
            ".ops.gates": ("gated_attention",),
            ".ops.routing": ("group_scores", "sinkhorn", "topk_memberships"),
        }
    ),
)
__all__ = ["__version__", *_exported]
