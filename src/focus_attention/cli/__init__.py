"""The ``focus`` command. Each sub-command lives in its own module, which exposes
``register_cli(subparsers)``; heavy imports happen only when a command runs."""

from __future__ import annotations

import argparse
import importlib
import sys

#: modules that contribute sub-commands, in the order ``--help`` lists them
COMMAND_MODULES = (
    "focus_attention.cli.data",
    "focus_attention.cli.setup",
    "focus_attention.cli.models",
    "focus_attention.cli.train",
    "focus_attention.cli.pretrain",
    "focus_attention.cli.eval",
    "focus_attention.cli.calibrate",
    "focus_attention.cli.inspect",
    "focus_attention.cli.sweep",
    "focus_attention.cli.bench",
    "focus_attention.cli.harness",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="focus",
        description="Focus: learned-grouping sparse attention for pretrained causal LMs.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register_cli(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return f"focus-attention {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # only a command that hands its arguments on (focus lm-eval) takes unknown ones
        if not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.arguments = [*args.arguments, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
