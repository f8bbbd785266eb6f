"""Result files of the benchmarks: several results of one benchmark merged into one JSON file
(``focus bench merge``: a GPU run writes few files), and the plots of any result file, merged
or not (``focus bench plot``: made afterwards, on any machine, from the JSON alone).

A result file is read back by :func:`read_result`, which checks its shape (a JSON object
naming its benchmark, with what that benchmark's table and plot read:
:attr:`~focus_attention.bench.commands.BenchCommand.shape`; a merged file, one or more such
parts) and names the file and what was expected when it differs. Reading and merging import
neither torch nor matplotlib; :func:`plot_result_file` imports the benchmarks' functions
(:mod:`.registry`) when it draws."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..utils.io import UnreadableFileError, read_json_record, shape_mismatch, unreadable
from .commands import BENCH_COMMANDS

__all__ = ["RESULT_EXPECTED", "merge_results", "plot_result_file", "read_result", "result_parts"]

#: what a result file holds, for the messages
RESULT_EXPECTED = (
    'a JSON result of focus bench (an object naming its "benchmark"), or a merged file of '
    'focus bench merge (its "parts")'
)
#: what a result's table or plot function may raise on a result whose shape the benchmark's
#: declaration does not cover: reported as a file it cannot read
READ_ERRORS = (KeyError, IndexError, TypeError, AttributeError, ValueError, StopIteration)


def _check_part(path: Path, part: Any, where: str) -> None:
    """One result of a file: an object naming a known benchmark, of its shape."""
    name = part.get("benchmark") if isinstance(part, dict) else None
    if not isinstance(part, dict) or not isinstance(name, str):
        why = shape_mismatch(part, {"benchmark": str}, where)
        raise unreadable(path, str(why), RESULT_EXPECTED)
    if name not in BENCH_COMMANDS:
        raise unreadable(path, f"{where or 'it'} names the benchmark {name!r}", f"one of "
                         f"{', '.join(BENCH_COMMANDS)}")  # fmt: skip
    why = shape_mismatch(part, BENCH_COMMANDS[name].shape, where)
    if why is not None:
        raise unreadable(path, why, f"a {name!r} result of focus bench {name}")


def read_result(path: str | Path) -> dict[str, Any]:
    """The benchmark result file ``path``, checked: a JSON object naming a benchmark of
    :data:`~focus_attention.bench.commands.BENCH_COMMANDS`, of its ``shape``; or a merged file
    (``"merged": true``) holding one or more such ``parts`` of one benchmark.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: empty, truncated, not JSON, a directory, or of another shape
            (a JSON array, no ``"benchmark"``, a result without the keys its table and plot
            read, a merged file without parts); the message names the file and what was
            expected.
    """
    path = Path(path)
    result = read_json_record(path, RESULT_EXPECTED)
    if not result.get("merged"):
        _check_part(path, result, "")
        return result
    parts = result.get("parts")
    if not isinstance(parts, list) or not parts:
        what = "no parts" if parts in (None, []) else f"parts that are {type(parts).__name__}"
        raise unreadable(path, f"a merged result with {what}", "a merged file of focus bench "
                         "merge with one or more parts")  # fmt: skip
    for i, part in enumerate(parts):
        _check_part(path, part, f"parts[{i}]")
    names = sorted({part["benchmark"] for part in parts})
    if len(names) > 1:
        raise unreadable(path, f"parts of several benchmarks {names}", "one benchmark's")
    return result


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


def draw(path: Path, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` (a benchmark's table or plot) on a result read from ``path``.

    Raises:
        UnreadableFileError: the function could not read the result (a shape its
            benchmark's declaration does not cover); the message names ``path``.
    """
    try:
        return function(*args)
    except READ_ERRORS as err:
        name = f"{function.__module__}:{function.__qualname__}"
        raise UnreadableFileError(f"{path}: a result {name} cannot read "
                                  f"({type(err).__name__}: {err}); expected {RESULT_EXPECTED}") from err  # fmt: skip


def plot_result_file(path: str | Path, out: str | Path | None = None) -> list[Path]:
    """Plot the result file ``path``: one PNG per result it holds, named after the file
    (``NAME.png``, or ``NAME-1.png``, ``NAME-2.png``... for a merged file), beside it or in
    the folder ``out``.

    Returns:
        the PNGs written.

    The plot function is the ``plot`` of the benchmark its ``"benchmark"`` names
    (:data:`~focus_attention.bench.registry.BENCHMARKS`), imported only now: reading and
    merging need neither torch nor matplotlib.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: a file that is not a result (:func:`read_result`).
        ValueError: a benchmark without a plot.
    """
    from .registry import BENCHMARKS, plotted_benchmarks  # torch: only when a plot is drawn

    path = Path(path)
    parts = result_parts(read_result(path))
    folder = Path(out) if out is not None else path.parent
    written = []
    for index, part in enumerate(parts, 1):
        benchmark = BENCHMARKS[part["benchmark"]]
        if benchmark.plot is None:
            raise ValueError(f"{path}: a {part.get('benchmark')!r} result has no plot; plots "
                             f"exist for {', '.join(plotted_benchmarks())}")  # fmt: skip
        name = f"{path.stem}.png" if len(parts) == 1 else f"{path.stem}-{index}.png"
        draw(path, benchmark.plot, part, folder / name)
        written.append(folder / name)
    return written
