"""The ``report`` step of a study: its tables (markdown) and plots, rebuilt from the result
files of its steps alone, with the table and plot functions of the commands that wrote
them (``focus bench kernel`` -> :func:`focus_attention.bench.kernel.kernel_table`, ...)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..bench.results import PLOTTERS
from ..utils.io import atomic_write_text, read_json_file
from .study import Step, Study, fill, recorded_differences

__all__ = ["PLOTS", "TABLES", "report_markdown", "write_report"]

#: the markdown table of each command's JSON result: ``module:function(result) -> str``
TABLES = {
    "eval": "focus_attention.evaluation.perplexity:markdown_table",
    "bench kernel": "focus_attention.bench.kernel:kernel_table",
    "bench model": "focus_attention.bench.model:model_table",
    "bench decode": "focus_attention.bench.decode:decode_table",
    "bench needle": "focus_attention.bench.needle:needle_table",
    "bench retrieval-layers": "focus_attention.bench.needle:retrieval_layers_table",
    "bench tasks": "focus_attention.bench.tasks:tasks_table",
    "bench instructions": "focus_attention.bench.instructions:instructions_table",
    "bench serve": "focus_attention.bench.serve:serve_table",
    "inspect": "focus_attention.evaluation.group_report:markdown_summary",
    "sweep": "focus_attention.experiments.grid:sweep_report",
}
#: the plot of each command's JSON result: ``module:function(result, path)``; the path is
#: the result's with ``.png`` (a directory for ``inspect`` and ``sweep``, whose functions
#: write several files there)
PLOTS = {
    **{f"bench {name}": spec for name, spec in PLOTTERS.items()},
    "inspect": "focus_attention.evaluation.group_report:write_group_plots",
    "sweep": "focus_attention.experiments.grid:plot_sweep_result",
}
#: commands whose plot function takes the result's directory
DIRECTORY_PLOTS = ("inspect", "sweep")


def _function(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _result(study: Study, step: Step, runs: str) -> tuple[Path, dict[str, Any]] | None:
    if step.result is None:
        return None
    path = Path(fill(step.result, study.paths(runs)))
    if not path.is_file():
        return None
    return path, read_json_file(path, f"the JSON result of step {step.name!r}")


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
    whose command has no table in :data:`TABLES`, or without a result, are listed as
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
        table = TABLES.get(step.command_text())
        body.append(_function(table)(data) if table else f"Result: `{path}` (no table).")
        parts.append("\n\n".join(body))
    return "\n\n".join(parts) + "\n"


def write_plots(study: Study, runs: str = "runs") -> list[Path]:
    """The plot of each step's result (:data:`PLOTS`), next to it; returns the paths."""
    written = []
    for step in study.steps:
        plot = PLOTS.get(step.command_text())
        found = None if plot is None else _result(study, step, runs)
        if found is None:
            continue
        path, data = found
        where = path.parent if step.command_text() in DIRECTORY_PLOTS else path.with_suffix(".png")
        out = _function(str(plot))(data, where)
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
