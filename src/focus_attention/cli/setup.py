"""``focus setup``: prepare models, corpora and (with ``--benchmarks``) the benchmark data (the
zero-shot sets, RULER's offline haystack and sentence splitter) into the offline cache in one go (by default the default model and corpus), then print a
summary. Idempotent: a prepared entry costs one manifest read."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..assets.benchmarks import BENCHMARK_DATA, prepare_benchmarks
from ..assets.cache import dir_size, human_size
from ..assets.corpora import DEFAULT_CORPUS, prepare_corpus
from ..assets.model_registry import DEFAULT_MODEL
from ..assets.ruler import RULER_DATA, prepare_ruler_data
from ..utils.io import focus_home
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config
from .settings import SetupConfig


def _cmd_setup(args: argparse.Namespace) -> int:
    """Prepare ``--model`` (default :data:`DEFAULT_MODEL`), ``--corpus`` (default
    :data:`DEFAULT_CORPUS`) and, with ``--benchmarks``, the benchmark data, printing each as
    it is ready and a summary table at the end."""
    from ..assets.models import prepare_model  # torch and transformers: loaded to convert

    config = command_config(args, SetupConfig, "setup")
    models, corpora = config.model, config.corpus
    print(f"focus setup: cache {focus_home()} (set FOCUS_HOME to change)", flush=True)
    rows = []
    steps = [("model", models, prepare_model), ("corpus", corpora, prepare_corpus)]
    if config.benchmarks:
        steps.append(("data", [BENCHMARK_DATA], lambda _name, force: prepare_benchmarks(force=force)))  # fmt: skip
        steps.append(("data", [RULER_DATA], lambda _name, force: prepare_ruler_data(force=force)))  # fmt: skip
    for kind, names, prep in steps:
        for name in names:
            t0 = time.monotonic()
            path = prep(name, force=config.force)
            dt = time.monotonic() - t0
            rows.append((kind, name, path, dir_size(path), dt))
            print(f"  {kind} {name}: ready ({human_size(rows[-1][3])}, {dt:.1f} s)", flush=True)
    print("summary:")
    for kind, name, path, size, dt in rows:
        print(f"  {kind:<6} {name:<14} {human_size(size):>10} {dt:7.1f} s  {path}")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus setup [--model M...] [--corpus C...] [--force]``."""
    s = subparsers.add_parser(
        "setup",
        help=summary("setup"),
        description=f"Prepare models and corpora into the cache (FOCUS_HOME). Without options: "
        f"model {DEFAULT_MODEL} and corpus {DEFAULT_CORPUS}.",
    )
    add_config_flag(s, "setup")
    add_flags(s, SetupConfig)
    s.set_defaults(func=run_guarded(_cmd_setup))
