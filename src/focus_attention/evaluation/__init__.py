"""Evaluation of a Focus adapter against its base model (docs/method.md §9): perplexity on
held-out text with routing statistics (:mod:`.perplexity`), and by position in the window
(:mod:`.positions`); what the learned groups hold, by word category (:mod:`.groups`,
:mod:`.categories`)."""

from .groups import InspectConfig, inspect_groups
from .perplexity import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEQ_LEN,
    EvalConfig,
    EvalResult,
    RoutingStats,
    evaluate,
    markdown_table,
    score_windows,
)
from .positions import POSITION_BUCKETS, PositionNLL, bucket_bounds

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEQ_LEN",
    "POSITION_BUCKETS",
    "EvalConfig",
    "EvalResult",
    "InspectConfig",
    "PositionNLL",
    "RoutingStats",
    "bucket_bounds",
    "evaluate",
    "inspect_groups",
    "markdown_table",
    "score_windows",
]
