"""The benchmark registry (focus_attention.bench.registry): every row holds the functions
that run it, one row per command line of focus_attention.bench.commands, in its order;
``focus bench`` lists the rows in order, and a benchmark added as a module plus its two rows
(a toy, here) runs as ``focus bench toy``, writes its JSON and plot, and gets its table and
plot in a study's report."""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import pytest

from focus_attention.bench import commands, registry
from focus_attention.bench.commands import BENCH_COMMANDS, BenchCommand
from focus_attention.bench.registry import BENCHMARKS, Benchmark, plotted_benchmarks
from focus_attention.cli import build_parser, main
from focus_attention.experiments import StudyConfig, run_study

#: a benchmark's module, as a contributor would write it: settings, run, table, plot
TOY_MODULE = '''
"""focus bench toy: the squares of 1..count."""

from __future__ import annotations

import json
from dataclasses import field
from pathlib import Path

from focus_attention.settings import PlotFile, ResultFile, settings_class


@settings_class()
class ToyBenchConfig(PlotFile, ResultFile):
    """Settings of focus bench toy."""

    count: int = field(default=3, metadata={"help": "numbers squared"})


def run_toy(config):
    rows = [{"n": n, "square": n * n} for n in range(1, config.count + 1)]
    return {"benchmark": "toy", "config": {"count": config.count}, "rows": rows}


def toy_table(result):
    rows = [f"| {r['n']} | {r['square']} |" for r in result["rows"]]
    return "\\n".join(["| n | square |", "|---:|---:|", *rows])


def plot_toy(result, path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(b"\\x89PNG\\r\\n\\x1a\\n" + json.dumps(result["rows"]).encode())
'''

#: a study of one toy step and its report
TOY_STUDY = """
[study]
title = "Toy study"

[[steps]]
name = "squares"
command = "bench toy"
[steps.settings]
count = 4
json = "{results}/squares.json"

[[steps]]
name = "report"
command = "report"
"""


def test_the_registry_has_a_row_per_command_line_in_order():
    assert list(BENCHMARKS) == list(BENCH_COMMANDS)
    assert all(row.command is BENCH_COMMANDS[name] for name, row in BENCHMARKS.items())


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_row_holds_its_functions(name):
    benchmark = BENCHMARKS[name]
    assert ("checkpoint" in inspect.signature(benchmark.run).parameters) == benchmark.checkpoint
    for function in (benchmark.run, benchmark.table, benchmark.plot, benchmark.notes):
        assert function is None or (callable(function) and not isinstance(function, str))
    if benchmark.plot is not None:  # a plotted benchmark says where the PNG goes
        assert "plot" in {f for f in benchmark.settings.__dataclass_fields__}


def test_focus_bench_lists_the_rows_then_the_result_commands():
    parser = build_parser("bench")
    bench = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    listed = next(a for a in bench._actions if a.dest == "bench_command")
    assert list(listed.choices) == [*BENCHMARKS, "merge", "plot"]
    helps = {choice.dest: choice.help for choice in listed._choices_actions}
    assert all(helps[name] == row.help for name, row in BENCH_COMMANDS.items())
    assert plotted_benchmarks() == ["kernel", "model", "decode", "needle", "ruler", "serve"]


def test_a_row_holds_functions_not_their_names():
    command = BenchCommand(name="toy", settings=object, help="", description="")
    with pytest.raises(TypeError, match="toy.*table 'toy_bench:toy_table'; expected a function"):
        Benchmark(command, run=print, table="toy_bench:toy_table")


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy benchmark: its module on the path and its two rows, its command line and its
    functions, nothing else."""
    (tmp_path / "toy_bench.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toy_bench")
    command = BenchCommand(
        name="toy",
        settings=module.ToyBenchConfig,
        help="the squares of 1..count",
        description="Squares the numbers 1..count.",
    )
    row = Benchmark(command, run=module.run_toy, table=module.toy_table, plot=module.plot_toy)
    monkeypatch.setitem(commands.BENCH_COMMANDS, "toy", command)
    monkeypatch.setitem(registry.BENCHMARKS, "toy", row)
    yield row
    sys.modules.pop("toy_bench", None)


def test_a_toy_benchmark_runs_writes_its_json_and_plot(toy, tmp_path, capsys):
    out = tmp_path / "out" / "toy.json"
    assert main(["bench", "toy", "--count", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| n | square |\n|---:|---:|\n| 1 | 1 |\n| 2 | 4 |\n| 3 | 9 |\n")
    assert f"wrote {out}\n" in printed and f"wrote {out.with_suffix('.png')}\n" in printed
    assert json.loads(out.read_text())["rows"][-1] == {"n": 3, "square": 9}
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert main(["bench", "plot", "--results", str(out), "--out", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "toy.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit):
        main(["bench", "toy", "--help"])
    assert "--count COUNT" in capsys.readouterr().out


def test_a_toy_benchmark_is_in_its_studys_report(toy, tmp_path):
    study = tmp_path / "toy-study"
    study.mkdir()
    (study / "config.toml").write_text(TOY_STUDY)
    config = StudyConfig(study=str(study), runs=str(tmp_path / "runs"), isolate=False)
    assert run_study(config, build_parser("bench"), main) == {"squares": "run", "report": "always"}
    report = (study / "results" / "report.md").read_text()
    assert "## squares: `focus bench toy`" in report
    assert "| n | square |\n|---:|---:|\n| 1 | 1 |\n| 2 | 4 |\n| 3 | 9 |\n| 4 | 16 |" in report
    assert (study / "results" / "squares.png").read_bytes().startswith(b"\x89PNG")
