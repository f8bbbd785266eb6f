"""``focus sweep``: an ablation grid, each cell trained and evaluated
(:func:`focus_attention.training.sweep.run_sweep`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..training.sweep import SweepConfig
from .common import run_guarded
from .flags import add_flags, flag_values


def _run(args: argparse.Namespace) -> int:
    from ..training.sweep import run_sweep, sweep_markdown

    config = SweepConfig(**flag_values(args, SweepConfig))
    if config.grid is None:
        raise ValueError("--grid FILE is required (a TOML grid file, see configs/sweeps/)")
    summary = run_sweep(config)
    print(sweep_markdown(summary))
    print(f"\nresults: {config.out_dir()}/sweep.json, sweep.md, ppl_vs_pairs.png, dominance.png")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus sweep``: flags from :class:`SweepConfig`."""
    p = subparsers.add_parser(
        "sweep",
        help="ablation grid: train and evaluate every cell, one table and plots",
        description="Train and evaluate every cell of a grid file (the [train], [train.focus] "
        "and [eval] tables of focus train/eval --config, plus [grid] lists whose cartesian "
        "product are the cells, and [[cells]] tables) with the same budget and seed, into "
        "OUT/cells/<slug>/, each evaluated with [eval] or once per named [[evals]] table. "
        "Finished cells and evaluations are skipped, interrupted trainings resume. Writes "
        "OUT/sweep.json, sweep.md, ppl_vs_pairs.png and dominance.png.",
    )
    add_flags(p, SweepConfig)
    p.set_defaults(func=run_guarded(_run))
