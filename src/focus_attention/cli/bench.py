"""``focus bench NAME``: the benchmarks of :data:`focus_attention.bench.registry.BENCHMARKS`,
each run by :func:`run_benchmark` and writing JSON; ``focus bench merge|plot``: their result
files merged and plotted. The sub-commands are built from the torch-free
:data:`~focus_attention.bench.commands.BENCH_COMMANDS`; the registry, which imports the
benchmarks' functions (and torch), is imported when a benchmark runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..bench.commands import BENCH_COMMANDS
from ..bench.results import merge_results, plot_result_file, read_result
from ..bench.settings import MergeResultsConfig, PlotResultsConfig
from ..utils.io import check_output_file, write_json_atomic
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config

if TYPE_CHECKING:
    from ..bench.registry import Benchmark


def _config(args: argparse.Namespace, cls: type, required: tuple[str, ...] = ()) -> Any:
    """The settings of ``focus bench NAME``: defaults, table ``[bench.NAME]`` of
    ``--config``, then the flags (``required``: fields one of them must give)."""
    return command_config(args, cls, f"bench.{args.bench_command}", required=required)


def _outputs(config: Any, plotted: bool = False) -> str | None:
    """Check, before the run, that ``config.json`` and (for a benchmark that plots) the plot
    can be written. Returns the plot's path: ``config.plot``, else the JSON path with
    ``.png``; None without either or for a benchmark that does not plot.

    Raises:
        ValueError: a path that cannot be written (a directory, a file in place of a folder,
            a folder that refuses new files), or a plot that would replace the JSON.
    """
    if config.json:
        check_output_file(config.json, "--json")
    if not plotted:
        return None
    plot = config.plot or (str(Path(config.json).with_suffix(".png")) if config.json else None)
    if plot:
        check_output_file(plot, "--plot")
        if config.json and Path(plot).resolve() == Path(config.json).resolve():
            raise ValueError(f"--plot: received {plot!r}, the --json path; expected another "
                             "file (give --plot, or a --json path that does not end in .png)")  # fmt: skip
    return plot


def _write(result: dict, config: Any, plot: str | None = None, plot_fn: Callable | None = None) -> None:  # fmt: skip
    """The result to ``config.json`` and, with ``plot_fn``, a PNG plot to ``plot``
    (:func:`_outputs`)."""
    if config.json:
        write_json_atomic(config.json, result)
        print(f"wrote {config.json}")
    if plot_fn is not None and plot:
        plot_fn(result, plot)
        print(f"wrote {plot}")


def _checkpoint(config: Any) -> Callable[[dict], None]:
    """What a long benchmark calls with its result so far: rewrites ``config.json`` (if any),
    so that an interrupted run keeps what it measured."""

    def checkpoint(partial: dict) -> None:
        if config.json:
            write_json_atomic(config.json, partial)

    return checkpoint


def run_benchmark(benchmark: Benchmark, args: argparse.Namespace) -> int:
    """``focus bench NAME`` for the row ``benchmark``: its settings (defaults, ``--config``,
    flags), its outputs checked before the run, the run, its table (and notes) printed, the
    JSON and the plot written. Returns the exit status, 0.

    Raises:
        ValueError, RuntimeError, OSError: bad settings, outputs that cannot be written,
            and the errors of the benchmark's run (``focus`` reports them in one line).
    """
    run, config = benchmark.run, _config(args, benchmark.settings, benchmark.required)
    plot = _outputs(config, plotted=benchmark.plot is not None)
    extra = {"checkpoint": _checkpoint(config)} if benchmark.checkpoint else {}
    result = run(config, **extra)
    print(benchmark.table(result))
    for line in benchmark.notes(result) if benchmark.notes else ():
        print(line)
    _write(result, config, plot, benchmark.plot)
    return 0


def _benchmark(args: argparse.Namespace) -> int:
    """The benchmark ``focus bench NAME`` names (:func:`run_benchmark`)."""
    from ..bench.registry import BENCHMARKS  # the benchmarks' functions: torch, when one runs

    return run_benchmark(BENCHMARKS[args.bench_command], args)


#: the fields ``focus bench merge`` and ``focus bench plot`` need given
MERGE_REQUIRED = ("results", "json")
PLOT_REQUIRED = ("results",)


def _merge(args: argparse.Namespace) -> int:
    config = _config(args, MergeResultsConfig, MERGE_REQUIRED)
    _outputs(config)
    merged = merge_results([read_result(path) for path in config.results])
    _write(merged, config)
    return 0


def _plot(args: argparse.Namespace) -> int:
    config = _config(args, PlotResultsConfig, PLOT_REQUIRED)
    for path in config.results:
        for written in plot_result_file(path, config.out):
            print(f"wrote {written}")
    return 0


def _add_command(sub: Any, name: str, config: type, run: Callable, required: tuple[str, ...] = (), **text: str) -> None:  # fmt: skip
    """One ``focus bench NAME`` sub-command: ``--config`` (table ``[bench.NAME]``) and the
    flags of ``config`` (those in ``required`` said to be)."""
    parser = sub.add_parser(name, **text)
    add_config_flag(parser, f"bench.{name}")
    add_flags(parser, config, required=required)
    parser.set_defaults(func=run_guarded(run))


#: the sub-commands on result files, after the benchmarks: name -> (settings class, run
#: function, flags that must be given, help, description)
RESULT_COMMANDS: dict[str, tuple[type, Callable, tuple[str, ...], str, str]] = {
    "merge": (
        MergeResultsConfig, _merge, MERGE_REQUIRED,
        "merge result files of one benchmark into one JSON file",
        "Reads JSON results of one benchmark (kernel, model, decode, ...) and "
        "writes them, in order, as the parts of one result file, with the versions and "
        "hardware of the first at its top; focus bench plot draws each part.",
    ),
    "plot": (
        PlotResultsConfig, _plot, PLOT_REQUIRED,
        "plot result files of focus bench kernel, model, decode, needle, ruler or serve",
        "Draws each result a JSON file holds (one, or the parts of a merged file) "
        "as a PNG beside it or in --out: speed-up against length beside the ideal for the "
        "kernel, prefill and decoding benchmarks.",
    ),
}  # fmt: skip


def register_cli(subparsers: Any) -> None:
    """Add ``focus bench``: a sub-command per benchmark of
    :data:`~focus_attention.bench.commands.BENCH_COMMANDS`, then those of
    :data:`RESULT_COMMANDS`."""
    bench = subparsers.add_parser("bench", help=summary("bench"))
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for b in BENCH_COMMANDS.values():
        _add_command(sub, b.name, b.settings, _benchmark, b.required, help=b.help, description=b.description)  # fmt: skip
    for name, (config, run, required, text, description) in RESULT_COMMANDS.items():
        _add_command(sub, name, config, run, required, help=text, description=description)
