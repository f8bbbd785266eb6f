"""The ``report`` step of a study: its tables (markdown) and plots, rebuilt from the result
files of its steps alone, with the table and plot functions of the commands that wrote
them: a benchmark's from its row of :data:`focus_attention.bench.registry.BENCHMARKS`
(``focus bench kernel`` -> :func:`focus_attention.bench.kernel.kernel_table`, ...), the
other commands' from :data:`COMMAND_VIEWS`. A result file is checked for the shape its table
and plot read (:attr:`ResultView.shape`) and named when it differs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bench.registry import BENCHMARKS
from ..bench.results import draw
from ..evaluation.group_report import markdown_summary, write_group_plots
from ..evaluation.perplexity import markdown_table
from ..utils.io import NUMBER, atomic_write_text, read_json_record
from .grid import plot_sweep_result, sweep_report
from .study import Step, Study, fill, recorded_differences

__all__ = ["COMMAND_VIEWS", "ResultView", "report_markdown", "result_view", "write_plots", "write_report"]  # fmt: skip


@dataclass(frozen=True)
class ResultView:
    """How the report shows a command's JSON result: ``table``, a function
    ``table(result) -> str`` (markdown); ``plot``, a function ``plot(result, path)`` (None:
    no plot), where ``path`` is the result's folder when ``plot_in_folder`` (the function
    writes several files there), else the result's path with ``.png``; ``shape``, what
    they read of a result (:func:`~focus_attention.utils.io.shape_mismatch`), checked when
    the file is read."""

    table: Callable[[dict[str, Any]], str]
    plot: Callable[..., Any] | None = None
    plot_in_folder: bool = False
    shape: Any = dict


#: the commands other than ``focus bench NAME`` whose results the report shows
COMMAND_VIEWS = {
    "eval": ResultView(
        markdown_table,
        shape={"ppl": {"base": NUMBER}, "pairs_retained": dict, "dominance": dict},
    ),
    "inspect": ResultView(
        markdown_summary,
        write_group_plots,
        plot_in_folder=True,
    ),
    "sweep": ResultView(
        sweep_report,
        plot_sweep_result,
        plot_in_folder=True,
        shape={"cells": [dict]},
    ),
}


def result_view(command: tuple[str, ...]) -> ResultView | None:
    """How the report shows the result of ``focus COMMAND`` (its words): a benchmark's
    table and plot (:data:`~focus_attention.bench.registry.BENCHMARKS`), else the
    command's :data:`COMMAND_VIEWS` entry; None for a command the report has no table of."""
    if len(command) == 2 and command[0] == "bench" and command[1] in BENCHMARKS:
        benchmark = BENCHMARKS[command[1]]
        return ResultView(benchmark.table, benchmark.plot, shape=benchmark.shape)
    return COMMAND_VIEWS.get(" ".join(command))


def _result(study: Study, step: Step, runs: str) -> tuple[Path, dict[str, Any]] | None:
    if step.result is None:
        return None
    path = Path(fill(step.result, study.paths(runs)))
    if not (path.exists() or path.is_symlink()):
        return None
    view = result_view(step.command)
    expected = f"the JSON result of step {step.name!r} (focus {step.command_text()})"
    return path, read_json_record(path, expected, dict if view is None else view.shape)


def _provenance(step: Step, data: dict[str, Any], runs: str) -> str:
    record = data.get("experiment")
    env = data.get("environment") or {}
    when = f"{env.get('date', 'date not recorded')}, {env.get('cpu', 'hardware not recorded')}"
    if not isinstance(record, dict):
        return (f"Measured {when}. This result carries no `experiment` record: it was "
                "measured before the study's runner, and its settings are those of "
                "`config.toml` only as far as its own `config` shows.")  # fmt: skip
    changed = recorded_differences(step, record, runs)
    note = "" if changed == [] else (
        " (runs folder not recorded)" if changed is None
        else f" (**other settings than config.toml now: {', '.join(changed)}**)")  # fmt: skip
    return (f"Measured {when}, commit {env.get('git_commit')}: `focus "
            f"{' '.join(record.get('argv', []))}`{note}.")  # fmt: skip


def report_markdown(study: Study, runs: str = "runs") -> str:
    """The study's report: its title and question, then one section per step with a
    result file: where and when it was measured, and the command's table of it (steps
    whose command has no table (:func:`result_view`), or without a result, are listed as
    such)."""
    parts = [f"# {study.title}"]
    if study.question:
        parts.append(study.question.strip())
    parts.append(f"Rebuilt from the results of `{study.directory}` by its report step.")
    for step in study.steps:
        if step.builtin:
            continue
        found = _result(study, step, runs)
        head = f"## {step.name}: `focus {step.command_text()}`"
        if found is None:
            parts.append(f"{head}\n\nNo result yet ({step.result or 'no result file'}).")
            continue
        path, data = found
        body = [head, _provenance(step, data, runs)]
        view = result_view(step.command)
        body.append(draw(path, view.table, data) if view else f"Result: `{path}` (no table).")
        parts.append("\n\n".join(body))
    return "\n\n".join(parts) + "\n"


def write_plots(study: Study, runs: str = "runs") -> list[Path]:
    """The plot of each step's result (:func:`result_view`), next to it; returns the
    paths."""
    written = []
    for step in study.steps:
        view = result_view(step.command)
        found = None if view is None or view.plot is None else _result(study, step, runs)
        if found is None:
            continue
        path, data = found
        where = path.parent if view.plot_in_folder else path.with_suffix(".png")
        out = draw(path, view.plot, data, where)
        written += list(out) if isinstance(out, (list, tuple)) else [where]
    return written


def write_report(study: Study, step: Step, runs: str = "runs") -> Path:
    """Run the report step ``step``: write :func:`report_markdown` to its ``out`` setting
    (default ``{results}/report.md``) and, unless ``plots`` is false, :func:`write_plots`.
    Returns the markdown file."""
    out = Path(fill(step.settings.get("out", "{results}/report.md"), study.paths(runs)))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, report_markdown(study, runs))
    if step.settings.get("plots", True):
        write_plots(study, runs)
    return out
