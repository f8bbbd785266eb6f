"""``focus sweep``: an ablation grid, each cell trained and evaluated
(:func:`focus_attention.experiments.grid.run_sweep`), or a study of ``experiments/`` run step
by step (``--study DIR``, :func:`focus_attention.experiments.run_study`); one of ``--grid``
and ``--study`` is required, and the flags of one are refused with the other."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..experiments.settings import StudyConfig, SweepConfig
from .common import run_guarded
from .flags import add_flags, flag_fields, flag_name, flag_values


def _run_study(study: StudyConfig) -> int:
    from ..experiments import run_study
    from . import build_parser, main

    plan = run_study(study, build_parser(), main)
    if study.dry_run:
        print("\n".join(f"{name}: {status}" for name, status in plan.items()))
    return 0


def _refuse_others(given: dict[str, Any], mode: str) -> None:
    """Refuse the flags in ``given`` (those of the other mode) with ``mode`` (``--grid`` or
    ``--study``).

    Raises:
        ValueError: naming the flags.
    """
    if not given:
        return
    flags = ", ".join(flag_name(name) for name in given)
    if mode == "--study":
        raise ValueError(f"{flags}: for --grid only; a study writes its results where its "
                         "config.toml says ({results}, and {runs} from --runs)")  # fmt: skip
    raise ValueError(f"{flags}: for --study only, not with --grid")


def _grid_file(grid: str) -> None:
    """Raises FileNotFoundError naming ``--grid`` when ``grid`` is no file."""
    path = Path(grid)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise FileNotFoundError(f"--grid {grid}: {what}; expected a TOML grid file ([train], "
                                "[eval], [grid], [[cells]], [[evals]] tables)")  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from ..experiments.grid import run_sweep, sweep_markdown

    grid = flag_values(args, SweepConfig)
    study = flag_values(args, StudyConfig)
    if study.get("study") is not None:
        _refuse_others({k: v for k, v in grid.items() if k != "grid"}, "--study")
        return _run_study(StudyConfig(**study))
    if grid.get("grid") is None:
        raise ValueError("--grid FILE or --study DIR is required (a TOML grid file, or a "
                         "study directory of experiments/)")  # fmt: skip
    _refuse_others(study, "--grid")
    config = SweepConfig(**grid)
    _grid_file(str(config.grid))
    summary = run_sweep(config)
    print(sweep_markdown(summary))
    print(f"\nresults: {config.out_dir()}/sweep.json, sweep.md, ppl_vs_pairs.png, dominance.png")
    return 0


def _all_but(cls: type, name: str) -> list[str]:
    return [f.name for f in flag_fields(cls) if f.name != name]


def register_cli(subparsers: Any) -> None:
    """Add ``focus sweep``: flags from :class:`SweepConfig` and :class:`StudyConfig`, with
    ``--grid`` and ``--study`` a required pair of which one is given."""
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
        "skipping each step whose result records the same settings and keeping each result "
        "that has no settings record (--rerun STEP recomputes it); a step whose result "
        "records an unfinished run, or that stopped before its result was recorded, runs "
        "again (an interrupted training resumes). One of --grid and --study is required.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    add_flags(which, SweepConfig, exclude=_all_but(SweepConfig, "grid"))
    add_flags(which, StudyConfig, exclude=_all_but(StudyConfig, "study"))
    add_flags(p, SweepConfig, exclude=("grid",))
    add_flags(p, StudyConfig, exclude=("study",))
    p.set_defaults(func=run_guarded(_run))
