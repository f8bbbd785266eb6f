"""``focus bench plot`` and ``focus bench merge`` on result files that are not what they
should be: each refused on one line naming the file and what was expected (exit status 1),
never a traceback and never a silent success that writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from focus_attention import cli
from focus_attention.bench.registry import BENCHMARKS
from focus_attention.bench.results import draw, read_result
from focus_attention.experiments.study import fill, load_study
from focus_attention.utils.io import UnreadableFileError, shape_mismatch

STUDIES = Path(__file__).resolve().parents[2] / "experiments"

KERNEL = {
    "benchmark": "kernel",
    "config": {"num_groups": 4, "window": 8, "num_heads": 2, "num_key_value_heads": 1, "head_dim": 8},  # fmt: skip
    "rows": [{"N": n, "top_k": 1, "dense_s": 0.2, "sparse_s": 0.1, "speedup": 2.0, "density": 0.4,
              "ideal_speedup": 2.5, "efficiency": 0.8, "dense_peak_bytes": None,
              "sparse_peak_bytes": 1024} for n in (64, 128)],
}  # fmt: skip


def _without(data, key):
    return {k: v for k, v in data.items() if k != key}


BAD = {
    "a JSON list": ([KERNEL], "the document is a JSON array, not a JSON object"),
    "a kernel result without rows": (
        _without(KERNEL, "rows"),
        "no key 'rows'; expected a 'kernel' result",
    ),  # fmt: skip
    "a row without its speed-up": (
        {**KERNEL, "rows": [_without(KERNEL["rows"][0], "speedup")]},
        "rows[0]: no key 'speedup'",
    ),  # fmt: skip
    "no benchmark named": (_without(KERNEL, "benchmark"), "no key 'benchmark'"),
    "an unknown benchmark": (
        {**KERNEL, "benchmark": "kernels"},
        "names the benchmark 'kernels'; expected one of kernel, model",
    ),  # fmt: skip
    "a merged file with no parts": (
        {"benchmark": "kernel", "merged": True, "parts": []},
        "a merged result with no parts; expected a merged file",
    ),  # fmt: skip
    "a merged file without parts": (
        {"benchmark": "kernel", "merged": True},
        "a merged result with no parts",
    ),  # fmt: skip
    "a merged part without rows": (
        {
            "benchmark": "kernel",
            "merged": True,
            "parts": [KERNEL, _without(KERNEL, "rows")],
        },  # fmt: skip
        "parts[1]: no key 'rows'",
    ),
    "parts of two benchmarks": (
        {
            "benchmark": "kernel",
            "merged": True,
            "parts": [KERNEL, {"benchmark": "needle", "accuracy": {}}],
        },
        "parts of several benchmarks ['kernel', 'needle']",
    ),  # fmt: skip
}


@pytest.mark.parametrize("command", ["plot", "merge"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_file_that_is_no_result_is_refused_on_one_line(tmp_path, capsys, command, case):
    data, why = BAD[case]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(data))
    out = tmp_path / ("merged.json" if command == "merge" else "png")
    argv = ["bench", command, "--results", str(path), "--json" if command == "merge" else "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"focus: error: {path}: ") and why in err and "expected" in err, err
    assert err.count("\n") == 1 and not out.exists()


@pytest.mark.parametrize("command", ["plot", "merge"])
def test_a_damaged_file_is_refused_on_one_line(tmp_path, capsys, command):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(KERNEL)[:50])
    argv = ["bench", command, "--results", str(path), *(["--json", str(tmp_path / "m.json")] if command == "merge" else [])]  # fmt: skip
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.startswith(f"focus: error: {path}: not valid JSON")


def test_a_good_result_is_plotted_and_merged(tmp_path, capsys):
    path = tmp_path / "kernel.json"
    path.write_text(json.dumps(KERNEL))
    assert cli.main(["bench", "merge", "--results", str(path), str(path), "--json", str(tmp_path / "m.json")]) == 0  # fmt: skip
    assert len(read_result(tmp_path / "m.json")["parts"]) == 2
    assert cli.main(["bench", "plot", "--results", str(tmp_path / "m.json")]) == 0
    assert (tmp_path / "m-1.png").stat().st_size > 0 and (tmp_path / "m-2.png").is_file()


def test_a_shape_the_declaration_misses_is_still_named(tmp_path):
    """A result that its plot still cannot read (a key the declaration leaves out) is
    refused naming the file, not with a traceback."""
    path = tmp_path / "kernel.json"
    with pytest.raises(UnreadableFileError, match=rf"{path}: a result .*plot_kernel cannot read \(KeyError"):  # fmt: skip
        draw(path, BENCHMARKS["kernel"].plot, {"rows": KERNEL["rows"]}, tmp_path / "k.png")


def _shipped_results():
    """``(benchmark, path, result)`` of every result the shipped studies' benchmark steps
    hold."""
    found = []
    for config in sorted(STUDIES.glob("*/config.toml")):
        study = load_study(config.parent)
        for step in study.steps:
            if step.result is None or step.command[0] != "bench" or step.command[1] not in BENCHMARKS:  # fmt: skip
                continue
            path = Path(fill(step.result, study.paths()))
            if path.is_file():
                found.append((step.command[1], path, json.loads(path.read_text())))
    return found


def test_the_shipped_results_have_their_benchmarks_shapes():
    """The declarations are not stricter than the results the studies hold (which their
    reports show), and each renders as its table."""
    shipped = _shipped_results()
    assert len(shipped) >= 50 and len({name for name, _, _ in shipped}) >= 6
    for name, path, result in shipped:
        for part in result["parts"] if result.get("merged") else [result]:
            assert shape_mismatch(part, BENCHMARKS[name].shape) is None, path
            table = draw(path, BENCHMARKS[name].table, part)
            assert isinstance(table, str) and table.strip(), path
