"""``focus sweep``: an ablation grid, each cell trained and evaluated
(:func:`focus_attention.training.sweep.run_sweep`), or a study of ``experiments/`` run step
by step (``--study DIR``, :func:`focus_attention.experiments.run_study`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..experiments.runner import StudyConfig
from ..training.sweep import SweepConfig
from .common import run_guarded
from .flags import add_flags, flag_values


def _run_study(study: StudyConfig) -> int:
    from ..experiments import run_study
    from . import build_parser, main

    plan = run_study(study, build_parser(), main)
    if study.dry_run:
        print("\n".join(f"{name}: {status}" for name, status in plan.items()))
    return 0


def _run(args: argparse.Namespace) -> int:
    from ..training.sweep import run_sweep, sweep_markdown

    config = SweepConfig(**flag_values(args, SweepConfig))
    study = StudyConfig(**flag_values(args, StudyConfig))
    if study.study is not None:
        if config.grid is not None:
            raise ValueError("give --grid FILE or --study DIR, not both")
        return _run_study(study)
    if config.grid is None:
        raise ValueError("--grid FILE or --study DIR is required (a TOML grid file, or a "
                         "study directory of experiments/)")  # fmt: skip
    summary = run_sweep(config)
    print(sweep_markdown(summary))
    print(f"\nresults: {config.out_dir()}/sweep.json, sweep.md, ppl_vs_pairs.png, dominance.png")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus sweep``: flags from :class:`SweepConfig`."""
    p = subparsers.add_parser(
        "sweep",
        help="ablation grid (--grid) or study (--study): run every step not yet done",
        description="Train and evaluate every cell of a grid file (the [train], [train.focus] "
        "and [eval] tables of focus train/eval --config, plus [grid] lists whose cartesian "
        "product are the cells, and [[cells]] tables) with the same budget and seed, into "
        "OUT/cells/<slug>/, each evaluated with [eval] or once per named [[evals]] table. "
        "Finished cells and evaluations are skipped, interrupted trainings resume. Writes "
        "OUT/sweep.json, sweep.md, ppl_vs_pairs.png and dominance.png. With --study DIR: run "
        "the steps of DIR/config.toml in order (focus sub-commands, scripts, the report), "
        "skipping each step whose result records the same settings.",
    )
    add_flags(p, SweepConfig)
    add_flags(p, StudyConfig)
    p.set_defaults(func=run_guarded(_run))
