"""``focus data list`` and ``focus data prepare NAME...``: the registered text corpora and
their offline cache (:mod:`focus_attention.assets.corpora`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..assets.cache import dir_size, human_size
from ..assets.corpora import DEFAULT_CORPUS, SPLITS, list_corpora, prepare_corpus
from ..utils.io import focus_home
from .common import run_guarded


def _cmd_list(args: argparse.Namespace) -> int:
    """Print the registered corpora, the default marked ``*``, with state, documents per
    split, source package and split rule."""
    print(f"corpora cache: {focus_home() / 'corpora'}")
    for row in list_corpora():
        mark = "*" if row["default"] else " "
        if row["prepared"]:
            docs = "/".join(str(row["documents"].get(s, 0)) for s in SPLITS)
            state = f"prepared, {human_size(row['size_bytes'])}, docs {docs}"
        else:
            state = "not prepared"
        print(f"{mark} {row['name']:<11} {state:<40} {row['description']}")
        print(f"  {'':<11} from Debian: {row['package']}; split {row['split_rule']}")
    print("(* default; docs = train/validation/test; any local text file or folder also works)")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Prepare each named corpus (default :data:`DEFAULT_CORPUS`); print its path, size and
    time."""
    for name in args.names or [DEFAULT_CORPUS]:
        t0 = time.monotonic()
        path = prepare_corpus(name, force=args.force)
        print(f"{name}: {path} ({human_size(dir_size(path))}, {time.monotonic() - t0:.1f} s)")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus data list`` and ``focus data prepare NAME... [--force]``; a bare
    ``focus data`` prints its help and exits with status 2."""
    p = subparsers.add_parser("data", help="list and prepare text corpora (offline cache)")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    ls = sub.add_parser("list", help="registered corpora and whether they are prepared")
    ls.set_defaults(func=run_guarded(_cmd_list))
    pr = sub.add_parser("prepare", help="fetch and split corpora into the cache (idempotent)")
    pr.add_argument("names", nargs="*", metavar="NAME",
                    help=f"registered name or local text file/folder (default {DEFAULT_CORPUS})")  # fmt: skip
    pr.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    pr.set_defaults(func=run_guarded(_cmd_prepare))
