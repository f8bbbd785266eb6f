"""``focus eval``: perplexity of a base model and its Focus adapter
(:func:`focus_attention.evaluation.evaluate`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..evaluation.perplexity import EvalConfig
from .common import run_guarded
from .flags import add_flags, flag_values


def _run(args: argparse.Namespace) -> int:
    from ..evaluation import evaluate, markdown_table

    result = evaluate(EvalConfig(**flag_values(args, EvalConfig)))
    print(markdown_table(result))
    print(f"\nbase weights SHA-256 unchanged: {result.base_weights_sha256['after']}")
    print(f"{result.seconds['total']:.0f} s" + (f"; JSON: {args.json}" if args.json else ""))
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus eval``: flags from :class:`EvalConfig`."""
    p = subparsers.add_parser(
        "eval",
        help="perplexity of the base model and a Focus adapter (soft and every top-k)",
        description="Token-weighted perplexity over non-overlapping --seq-len windows (each "
        "window scored independently; all tokens but the first of each window count) of the "
        "base model, Focus soft routing and Focus top-k routing for every top_k in 1..K, with "
        "pairs retained, dominance and group shares; checks that the base weights' SHA-256 "
        "is unchanged.",
    )
    add_flags(p, EvalConfig)
    p.set_defaults(func=run_guarded(_run))
