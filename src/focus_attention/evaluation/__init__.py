"""Evaluation of a Focus adapter against its base model (docs/method.md §9): perplexity on
held-out text with routing statistics (:mod:`.perplexity`), and by position in the window
(:mod:`.positions`)."""

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
    "PositionNLL",
    "RoutingStats",
    "bucket_bounds",
    "evaluate",
    "markdown_table",
    "score_windows",
]
