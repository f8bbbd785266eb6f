"""``focus models list`` and ``focus models prepare NAME...``: the registered pretrained models
(:mod:`focus_attention.assets.model_registry`) and their offline cache
(:mod:`focus_attention.assets.models`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..assets.cache import dir_size, human_size, verify_entry
from ..assets.model_registry import DEFAULT_MODEL, list_models
from ..utils.io import focus_home
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config
from .settings import ModelsPrepareConfig


def _cmd_list(args: argparse.Namespace) -> int:
    """Print the registered models, the default marked ``*``, with state and sources."""
    print(f"models cache: {focus_home() / 'models'}")
    for row in list_models():
        mark = "*" if row["default"] else " "
        state = f"prepared, {human_size(row['size_bytes'])}" if row["prepared"] else "not prepared"
        print(f"{mark} {row['name']:<14} {state:<22} {row['description']}")
        print(f"  {'':<14} from PyPI: {', '.join(row['packages'])}; licence: {row['license']}")
    print("(* default; also accepted: a local model directory, a .gguf file or a hub id)")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Prepare each named model (default :data:`DEFAULT_MODEL`); print its path, size and
    time. With ``--verify``, exit 1 listing the problems when a file's sha256 differs."""
    config = command_config(args, ModelsPrepareConfig, "models.prepare")
    from ..assets.models import prepare_model  # torch and transformers: loaded to convert

    for name in args.names or [DEFAULT_MODEL]:
        t0 = time.monotonic()
        path = prepare_model(name, force=config.force)
        if config.verify:
            problems = verify_entry(path, full=True)
            if problems:
                for p in problems:
                    print(p, file=sys.stderr)
                return 1
        print(f"{name}: {path} ({human_size(dir_size(path))}, {time.monotonic() - t0:.1f} s)")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus models list`` and ``focus models prepare NAME... [--force] [--verify]``;
    a bare ``focus models`` prints its help and exits with status 2."""
    p = subparsers.add_parser("models", help=summary("models"))
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    ls = sub.add_parser("list", help="registered models and whether they are prepared")
    ls.set_defaults(func=run_guarded(_cmd_list))
    pr = sub.add_parser("prepare", help="fetch and convert models into the cache (idempotent)")
    pr.add_argument("names", nargs="*", metavar="NAME",
                    help=f"registered name, model directory, .gguf or hub id (default {DEFAULT_MODEL})")  # fmt: skip
    add_config_flag(pr, "models.prepare")
    add_flags(pr, ModelsPrepareConfig)
    pr.set_defaults(func=run_guarded(_cmd_prepare))
