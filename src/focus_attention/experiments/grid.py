"""Ablation grids, the runner of ``focus sweep --grid`` (docs/method.md §6 and §9): a grid of
training settings, each cell trained and evaluated with the same budget and seed, then one
table and plots over all cells (:mod:`.grid_plot`; the settings are
:class:`~.settings.SweepConfig`).

A grid file is TOML: the ``[train]`` table (Focus settings in ``[train.focus]``) and the
``[eval]`` table of ``focus train --config`` / ``focus eval --config`` give the settings every
cell shares; ``[grid]`` maps setting names (fields of
:class:`~focus_attention.training.config.TrainConfig` or
:class:`~focus_attention.hf.FocusConfig`) to lists of values, whose cartesian product are the
cells; ``[[cells]]`` tables add explicit cells (``name`` sets the cell's directory name instead
of the slug of its settings). Without ``[[evals]]`` every cell is evaluated once with the
``[eval]`` settings (``eval.json``); each ``[[evals]]`` table is one more named evaluation:
``name``, optionally ``cells`` (the cells it applies to, default all) and
:class:`~focus_attention.evaluation.EvalConfig` fields that override ``[eval]``
(``eval-<name>.json``). Cell ``<slug>`` trains into ``OUT/cells/<slug>/`` and is evaluated
there; ``cell.json`` holds its row (written after training, completed after each evaluation).
A sweep holds the lock ``OUT/.focus-sweep.lock`` while it runs (a second sweep into the same
folder refuses, naming the first), and each cell's training the lock of its folder; a
``cell.json`` or evaluation result read back is checked for its shape
(:data:`CELL_SHAPE`, :data:`EVAL_RESULT_SHAPE`) and named when it is damaged.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
import re
import sys
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..evaluation.perplexity import evaluate
from ..evaluation.settings import EvalConfig
from ..hf.config import FocusConfig
from ..training.config import TrainConfig
from ..training.outputs import LOG_NAME, latest_checkpoint, read_log
from ..training.run import train
from ..utils.checks import bad
from ..utils.env import environment, library_versions
from ..utils.io import (
    NUMBER,
    atomic_write_text,
    check_shape,
    exclusive_lock,
    read_json_record,
    read_toml,
    write_json_atomic,
)
from .grid_plot import write_pairs_plot, write_sweep_plots
from .settings import SweepConfig

__all__ = [
    "CELL_FILE",
    "GRID_KEYS",
    "SweepConfig",
    "SweepPlan",
    "eval_files",
    "expand_grid",
    "sweep_points",
    "load_plan",
    "plot_sweep_result",
    "read_cell",
    "read_eval_result",
    "run_sweep",
    "sweep_markdown",
    "sweep_report",
]

#: the row of a cell: written when its training ends, completed after each evaluation
CELL_FILE = "cell.json"
#: the lock a sweep holds on its output folder while it runs
LOCK_NAME = ".focus-sweep.lock"
#: what the sweep reads of an evaluation's result (``focus eval``'s JSON)
EVAL_RESULT_SHAPE = {"ppl": {"base": NUMBER, "focus_topk?": {"*": NUMBER}},
                     "pairs_retained": {"*": NUMBER}, "dominance": dict, "tokens": NUMBER}  # fmt: skip
#: what the sweep reads of a cell's row (:func:`run_cell`), after :func:`_upgrade_row`
CELL_SHAPE = {"dir": str, "train_config": dict, "train_seconds?": NUMBER,
              "evals": {"*": {"eval_config": dict, "ppl": dict, "pairs_retained": dict}}}  # fmt: skip
CELL_EXPECTED = "the JSON row of a focus sweep cell (written by focus sweep --grid)"
#: the evaluation result of a cell (``focus eval``'s JSON) when the grid has no ``[[evals]]``
EVAL_FILE = "eval.json"
#: the name of the one evaluation of a grid without ``[[evals]]``
DEFAULT_EVAL = "eval"
#: a cell or evaluation name: a directory / file name without separators
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
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
class SweepEval:
    """One named evaluation of a sweep: ``settings`` (:class:`~focus_attention.evaluation.
    EvalConfig` fields over the grid's ``[eval]``) and the ``cells`` it applies to (None:
    every cell)."""

    name: str
    settings: dict[str, Any]
    cells: tuple[str, ...] | None = None


def eval_files(name: str) -> tuple[str, str]:
    """The JSON and markdown file names of evaluation ``name`` in a cell's directory:
    ``eval.json`` / ``eval.md`` for the one evaluation of a grid without ``[[evals]]``,
    else ``eval-<name>.json`` / ``eval-<name>.md``."""
    stem = "eval" if name == DEFAULT_EVAL else f"eval-{name}"
    return f"{stem}.json", f"{stem}.md"


@dataclass
class SweepPlan:
    """A grid file read and checked: the shared ``train`` settings (a dict of
    :class:`TrainConfig` fields, ``focus`` a dict of :class:`FocusConfig` fields), the shared
    ``eval`` settings (:class:`~focus_attention.evaluation.EvalConfig` fields), the
    ``cells``: ``{slug: {setting: value}}`` in grid order, and the named evaluations
    ``evals`` (:class:`SweepEval`; one named ``eval`` without ``[[evals]]`` tables)."""

    train: dict[str, Any]
    eval: dict[str, Any]
    cells: dict[str, dict[str, Any]]
    source: str = ""
    evals: list[SweepEval] = field(default_factory=lambda: [SweepEval(DEFAULT_EVAL, {})])

    def cell_evals(self, slug: str) -> list[SweepEval]:
        """The evaluations of cell ``slug``, in file order."""
        return [e for e in self.evals if e.cells is None or slug in e.cells]

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

    def eval_config(self, slug: str, cell_dir: Path, name: str = DEFAULT_EVAL, **run: Any) -> Any:
        """The :class:`~focus_attention.evaluation.EvalConfig` of evaluation ``name`` of cell
        ``slug``: the shared ``[eval]`` settings, those of the ``[[evals]]`` table ``name``,
        the cell's adapter (``cell_dir``), its model and corpus, and the files of
        :func:`eval_files` there (``run``: ``threads``, ``progress``).

        Raises:
            ValueError: invalid settings (the message names the file and the evaluation);
                ``name`` not an evaluation of the cell.
        """
        evals = {e.name: e for e in self.cell_evals(slug)}
        if name not in evals:
            raise ValueError(f"{self.source}: cell {slug} has no evaluation {name!r}; it has "
                             f"{sorted(evals)}")  # fmt: skip
        train = self.train_config(slug, cell_dir)
        settings = {"model": train.model, "corpus": train.corpus, **self.eval}
        settings.update(evals[name].settings)
        settings.update({k: v for k, v in run.items() if v is not None})
        js, md = eval_files(name)
        settings.update(adapter=str(cell_dir), json=str(cell_dir / js), markdown=str(cell_dir / md))
        where = "[eval]" if name == DEFAULT_EVAL else f"[[evals]] {name}"
        try:
            return EvalConfig.from_dict(settings)
        except ValueError as err:
            raise ValueError(f"{self.source}: {where}: {err}") from err


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


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise ValueError(f"{where}: name {name!r} is not a file name; expected letters, digits, "
                         "'.', '_' or '-', starting with a letter or digit")  # fmt: skip
    return name


def _explicit_cells(cells: list[Any], where: str) -> list[tuple[str, dict[str, Any]]]:
    """``[(slug, settings)]`` of the ``[[cells]]`` tables (``name`` or the settings' slug)."""
    out = []
    for i, cell in enumerate(cells):
        at = f"{where} [[cells]] #{i + 1}"
        if not isinstance(cell, dict):
            raise ValueError(f"{at}: expected a table, got {cell!r}")
        settings = {k: v for k, v in cell.items() if k != "name"}
        for key in settings:
            _check_key(key, at)
        slug = _check_name(cell["name"], at) if "name" in cell else cell_slug(settings)
        out.append((slug, settings))
    return out


def expand_grid(
    grid: dict[str, Any], cells: list[dict[str, Any]] | None = None, *, where: str = "grid"
) -> dict[str, dict[str, Any]]:
    """The cells of a grid: the cartesian product of ``grid``'s lists (in key order, the
    last key varying fastest), then the explicit ``cells``; duplicates are dropped.

    Args:
        grid: ``{setting: [values]}``; a single value counts as a one-value list.
        cells: explicit cells, each ``{setting: value}``, with an optional ``name``: the
            cell's slug instead of :func:`cell_slug` of its settings.
        where: the file named in error messages.

    Returns:
        ``{slug: {setting: value}}`` (see :func:`cell_slug`).

    Raises:
        ValueError: a setting that is not a grid key (:data:`GRID_KEYS`), an empty list,
            a name that is not a file name, one name for two different cells, no cells.
    """
    axes = []
    for key, values in grid.items():
        _check_key(key, f"{where} [grid]")
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ValueError(f"{where} [grid]: {key} is an empty list; give at least one value")
        axes.append([(key, v) for v in values])
    combos = [(cell_slug(c), c) for c in map(dict, itertools.product(*axes))] if axes else []
    combos += _explicit_cells(list(cells or []), where)
    if not combos:
        raise ValueError(f"{where}: no cells: give a [grid] table of lists or [[cells]] tables")
    out: dict[str, dict[str, Any]] = {}
    for slug, settings in combos:
        if out.setdefault(slug, settings) != settings:
            raise ValueError(f"{where}: two different cells are named {slug!r}")
    return out


def _sweep_evals(tables: Any, cells: dict[str, Any], where: str) -> list[SweepEval]:
    """The :class:`SweepEval` list of the ``[[evals]]`` tables (checked names and cells).

    Raises:
        ValueError: not a list of tables, a missing or bad ``name``, an unknown cell, a
            name used twice for one cell, a cell without any evaluation.
    """
    if tables is None:
        return [SweepEval(DEFAULT_EVAL, {})]
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"{where}: [[evals]] must be one or more tables")
    evals, seen = [], {slug: set() for slug in cells}
    for i, table in enumerate(tables):
        at = f"{where} [[evals]] #{i + 1}"
        if "name" not in table:
            raise ValueError(f"{at}: no name (the evaluation's file is eval-<name>.json)")
        name = _check_name(table["name"], at)
        only = table.get("cells")
        if only is not None:
            if not isinstance(only, list) or not only:
                raise ValueError(f"{at}: cells must be a list of cell names, got {only!r}")
            unknown = sorted(set(only) - set(cells))
            if unknown:
                raise ValueError(f"{at}: unknown cells {unknown}; the cells are {list(cells)}")
        for slug in only or cells:
            if name in seen[slug]:
                raise ValueError(f"{at}: cell {slug} has two evaluations named {name!r}")
            seen[slug].add(name)
        settings = {k: v for k, v in table.items() if k not in ("name", "cells")}
        evals.append(SweepEval(name, settings, None if only is None else tuple(only)))
    bare = [slug for slug, names in seen.items() if not names]
    if bare:
        raise ValueError(f"{where}: cells {bare} have no evaluation in [[evals]]")
    return evals


def load_plan(path: str | os.PathLike[str]) -> SweepPlan:
    """Read and check a grid file (module docstring); every cell's :class:`TrainConfig`
    and evaluation settings are validated before anything runs.

    Raises:
        FileNotFoundError: no such file, or a directory.
        ValueError: invalid TOML, unknown tables or settings, empty lists, bad names,
            invalid values (the message names the file and the cell or evaluation).
    """
    where = str(path)
    if not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "no such file"
        raise FileNotFoundError(f"grid file {where}: {what}; expected a TOML grid file")
    data = read_toml(path, "grid file")
    unknown = sorted(set(data) - {"train", "eval", "grid", "cells", "evals"})
    if unknown:
        raise ValueError(f"{where}: unknown tables {unknown}; expected [train], [eval], "
                         "[grid], [[cells]] and [[evals]]")  # fmt: skip
    for key in ("train", "eval", "grid"):
        if not isinstance(data.get(key, {}), dict):
            raise ValueError(f"{where}: [{key}] must be a table")
    cells = expand_grid(data.get("grid", {}), data.get("cells"), where=where)
    evals = _sweep_evals(data.get("evals"), cells, where)
    plan = SweepPlan(dict(data.get("train", {})), dict(data.get("eval", {})), cells, where, evals)
    for slug in cells:
        plan.train_config(slug, Path("cell"))
        for ev in plan.cell_evals(slug):
            plan.eval_config(slug, Path("cell"), ev.name)
    return plan


#: evaluation settings not compared when a cell is reused: they do not change the results,
#: or (``adapter``, the cell's directory) follow from where the sweep's directory is
EVAL_FREE_FIELDS = ("threads", "progress", "json", "markdown", "adapter")


def _eval_settings(ev_cfg: Any) -> dict[str, Any]:
    """The evaluation settings that decide a cell's results, as JSON values."""
    d = dataclasses.asdict(ev_cfg)
    return json.loads(json.dumps({k: v for k, v in d.items() if k not in EVAL_FREE_FIELDS}))


def _train_row(cfg: TrainConfig, train_seconds: float) -> dict:
    """The training part of a cell's row: its directory, Focus settings, dominance at the
    last logged step (``log.jsonl``), training seconds and settings."""
    cell_dir = cfg.out_dir()
    log = [r for r in read_log(cell_dir / LOG_NAME) if "dominance" in r]
    return {
        "dir": str(cell_dir),
        "focus": cfg.focus_config().to_dict(),
        "train_dominance": {
            k: log[-1][k]
            for k in ("dominance", "dominance_max", "dominance_topk")
            if log and k in log[-1]
        },  # fmt: skip
        "train_seconds": train_seconds,
        "train_config": cfg.to_dict(),
        "evals": {},
    }


def _eval_row(ev_cfg: Any) -> dict:
    """One evaluation of a cell's row, from its JSON file: perplexities (``base`` is the
    dense model), pairs retained and dominance per top_k, scored tokens, window length."""
    ev = read_eval_result(ev_cfg.json)
    return {
        "ppl": ev["ppl"],
        "pairs_retained": ev["pairs_retained"],
        "dominance": ev["dominance"],
        "tokens": ev["tokens"],
        "seq_len": ev_cfg.seq_len,
        "eval_config": _eval_settings(ev_cfg),
    }


def read_eval_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The result of ``focus eval`` at ``path``, checked for what a sweep reads of it
    (:data:`EVAL_RESULT_SHAPE`).

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: a damaged file or one of another shape (naming it).
    """
    return read_json_record(path, "the JSON results of focus eval", EVAL_RESULT_SHAPE)


def _upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A ``cell.json`` row of the one-evaluation layout (results at the top level) in the
    layout of :func:`run_cell`; other rows unchanged."""
    if "evals" in row:
        return row
    row = dict(row)
    one = {k: row.pop(k) for k in ("ppl", "pairs_retained", "dominance") if k in row}
    one.update(tokens=row.pop("eval_tokens", None), eval_config=row.pop("eval_config", {}))
    one["seq_len"] = one["eval_config"].get("seq_len")
    return {**row, "evals": {DEFAULT_EVAL: one}}


def read_cell(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The row of the ``cell.json`` at ``path``, in the layout of :func:`run_cell`.

    Raises:
        UnreadableFileError: a damaged file, or one without :data:`CELL_SHAPE` (the
            message names it).
    """
    row = _upgrade_row(read_json_record(path, CELL_EXPECTED))
    check_shape(path, row, CELL_SHAPE, CELL_EXPECTED)
    return row


def _check_unchanged(row: dict[str, Any], cfg: TrainConfig, evals: dict[str, Any]) -> None:
    """Refuse to reuse a cell whose training, or a finished evaluation, used other settings
    than the grid file's now (``evals``: ``{name: EvalConfig}``).

    Raises:
        ValueError: naming the settings that changed.
    """
    changed = sorted(TrainConfig.from_dict(row["train_config"]).locked_differences(cfg))
    for name, ev_cfg in evals.items():
        if name in row["evals"]:
            then, now = row["evals"][name]["eval_config"], _eval_settings(ev_cfg)
            keys = sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k))
            changed += [f"{name}.{k}" for k in keys]
    if changed:
        raise ValueError(
            f"{row['dir']} was trained or evaluated with other settings ({', '.join(changed)} "
            "changed): use another --out, or delete the cell to run it again"
        )


def _trained_row(plan: SweepPlan, slug: str, cfg: TrainConfig, progress: bool) -> dict:
    """The cell's row: from its ``cell.json``, else after training it (resumed from its
    newest checkpoint when there is one), written to ``cell.json``."""
    path = cfg.out_dir() / CELL_FILE
    if path.is_file():  # "dir": where the cell is now
        return {**read_cell(path), "dir": str(cfg.out_dir())}
    if progress:
        print(f"focus sweep: cell {slug}: {'resuming' if cfg.resume else 'training'}",
              file=sys.stderr)  # fmt: skip
    result = train(cfg)
    row = {"slug": slug, "settings": plan.cells[slug], **_train_row(cfg, result.train_seconds)}
    write_json_atomic(path, row)
    return row


def run_cell(plan: SweepPlan, slug: str, out: str, threads: int | None, progress: bool) -> dict:
    """Train cell ``slug`` in ``out/cells/<slug>`` unless its ``cell.json`` exists (an
    interrupted training resumes from its newest checkpoint), then run each of its
    evaluations not yet in ``cell.json``, adding it there. Returns the cell's row
    (``cell.json``, with the grid's evaluations of the cell only): ``slug``, ``settings``, ``dir``, ``focus``, ``train_dominance``,
    ``train_seconds``, ``train_config`` and ``evals``: ``{name: {ppl, pairs_retained,
    dominance, tokens, seq_len, eval_config}}``.

    Raises:
        ValueError: a cell trained, or evaluated under one name, with other settings than
            the grid's now; what :func:`~focus_attention.training.run.train` and
            :func:`~focus_attention.evaluation.evaluate` raise.
    """
    cell_dir = Path(out) / "cells" / slug
    resume = latest_checkpoint(cell_dir) is not None
    quiet = None if progress else False  # None: the grid file's own progress setting
    cfg = plan.train_config(slug, cell_dir, threads=threads, progress=quiet,
                            resume=resume, overwrite=not resume)  # fmt: skip
    evals = {e.name: plan.eval_config(slug, cell_dir, e.name, threads=threads, progress=quiet)
             for e in plan.cell_evals(slug)}  # fmt: skip
    if (cell_dir / CELL_FILE).is_file():
        _check_unchanged(read_cell(cell_dir / CELL_FILE), cfg, evals)
    row = _trained_row(plan, slug, cfg, progress)
    for name, ev_cfg in evals.items():
        if name in row["evals"]:
            continue
        if progress:
            print(f"focus sweep: cell {slug}: evaluation {name}", file=sys.stderr)
        evaluate(ev_cfg)
        row["evals"][name] = _eval_row(ev_cfg)
        write_json_atomic(cell_dir / CELL_FILE, row)
    return {**row, "evals": {name: row["evals"][name] for name in evals}}


def _gather(futures: dict[Future, str], progress: bool) -> dict[str, dict]:
    """The rows of parallel cells (``futures``: ``{future: slug}``) by slug, as they finish;
    with ``progress``, one line on stderr per finished cell.

    Raises:
        what a cell raised, as soon as it finishes.
    """
    rows: dict[str, dict] = {}
    for future in as_completed(futures):
        slug = futures[future]
        rows[slug] = future.result()
        if progress:
            print(f"focus sweep: cell {slug}: done ({len(rows)} of {len(futures)} cells)",
                  file=sys.stderr)  # fmt: skip
    return rows


def _run_cells(plan: SweepPlan, cfg: SweepConfig) -> list[dict]:
    """Every cell's row, in grid order: in this process, or in ``cfg.jobs`` processes (the
    cells' own messages and bars silenced, one line per finished cell from this one)."""
    out, threads = str(cfg.out_dir()), cfg.cell_threads()
    slugs = list(plan.cells)
    if cfg.jobs == 1:
        return [run_cell(plan, s, out, threads, cfg.progress) for s in slugs]

    # spawn: a forked child would inherit torch's thread pools in an undefined state
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=cfg.jobs, mp_context=ctx) as pool:
        # quiet cells: the bars of parallel cells would overwrite each other
        futures = {pool.submit(run_cell, plan, s, out, threads, False): s for s in slugs}
        rows = _gather(futures, cfg.progress)
    return [rows[s] for s in slugs]


def run_sweep(config: SweepConfig) -> dict[str, Any]:
    """Run a sweep (module docstring): every unfinished cell is trained and evaluated, then
    ``sweep.json``, ``sweep.md``, ``ppl_vs_pairs.png`` and ``dominance.png`` are written
    into ``config.out_dir()``.

    Returns:
        the content of ``sweep.json``: ``grid`` (the file), ``train`` / ``eval`` (shared
        settings), ``evals`` (the named evaluations), ``cells`` (one row per cell, see
        :func:`run_cell`), ``points`` (:func:`sweep_points`), ``versions``,
        ``environment``.

    Raises:
        ValueError: ``grid`` not given, or an invalid grid file (:func:`load_plan`).
        FileNotFoundError: no such grid file; what training and evaluation raise.
        UnreadableFileError: a damaged ``cell.json`` or evaluation result (naming it).
        FolderInUseError: another sweep is writing the output folder (a ``RuntimeError``
            naming it).
    """
    if config.grid is None:
        raise bad("SweepConfig", "grid", None, "a grid file (TOML)")
    plan = load_plan(config.grid)
    out = config.out_dir()
    with exclusive_lock(out / LOCK_NAME, f"focus sweep --grid {config.grid} --out {out}"):
        return _sweep(plan, config, out)


def _sweep(plan: SweepPlan, config: SweepConfig, out: Path) -> dict[str, Any]:
    """:func:`run_sweep` once its folder is held."""
    rows = _run_cells(plan, config)
    points = sweep_points(rows)
    summary = {
        "grid": str(config.grid),
        "train": plan.train,
        "eval": plan.eval,
        "evals": [dataclasses.asdict(e) for e in plan.evals],
        "cells": rows,
        "points": points,
        "versions": library_versions(),
        "environment": environment(),
    }
    write_json_atomic(out / "sweep.json", summary)
    atomic_write_text(out / "sweep.md", sweep_markdown(summary) + "\n")
    write_sweep_plots(rows, points, out)
    return summary


def _pareto(points: list[dict[str, Any]]) -> None:
    """Mark each point ``pareto``: no other point has both a perplexity and a share of
    pairs retained at most its own, one of them lower."""
    for p in points:
        p["pareto"] = not any(
            q["ppl"] <= p["ppl"] and q["pairs_retained"] <= p["pairs_retained"]
            and (q["ppl"], q["pairs_retained"]) != (p["ppl"], p["pairs_retained"])
            for q in points
        )  # fmt: skip


def sweep_points(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Perplexity against pairs retained, per evaluation name: one point per cell and
    evaluated top_k.

    Each point: ``slug``, ``top_k``, ``ppl`` (top-k routing), ``dense`` (the base model's
    PPL in the same evaluation), ``pairs_retained`` (share of the causal pairs the top-k
    mask keeps, 0..1), ``ppl_increase`` (``ppl / dense - 1``), ``pairs_removed``
    (``1 - pairs_retained``), ``cost``: ``ppl_increase / pairs_removed``, the relative
    perplexity increase per share of pairs removed (0.1: removing 10% of the pairs costs
    1% perplexity; lower is better; None when no pair is removed), and ``pareto``: no
    other point of the evaluation has a lower perplexity at no more pairs, or fewer pairs
    at no higher perplexity.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        for name, ev in row["evals"].items():
            dense = ev["ppl"]["base"]
            for k, ppl in ev["ppl"]["focus_topk"].items():
                kept = ev["pairs_retained"][k]
                increase, removed = ppl / dense - 1, 1 - kept
                out.setdefault(name, []).append({
                    "slug": row["slug"], "top_k": int(k), "ppl": ppl, "dense": dense,
                    "pairs_retained": kept, "ppl_increase": increase, "pairs_removed": removed,
                    "cost": increase / removed if removed > 0 else None,
                })  # fmt: skip
    for points in out.values():
        _pareto(points)
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _eval_lines(summary: dict[str, Any], name: str, keys: list[str]) -> list[str]:
    """The table of evaluation ``name``: a row per cell and top_k."""
    rows = {r["slug"]: r for r in summary["cells"]}
    head = ["cell", *keys, "top_k", "PPL", "dense", "vs dense", "pairs retained",
            "cost", "Pareto", "dominance (eval)", "dominance (end of training)", "train s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for p in summary["points"][name]:
        r = rows[p["slug"]]
        dom = r["evals"][name]["dominance"]["topk"].get(str(p["top_k"]))
        vals = [p["slug"], *(str(r["settings"].get(k, "-")) for k in keys), str(p["top_k"]),
                f"{p['ppl']:.3f}", f"{p['dense']:.3f}", f"{100 * p['ppl_increase']:+.1f}%",
                f"{100 * p['pairs_retained']:.1f}%", _fmt(p["cost"], ".3f"),
                "yes" if p["pareto"] else "", _fmt(dom, ".3f"),
                _fmt(r["train_dominance"].get("dominance"), ".3f"),
                f"{r['train_seconds']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(vals) + " |")
    return lines


def sweep_markdown(summary: dict[str, Any]) -> str:
    """The sweep as markdown: per evaluation, one table with a row per cell and evaluated
    ``top_k`` (cell, varied settings, PPL, the dense PPL and the change against it, pairs
    retained, ``cost`` and ``pareto`` of :func:`sweep_points`, evaluation dominance of the
    top-k routing, dominance of the soft routing at the last training step, training
    seconds)."""
    rows = summary["cells"]
    keys = list(dict.fromkeys(k for r in rows for k in r["settings"]))
    parts = [f"Sweep `{summary['grid']}`: {len(rows)} cells. cost = (PPL / dense - 1) / "
             "(1 - pairs retained): the relative perplexity increase per share of causal "
             "pairs removed (lower is better); Pareto: no other point of the same "
             "evaluation has a lower PPL at no more pairs, or fewer pairs at no higher PPL."]  # fmt: skip
    for name in summary["points"]:
        ev = next(r["evals"][name] for r in rows if name in r["evals"])
        cfg = ev["eval_config"]
        parts.append(f"### Evaluation `{name}`: {cfg['split']} split, {ev['tokens']} scored "
                     f"tokens in {cfg['seq_len']}-token windows\n\n"
                     + "\n".join(_eval_lines(summary, name, keys)))  # fmt: skip
    return "\n\n".join(parts)


def _result_rows(summary: dict[str, Any]) -> tuple[list[dict], dict[str, list[dict]]]:
    """The rows (in the layout of :func:`run_cell`) and points of a ``sweep.json``."""
    rows = [_upgrade_row(r) for r in summary["cells"]]
    return rows, sweep_points(rows)


def sweep_report(summary: dict[str, Any]) -> str:
    """:func:`sweep_markdown` of a ``sweep.json`` read back (either cell layout), from its
    content alone."""
    rows, points = _result_rows(summary)
    return sweep_markdown({**summary, "cells": rows, "points": points})


def plot_sweep_result(summary: dict[str, Any], out: str | os.PathLike[str]) -> list[Path]:
    """The perplexity-against-pairs plot of a ``sweep.json`` read back, into directory
    ``out`` (:func:`~.grid_plot.write_pairs_plot`; the dominance plot needs the cells'
    training logs and is written by :func:`run_sweep` only); returns the paths."""
    rows, points = _result_rows(summary)
    return [write_pairs_plot(rows, points, out)]
