"""``focus lm-eval ARGS``: lm-evaluation-harness's own command line with the ``focus`` model
registered and the local zero-shot tasks on its include path
(:func:`focus_attention.bench.harness.main`)."""

from __future__ import annotations

import argparse
from typing import Any

from .common import run_guarded, summary


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    """Run lm-eval's command line on ``args.arguments`` (needs the bench extra)."""
    from ..bench.tasks import load_harness

    load_harness().main(args.arguments)
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus lm-eval ARGS...`` (every argument goes to lm-eval, ``--help`` included)."""
    p = subparsers.add_parser(
        "lm-eval",
        add_help=False,
        help=summary("lm-eval"),
        description="lm_eval ARGS with --model focus available (model_args: pretrained, "
        "adapter, top_k, window and HFLM's) and the local zero-shot tasks on the include path.",
    )
    p.set_defaults(func=run_guarded(_cmd_lm_eval), passthrough=True, arguments=[])
