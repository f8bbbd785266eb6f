"""The benchmarks, one row each: the command line of ``focus bench NAME`` (its
:class:`~.commands.BenchCommand`) and the functions that run it, print its result as a table
and plot it. ``focus bench NAME`` (:mod:`focus_attention.cli.bench`), ``focus bench plot``
(:mod:`.results`) and a study's report (:mod:`focus_attention.experiments.report`) are built
from :data:`BENCHMARKS`.

Adding a benchmark is its module (a run function, a table function and, if it plots, a plot
function; its settings class goes in :mod:`.settings`, which imports no torch), one
:class:`~.commands.BenchCommand` row in :mod:`.commands`, one :class:`Benchmark` row here and
its test.

The rows hold the functions themselves, imported at the top of this module (so this module
imports torch): ``focus bench --help`` reads :mod:`.commands` alone, and the command imports
this module when a benchmark runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..evaluation.retrieval import rank_retrieval_layers, retrieval_layers_table
from .commands import BENCH_COMMANDS, BenchCommand
from .decode import decode_table, plot_decode, run_decode_benchmark
from .instructions import instructions_table, run_instructions_benchmark
from .kernel import gate_lines, kernel_table, plot_kernel, run_kernel_benchmark
from .model import model_table, plot_model, run_model_benchmark
from .needle import needle_table, plot_needle, run_needle_benchmark
from .ruler import plot_ruler, ruler_notes, ruler_table, run_ruler_benchmark
from .serve import plot_serve, run_serve_benchmark, serve_table
from .tasks import run_tasks_benchmark, tasks_table

__all__ = ["BENCHMARKS", "Benchmark", "plotted_benchmarks"]


@dataclass(frozen=True)
class Benchmark:
    """One ``focus bench NAME`` benchmark: its ``command`` line and its functions.

    - ``run(config) -> dict``: the JSON-able result of ``command.settings`` ``config`` (it
      sets ``config.threads`` itself where the settings have it); with ``checkpoint`` true
      it also takes ``checkpoint=``, a function it calls with the result so far after every
      cell, which ``focus bench NAME`` writes to ``--json`` (an interrupted run keeps what
      it measured).
    - ``table(result) -> str``: the markdown table ``focus bench NAME`` prints and a
      study's report shows.
    - ``plot(result, path)``: a PNG of the result at ``path`` (None: the benchmark does not
      plot; else its settings have ``plot`` beside ``json``, the PNG's path).
    - ``notes(result) -> list[str]``: lines printed after the table (None: none).

    Raises:
        TypeError: on construction, a function that is not callable (a
            ``"module:function"`` string, say), naming the benchmark and the part.
    """

    command: BenchCommand
    run: Callable[..., dict[str, Any]]
    table: Callable[[dict[str, Any]], str]
    plot: Callable[[dict[str, Any], Any], Any] | None = None
    notes: Callable[[dict[str, Any]], list[str]] | None = None
    checkpoint: bool = False

    def __post_init__(self) -> None:
        for part in ("run", "table", "plot", "notes"):
            function = getattr(self, part)
            if not (callable(function) or (function is None and part in ("plot", "notes"))):
                raise TypeError(f"Benchmark {self.name!r}: {part} {function!r}; expected a "
                                "function")  # fmt: skip

    @property
    def name(self) -> str:
        """``focus bench NAME``'s name (of :attr:`command`)."""
        return self.command.name

    @property
    def settings(self) -> type:
        """The settings class (of :attr:`command`)."""
        return self.command.settings

    @property
    def required(self) -> tuple[str, ...]:
        """The settings that must be given (of :attr:`command`)."""
        return self.command.required

    @property
    def shape(self) -> Any:
        """What :attr:`table` and :attr:`plot` read of a result (of :attr:`command`)."""
        return self.command.shape


def plotted_benchmarks() -> list[str]:
    """The names of the benchmarks with a plot, in :data:`BENCHMARKS` order."""
    return [name for name, benchmark in BENCHMARKS.items() if benchmark.plot is not None]


#: every benchmark by name, in the order of :data:`~.commands.BENCH_COMMANDS`
BENCHMARKS: dict[str, Benchmark] = {benchmark.name: benchmark for benchmark in (
    Benchmark(
        BENCH_COMMANDS["kernel"],
        run=run_kernel_benchmark,
        table=kernel_table,
        plot=plot_kernel,
        notes=gate_lines,
    ),
    Benchmark(
        BENCH_COMMANDS["model"],
        run=run_model_benchmark,
        table=model_table,
        plot=plot_model,
    ),
    Benchmark(
        BENCH_COMMANDS["decode"],
        run=run_decode_benchmark,
        table=decode_table,
        plot=plot_decode,
    ),
    Benchmark(
        BENCH_COMMANDS["needle"],
        run=run_needle_benchmark,
        table=needle_table,
        plot=plot_needle,
        checkpoint=True,
    ),
    Benchmark(
        BENCH_COMMANDS["retrieval-layers"],
        run=rank_retrieval_layers,
        table=retrieval_layers_table,
    ),
    Benchmark(
        BENCH_COMMANDS["tasks"],
        run=run_tasks_benchmark,
        table=tasks_table,
    ),
    Benchmark(
        BENCH_COMMANDS["ruler"],
        run=run_ruler_benchmark,
        table=ruler_table,
        plot=plot_ruler,
        notes=ruler_notes,
        checkpoint=True,
    ),
    Benchmark(
        BENCH_COMMANDS["instructions"],
        run=run_instructions_benchmark,
        table=instructions_table,
    ),
    Benchmark(
        BENCH_COMMANDS["serve"],
        run=run_serve_benchmark,
        table=serve_table,
        plot=plot_serve,
        checkpoint=True,
    ),
)}  # fmt: skip
