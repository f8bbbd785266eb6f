"""Evaluation of a Focus adapter against its base model (docs/method.md §9): perplexity on
held-out text with routing statistics (:mod:`.perplexity`), and by position in the window
(:mod:`.positions`); what the learned groups hold, by word category (:mod:`.groups`,
:mod:`.categories`); which layers and heads retrieve from far back, ranked
(:mod:`.retrieval`), and an adapter calibrated for long inputs (:mod:`.calibration`). The
settings live in the torch-free :mod:`.settings`; each name is imported from its module on
first access (:mod:`focus_attention.utils.lazy`)."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            ".settings": (
                "DEFAULT_MAX_TOKENS",
                "DEFAULT_SEQ_LEN",
                "POSITION_BUCKETS",
                "CalibrateConfig",
                "EvalConfig",
                "InspectConfig",
                "RetrievalLayersConfig",
            ),
            ".groups": ("inspect_groups",),
            ".perplexity": (
                "EvalResult",
                "RoutingStats",
                "evaluate",
                "markdown_table",
                "score_windows",
            ),  # fmt: skip
            ".positions": ("PositionNLL", "bucket_bounds"),
            ".retrieval": ("rank_retrieval_layers", "retrieval_layers_table"),
        }
    ),
)
