"""``focus lm-eval ARGS``: lm-evaluation-harness's own command line with the ``focus`` model
registered and the local zero-shot tasks on its include path
(:func:`focus_attention.bench.harness.main`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..assets.benchmarks import BENCHMARKS
from .common import run_guarded, summary

#: printed above lm-eval's own help (``focus lm-eval --help``, or no arguments)
PREAMBLE = "\n".join([
    "focus lm-eval: lm-eval's command line (its help follows), with",
    "  --model focus   a model with a Focus adapter; --model_args pretrained=MODEL (a registered",
    "                  name such as smollm2-135m, a model directory or a hub id), adapter=DIR",
    "                  (a Focus adapter or a focus train run), top_k=N and window=N (over the",
    "                  adapter's), device (cpu, cuda...), and HFLM's and transformers' loading",
    "                  arguments (batch_size, max_length, dtype, revision, ...); device and",
    "                  batch_size given here win over lm-eval's --device and --batch_size",
    "  local tasks     on the include path, reading the prepared data:",
    f"                  {', '.join(BENCHMARKS)}",
    "example:",
    "  focus lm-eval run --model focus --tasks arc_easy --limit 20 \\",
    "      --model_args pretrained=smollm2-135m,adapter=runs/austen",
    "",
])  # fmt: skip


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    """Run lm-eval's command line on ``args.arguments`` (needs the bench extra). With
    ``--help`` (or ``-h``) :data:`PREAMBLE` comes first; without arguments the preamble and
    lm-eval's help are printed and the exit status is 2."""
    from ..bench.tasks import load_harness

    arguments = list(args.arguments)
    harness = load_harness()
    if not arguments or any(a in ("-h", "--help") for a in arguments):
        print(PREAMBLE, flush=True)
    harness.main(arguments)
    if not arguments:
        print("focus: error: no arguments; expected lm-eval's (see above)", file=sys.stderr)
        return 2
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus lm-eval ARGS...`` (every argument goes to lm-eval, ``--help`` included)."""
    p = subparsers.add_parser(
        "lm-eval",
        add_help=False,
        help=summary("lm-eval"),
        description="lm_eval ARGS with --model focus available (model_args: pretrained, "
        "adapter, top_k, window, device and HFLM's) and the local zero-shot tasks on the include path.",
    )
    p.set_defaults(func=run_guarded(_cmd_lm_eval), passthrough=True, arguments=[])
