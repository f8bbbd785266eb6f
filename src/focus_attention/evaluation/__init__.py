"""Evaluation of a Focus adapter against its base model (docs/method.md §9): perplexity on
held-out text with routing statistics (:mod:`.perplexity`)."""

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

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEQ_LEN",
    "EvalConfig",
    "EvalResult",
    "RoutingStats",
    "evaluate",
    "markdown_table",
    "score_windows",
]
