"""Ablation sweeps (docs/method.md §6 and §9): a grid of training settings, each cell trained and
evaluated with the same budget and seed, then one table and plots over all cells.

A grid file is TOML: the ``[train]`` table (Focus settings in ``[train.focus]``) and the
``[eval]`` table of ``focus train --config`` / ``focus eval --config`` give the settings every
cell shares; ``[grid]`` maps setting names (fields of :class:`~.config.TrainConfig` or
:class:`~focus_attention.hf.FocusConfig`) to lists of values, whose cartesian product are the
cells; ``[[cells]]`` tables add explicit cells. Cell ``<slug>`` trains into
``OUT/cells/<slug>/`` and is evaluated there (``eval.json``); ``cell.json`` marks it finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..hf.config import FocusConfig
from ..utils.checks import bad, check_int
from ..utils.io import atomic_write_text, write_json_atomic
from .config import TrainConfig

__all__ = [
    "CELL_FILE",
    "GRID_KEYS",
    "SweepConfig",
    "SweepPlan",
    "expand_grid",
    "load_plan",
    "run_sweep",
    "sweep_markdown",
]

#: the file that marks a finished cell (its row of the results)
CELL_FILE = "cell.json"
#: the evaluation result of a cell (``focus eval``'s JSON)
EVAL_FILE = "eval.json"
#: settings a grid may not vary: where and how a cell runs, not what it trains
NOT_GRID_KEYS = ("out", "resume", "overwrite", "threads", "progress", "routing", "layers")
#: the settings a grid may vary: the fields of TrainConfig and FocusConfig
GRID_KEYS = tuple(
    sorted(
        (
            {f.name for f in dataclasses.fields(TrainConfig)}
            | {f.name for f in dataclasses.fields(FocusConfig)}
        )
        - {"focus", "seed", *NOT_GRID_KEYS}
    )
)
FOCUS_KEYS = frozenset(f.name for f in dataclasses.fields(FocusConfig))


@dataclass
class SweepConfig:
    """Settings of one sweep; every field is a ``focus sweep`` flag.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    grid: str | None = field(
        default=None,
        metadata={
            "help": "grid file (TOML: [train], [train.focus], [eval], [grid]; required)",
            "metavar": "FILE",
        },
    )
    out: str | None = field(
        default=None, metadata={"help": "output directory (default: runs/sweep-<grid name>)"}
    )
    jobs: int = field(default=1, metadata={"help": "cells run at once, in separate processes"})
    threads: int | None = field(
        default=None,
        metadata={"help": "torch threads in all, split evenly over --jobs (default: the "
                  "cells' own [train]/[eval] threads, else torch's choice)"},
    )  # fmt: skip
    progress: bool = field(
        default=True,
        metadata={"help": "messages per cell; --no-progress also silences the cells' bars "
                  "(else the grid file's [train]/[eval] progress decides)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_int("SweepConfig", "jobs", self.jobs, 1)
        check_int("SweepConfig", "threads", self.threads, 1, optional=True)

    def out_dir(self) -> Path:
        """``out``, or ``runs/sweep-<grid file stem>``."""
        if self.out is not None:
            return Path(self.out)
        return Path("runs") / f"sweep-{Path(str(self.grid)).stem}"

    def cell_threads(self) -> int | None:
        """Torch threads of each cell: ``threads // jobs`` (at least 1), or None."""
        return None if self.threads is None else max(1, self.threads // self.jobs)


@dataclass
class SweepPlan:
    """A grid file read and checked: the shared ``train`` settings (a dict of
    :class:`TrainConfig` fields, ``focus`` a dict of :class:`FocusConfig` fields), the shared
    ``eval`` settings (:class:`~focus_attention.evaluation.EvalConfig` fields) and the
    ``cells``: ``{slug: {setting: value}}`` in grid order."""

    train: dict[str, Any]
    eval: dict[str, Any]
    cells: dict[str, dict[str, Any]]
    source: str = ""

    def train_config(self, slug: str, out: Path, **run: Any) -> TrainConfig:
        """The :class:`TrainConfig` of cell ``slug``, trained into ``out`` (``run``: the
        fields ``threads``, ``progress``, ``resume``, ``overwrite``).

        Raises:
            ValueError: invalid settings (the message names the file and the cell).
        """
        train = {k: v for k, v in self.train.items() if k != "focus"}
        focus = dict(self.train.get("focus", {}))
        for key, value in self.cells[slug].items():
            (focus if key in FOCUS_KEYS else train)[key] = value
        train.update({k: v for k, v in run.items() if v is not None}, out=str(out))
        try:
            return TrainConfig.from_dict({**train, "focus": focus})
        except ValueError as err:
            raise ValueError(f"{self.source}: cell {slug}: {err}") from err

    def eval_config(self, slug: str, cell_dir: Path, **run: Any) -> Any:
        """The :class:`~focus_attention.evaluation.EvalConfig` of cell ``slug``: the shared
        ``[eval]`` settings, the cell's adapter (``cell_dir``), its model and corpus, and
        ``eval.json`` / ``eval.md`` there (``run``: ``threads``, ``progress``).

        Raises:
            ValueError: invalid settings (the message names the file).
        """
        from ..evaluation.perplexity import EvalConfig

        train = self.train_config(slug, cell_dir)
        settings = {"model": train.model, "corpus": train.corpus, **self.eval}
        settings.update({k: v for k, v in run.items() if v is not None})
        settings.update(adapter=str(cell_dir), json=str(cell_dir / EVAL_FILE),
                        markdown=str(cell_dir / "eval.md"))  # fmt: skip
        try:
            return EvalConfig.from_dict(settings)
        except ValueError as err:
            raise ValueError(f"{self.source}: [eval]: {err}") from err


def _slug_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return "+".join(_slug_value(v) for v in value)
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(value)).strip("-") or "none"


def cell_slug(settings: dict[str, Any]) -> str:
    """The directory name of a cell: ``key-value`` pairs joined by ``_`` in the grid's key
    order (``{"num_groups": 4, "window": 64}`` -> ``num_groups-4_window-64``); ``base``
    for a cell that changes nothing."""
    return "_".join(f"{k}-{_slug_value(v)}" for k, v in settings.items()) or "base"


def _check_key(key: str, where: str) -> None:
    if key not in GRID_KEYS:
        raise ValueError(
            f"{where}: unknown setting {key!r}; a grid varies fields of TrainConfig or "
            f"FocusConfig: {', '.join(GRID_KEYS)}"
        )


def expand_grid(
    grid: dict[str, Any], cells: list[dict[str, Any]] | None = None, *, where: str = "grid"
) -> dict[str, dict[str, Any]]:
    """The cells of a grid: the cartesian product of ``grid``'s lists (in key order, the
    last key varying fastest), then the explicit ``cells``; duplicates are dropped.

    Args:
        grid: ``{setting: [values]}``; a single value counts as a one-value list.
        cells: explicit cells, each ``{setting: value}``.
        where: the file named in error messages.

    Returns:
        ``{slug: {setting: value}}`` (see :func:`cell_slug`).

    Raises:
        ValueError: a setting that is not a grid key (:data:`GRID_KEYS`), an empty list,
            no cells at all.
    """
    axes = []
    for key, values in grid.items():
        _check_key(key, f"{where} [grid]")
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ValueError(f"{where} [grid]: {key} is an empty list; give at least one value")
        axes.append([(key, v) for v in values])
    combos = [dict(c) for c in itertools.product(*axes)] if axes else []
    for i, cell in enumerate(cells or []):
        if not isinstance(cell, dict):
            raise ValueError(f"{where} [[cells]] #{i + 1}: expected a table, got {cell!r}")
        for key in cell:
            _check_key(key, f"{where} [[cells]] #{i + 1}")
        combos.append(dict(cell))
    if not combos:
        raise ValueError(f"{where}: no cells: give a [grid] table of lists or [[cells]] tables")
    return {cell_slug(c): c for c in combos}


def load_plan(path: str | os.PathLike[str]) -> SweepPlan:
    """Read and check a grid file (module docstring); every cell's :class:`TrainConfig`
    and the evaluation settings are validated before anything runs.

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid TOML, unknown tables or settings, empty lists, invalid values
            (the message names the file and the cell).
    """
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    where = str(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{where}: not a valid TOML grid file ({err})") from err
    unknown = sorted(set(data) - {"train", "eval", "grid", "cells"})
    if unknown:
        raise ValueError(f"{where}: unknown tables {unknown}; expected [train], [eval], "
                         "[grid] and [[cells]]")  # fmt: skip
    for key in ("train", "eval", "grid"):
        if not isinstance(data.get(key, {}), dict):
            raise ValueError(f"{where}: [{key}] must be a table")
    cells = expand_grid(data.get("grid", {}), data.get("cells"), where=where)
    plan = SweepPlan(dict(data.get("train", {})), dict(data.get("eval", {})), cells, where)
    for slug in cells:
        plan.train_config(slug, Path("cell"))
        plan.eval_config(slug, Path("cell"))
    return plan


#: evaluation settings that do not change the results (compared when a cell is reused)
EVAL_FREE_FIELDS = ("threads", "progress", "json", "markdown")


def _eval_settings(ev_cfg: Any) -> dict[str, Any]:
    """The evaluation settings that decide a cell's results, as JSON values."""
    import json

    d = dataclasses.asdict(ev_cfg)
    return json.loads(json.dumps({k: v for k, v in d.items() if k not in EVAL_FREE_FIELDS}))


def _cell_row(cfg: TrainConfig, ev_cfg: Any, train_seconds: float) -> dict:
    """The results row of a finished cell from its ``eval.json`` and ``log.jsonl``."""
    import json

    from .checkpoint import LOG_NAME, read_log

    cell_dir = cfg.out_dir()
    ev = json.loads((cell_dir / EVAL_FILE).read_text())
    log = [r for r in read_log(cell_dir / LOG_NAME) if "dominance" in r]
    return {
        "dir": str(cell_dir),
        "focus": ev["config"]["focus"],
        "ppl": ev["ppl"],
        "pairs_retained": ev["pairs_retained"],
        "dominance": ev["dominance"],
        "train_dominance": {
            k: log[-1][k]
            for k in ("dominance", "dominance_max", "dominance_topk")
            if log and k in log[-1]
        },  # fmt: skip
        "train_seconds": train_seconds,
        "eval_tokens": ev["tokens"],
        "train_config": cfg.to_dict(),
        "eval_config": _eval_settings(ev_cfg),
    }


def _check_unchanged(row: dict[str, Any], cfg: TrainConfig, ev_cfg: Any) -> None:
    """Refuse to reuse a finished cell whose settings differ from the grid file's now.

    Raises:
        ValueError: naming the settings that changed.
    """
    changed = sorted(TrainConfig.from_dict(row["train_config"]).locked_differences(cfg))
    then, now = row["eval_config"], _eval_settings(ev_cfg)
    changed += sorted(f"eval.{k}" for k in set(then) | set(now) if then.get(k) != now.get(k))
    if changed:
        raise ValueError(
            f"{row['dir']} was trained and evaluated with other settings ({', '.join(changed)} "
            "changed): use another --out, or delete the cell to run it again"
        )


def run_cell(plan: SweepPlan, slug: str, out: str, threads: int | None, progress: bool) -> dict:
    """Train and evaluate cell ``slug`` in ``out/cells/<slug>`` (unless its ``cell.json``
    exists); an interrupted training resumes from its newest checkpoint. Returns the cell's
    row (``cell.json``: settings, perplexities, pairs retained, dominance, train seconds,
    the training and evaluation settings).

    Raises:
        ValueError: a finished cell whose settings differ from the grid's now; what
            :func:`~.loop.train` and :func:`~focus_attention.evaluation.evaluate` raise.
    """
    import json

    from ..evaluation.perplexity import evaluate
    from .checkpoint import latest_checkpoint
    from .loop import train

    cell_dir = Path(out) / "cells" / slug
    resume = latest_checkpoint(cell_dir) is not None
    quiet = None if progress else False  # None: the grid file's own progress setting
    cfg = plan.train_config(slug, cell_dir, threads=threads, progress=quiet,
                            resume=resume, overwrite=not resume)  # fmt: skip
    ev_cfg = plan.eval_config(slug, cell_dir, threads=threads, progress=quiet)
    if (cell_dir / CELL_FILE).is_file():
        row = json.loads((cell_dir / CELL_FILE).read_text())
        _check_unchanged(row, cfg, ev_cfg)
        return row
    if progress:
        print(f"focus sweep: cell {slug}: {'resuming' if resume else 'training'}", file=sys.stderr)
    result = train(cfg)
    evaluate(ev_cfg)
    row = {"slug": slug, "settings": plan.cells[slug]}
    row.update(_cell_row(cfg, ev_cfg, float(result.train_seconds)))
    write_json_atomic(cell_dir / CELL_FILE, row)
    return row


def _run_cells(plan: SweepPlan, cfg: SweepConfig) -> list[dict]:
    """Every cell's row, in grid order: in this process, or in ``cfg.jobs`` processes."""
    out, threads = str(cfg.out_dir()), cfg.cell_threads()
    slugs = list(plan.cells)
    if cfg.jobs == 1:
        return [run_cell(plan, s, out, threads, cfg.progress) for s in slugs]
    progress = False  # the bars of parallel cells would overwrite each other
    import multiprocessing

    # spawn: a forked child would inherit torch's thread pools in an undefined state
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=cfg.jobs, mp_context=ctx) as pool:
        futures = [pool.submit(run_cell, plan, s, out, threads, progress) for s in slugs]
        return [f.result() for f in futures]


def run_sweep(config: SweepConfig) -> dict[str, Any]:
    """Run a sweep (module docstring): every unfinished cell is trained and evaluated, then
    ``sweep.json``, ``sweep.md``, ``ppl_vs_pairs.png`` and ``dominance.png`` are written
    into ``config.out_dir()``.

    Returns:
        the content of ``sweep.json``: ``grid`` (the file), ``train`` / ``eval`` (shared
        settings), ``cells`` (one row per cell, see :func:`run_cell`), ``versions``,
        ``environment``.

    Raises:
        ValueError: ``grid`` not given, or an invalid grid file (:func:`load_plan`).
        FileNotFoundError: no such grid file; what training and evaluation raise.
    """
    from ..utils.env import environment, library_versions
    from .sweep_plot import write_sweep_plots

    if config.grid is None:
        raise bad("SweepConfig", "grid", None, "a grid file (TOML)")
    plan = load_plan(config.grid)
    out = config.out_dir()
    out.mkdir(parents=True, exist_ok=True)
    rows = _run_cells(plan, config)
    summary = {
        "grid": str(config.grid),
        "train": plan.train,
        "eval": plan.eval,
        "cells": rows,
        "versions": library_versions(),
        "environment": environment(),
    }
    write_json_atomic(out / "sweep.json", summary)
    atomic_write_text(out / "sweep.md", sweep_markdown(summary) + "\n")
    write_sweep_plots(rows, out)
    return summary


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_markdown(summary: dict[str, Any]) -> str:
    """The sweep as one markdown table: one row per cell and evaluated ``top_k`` (the varied
    settings, PPL and its change against the base model, pairs retained, evaluation
    dominance of the top-k routing, dominance of the soft routing at the last training
    step, training seconds)."""
    rows = summary["cells"]
    keys = list(dict.fromkeys(k for r in rows for k in r["settings"]))
    head = [*keys, "top_k", "PPL", "vs base", "pairs retained", "dominance (eval)",
            "dominance (end of training)", "train s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        base = r["ppl"]["base"]
        cells = [str(r["settings"].get(k, "-")) for k in keys]
        dom_train = _fmt(r["train_dominance"].get("dominance"), ".3f")
        for k, ppl in r["ppl"]["focus_topk"].items():
            vals = [k, f"{ppl:.3f}", f"{100 * (ppl / base - 1):+.1f}%",
                    f"{100 * r['pairs_retained'][k]:.1f}%",
                    _fmt(r["dominance"]["topk"].get(k), ".3f"), dom_train,
                    f"{r['train_seconds']:.1f}"]  # fmt: skip
            lines.append("| " + " | ".join(cells + vals) + " |")
    base = rows[0]["ppl"]["base"] if rows else None
    return (f"Sweep `{summary['grid']}`: {len(rows)} cells; base model (dense) PPL "
            f"{_fmt(base, '.3f')}.\n\n" + "\n".join(lines))  # fmt: skip
