"""Result files of the benchmarks: several results of one benchmark merged into one JSON file
(``focus bench merge``: a GPU run writes few files), and the plots of any result file, merged
or not (``focus bench plot``: made afterwards, on any machine, from the JSON alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..utils.io import read_json_file
from .registry import BENCHMARKS, plotted_benchmarks, resolve

__all__ = ["merge_results", "plot_result_file", "result_parts"]


def merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result holding several results of one benchmark, in order:
    ``{"benchmark", "merged": True, "versions", "environment", "parts": [...]}`` (the
    versions and environment of the first part at the top; each part keeps its own).

    Raises:
        ValueError: no result, a result without ``"benchmark"``, or results of several
            benchmarks.
    """
    if not results:
        raise ValueError("merge_results: received no result, expected one or more")
    parts = [part for result in results for part in result_parts(result)]
    names = sorted({str(part.get("benchmark")) for part in parts})
    if len(names) != 1 or names[0] == "None":
        raise ValueError(f"merge_results: received results of {names}, expected one benchmark's")  # fmt: skip
    return {"benchmark": names[0], "merged": True, "versions": parts[0].get("versions"),
            "environment": parts[0].get("environment"), "parts": parts}  # fmt: skip


def result_parts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The results a result file holds: its parts when merged, else itself."""
    return list(result["parts"]) if result.get("merged") else [result]


def plot_result_file(path: str | Path, out: str | Path | None = None) -> list[Path]:
    """Plot the result file ``path``: one PNG per result it holds, named after the file
    (``NAME.png``, or ``NAME-1.png``, ``NAME-2.png``... for a merged file), beside it or in
    the folder ``out``.

    Returns:
        the PNGs written.

    The plot function is the ``plot`` of the benchmark its ``"benchmark"`` names
    (:data:`~focus_attention.bench.registry.BENCHMARKS`), imported only now: merging needs
    neither torch nor matplotlib.

    Raises:
        ValueError: a file that is not a JSON result, or a benchmark without a plot.
    """
    path = Path(path)
    result = read_json_file(path, "a benchmark's JSON result")
    parts = result_parts(result)
    folder = Path(out) if out is not None else path.parent
    written = []
    for index, part in enumerate(parts, 1):
        benchmark = BENCHMARKS.get(str(part.get("benchmark")))
        if benchmark is None or benchmark.plot is None:
            raise ValueError(f"{path}: a {part.get('benchmark')!r} result has no plot; plots "
                             f"exist for {', '.join(plotted_benchmarks())}")  # fmt: skip
        name = f"{path.stem}.png" if len(parts) == 1 else f"{path.stem}-{index}.png"
        resolve(benchmark.plot)(part, folder / name)
        written.append(folder / name)
    return written
