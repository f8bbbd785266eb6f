"""The ``focus`` command. Each sub-command lives in its own module, which exposes
``register_cli(subparsers)`` and imports only settings modules (no torch, no transformers)
at registration; heavy imports happen only when a command runs. ``focus CMD ...`` imports
the module of ``CMD`` alone."""

from __future__ import annotations

import argparse
import importlib
import sys

from .common import COMMANDS

#: modules that contribute sub-commands, in the order ``--help`` lists them
COMMAND_MODULES = tuple(module for _, module, _ in COMMANDS)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``focus`` parser. With ``command`` (a sub-command's name) only that command's
    module is imported and registered; the others appear in ``--help`` by their one-line
    help (:data:`~focus_attention.cli.common.COMMANDS`) and cannot be parsed. Without it
    every command is registered."""
    parser = argparse.ArgumentParser(
        prog="focus",
        description="Focus: learned-grouping sparse attention for pretrained causal LMs.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, text in COMMANDS:
        if command is None or name == command:
            importlib.import_module(module).register_cli(sub)
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def command_of(argv: list[str]) -> str:
    """The sub-command named in ``argv`` (its first word that is not an option), or ``""``."""
    return next((word for word in argv if not word.startswith("-")), "")


def _version() -> str:
    from .. import __version__

    return f"focus-attention {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_of(argv))
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
