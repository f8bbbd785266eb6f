"""``scripts/gpu-check.sh``, the one prepared GPU run: valid bash, every ``focus`` command it
runs accepted by the command's parser and settings (checked from its dry run, with a CUDA
device pretended), at most 8 result files, all JSON; and the record it keeps of the run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from focus_attention import cli
from focus_attention.bench import run_record
from focus_attention.bench.registry import BENCHMARKS
from focus_attention.bench.settings import MergeResultsConfig
from focus_attention.cli.flags import command_config
from focus_attention.ops.sparse import triton_compile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
#: the settings of each ``focus bench`` command the script runs
SETTINGS = {**{name: row.settings for name, row in BENCHMARKS.items()}, "merge": MergeResultsConfig}


def _dry_run(tmp_path: Path, **env: str) -> list[str]:
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, check=True,
                         env={**os.environ, "DRY_RUN": "1", "OUT": str(out), **env})  # fmt: skip
    assert not out.exists()  # a dry run writes nothing
    return run.stdout.splitlines()


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_focus_command_parses_and_builds_its_settings(tmp_path, monkeypatch):
    lines = _dry_run(tmp_path, FOCUS_ADAPTER="runs/austen-4k")
    commands = [shlex.split(line) for line in lines if line.startswith("focus ")]
    names = [words[2] for words in commands]
    assert names == ["kernel", "kernel", "merge", "model", "model", "merge", "decode", "decode",
                     "decode", "merge", "decode", "serve"]  # fmt: skip
    parser = cli.build_parser()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU machine's view
    for words in commands:
        args = parser.parse_args(words[1:])
        config = command_config(args, SETTINGS[args.bench_command], f"bench.{args.bench_command}")
        if args.bench_command == "decode":
            assert config.cuda_graphs and config.kv_cache == "static"
            assert config.batch_size == (1, 16) and config.resolved_device == "cuda"
        if args.bench_command in ("kernel", "model", "decode", "serve"):
            assert (config.device, config.dtype) == ("cuda", "bfloat16")


def test_the_run_writes_at_most_eight_files_all_json(tmp_path):
    out = str(tmp_path / "out")
    lines = _dry_run(tmp_path, FOCUS_ADAPTER="runs/austen-4k")
    written = {"check.json"}
    for line in lines:
        words = shlex.split(line)
        flags = dict(zip(words, words[1:], strict=False))
        for flag in ("--json", "--plot"):
            if flags.get(flag, "").startswith(out):
                written.add(Path(flags[flag]).name)
        if words[0] == "focus" and flags.get("--json", "").startswith(out) and words[2] != "merge":
            assert "--plot" in flags and not flags["--plot"].startswith(out), line  # no PNG in $OUT
    assert "compile.json" in written
    assert len(written) <= 8 and all(name.endswith(".json") for name in written), written
    without = _dry_run(tmp_path)
    assert not any("--adapter" in line for line in without)
    assert len([line for line in without if line.startswith("focus ")]) == 10


def test_the_compile_table_of_the_device_comes_first(tmp_path):
    """The run's first step compiles the kernels for the device's own capability (no
    ``--capability``: the CUDA device's), prints the table and writes it into $OUT."""
    first = _dry_run(tmp_path)[0]
    name, python, words = first.split()[0], first.split()[1], shlex.split(first)[2:]
    assert name == "compile:" and python == "python3"
    assert words[:2] == ["-m", "focus_attention.ops.sparse.triton_compile"]
    args = triton_compile.build_parser().parse_args(words[2:])
    assert args.capability is None and args.set == "models"
    assert args.json == str(tmp_path / "out" / "compile.json")
    assert "SHOW=all run compile" in SCRIPT.read_text(encoding="utf-8")


def test_the_gpu_tests_step_runs_every_file_with_gpu_tests(tmp_path):
    step = next(line for line in _dry_run(tmp_path) if line.startswith("gpu-tests:"))
    files = {word for word in shlex.split(step) if word.startswith("tests/")}
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
              if "mark.gpu" in p.read_text(encoding="utf-8")}  # fmt: skip
    assert "-m" in step and files == marked and "tests/bench/test_gpu_bench.py" in files


def test_pytest_outcomes_read_a_verbose_log_even_cut_short():
    log = (
        "tests/ops/test_flex.py::test_a PASSED                         [ 10%]\n"
        "tests/ops/test_flex.py::test_b[bf16-2] FAILED                 [ 20%]\n"
        "tests/bench/test_speed.py::test_c SKIPPED (needs a CUDA device) [ 30%]\n"
        "tests/bench/test_speed.py::test_d "
    )
    assert run_record.pytest_outcomes(log) == {
        "passed": ["tests/ops/test_flex.py::test_a"],
        "failed": ["tests/ops/test_flex.py::test_b[bf16-2]"],
        "skipped": ["tests/bench/test_speed.py::test_c"],
    }


def test_the_run_record_gathers_hardware_tests_and_steps(tmp_path):
    (tmp_path / "hardware.json").write_text(json.dumps({"devices": [{"name": "GPU X"}]}))
    (tmp_path / "gpu-tests.files").write_text("tests/a.py\ntests/b.py\n")
    (tmp_path / "gpu-tests.log").write_text("tests/a.py::test_x PASSED [100%]\n")
    (tmp_path / "steps.tsv").write_text("gpu-tests\t0\t12\t75\nkernel-smollm2\t124\t45\t45\n")
    (tmp_path / "kernel-smollm2.log").write_text("\n".join(f"line {i}" for i in range(100)))
    target = tmp_path / "check.json"
    assert run_record.main(["record", str(tmp_path), str(target)]) == 0
    record = json.loads(target.read_text())
    assert record["hardware"]["devices"][0]["name"] == "GPU X"
    assert record["tests"] == {"files": ["tests/a.py", "tests/b.py"],
                               "outcomes": {"passed": ["tests/a.py::test_x"]}}  # fmt: skip
    first, second = record["steps"]
    assert (first["name"], first["status"], first["seconds"], first["timed_out"]) == ("gpu-tests", "0", 12, False)  # fmt: skip
    assert second["timed_out"] and second["output_tail"][-1] == "line 99"
    assert len(second["output_tail"]) == run_record.LOG_TAIL_LINES
    assert run_record.main(["nothing"]) == 2


def test_the_hardware_record_names_the_versions(tmp_path):
    target = tmp_path / "hardware.json"
    assert run_record.main(["hardware", str(target)]) == 0
    record = json.loads(target.read_text())
    assert record["versions"]["torch"] == torch.__version__ and "triton" in record["versions"]
    assert record["environment"]["git_commit"] is not None
    assert len(record["devices"]) == torch.cuda.device_count()


@pytest.mark.parametrize("flag", ["--results", "--json"])
def test_merge_needs_results_and_a_file(flag, capsys):
    argv = ["bench", "merge", "--results", "a.json", "--json", "b.json"]
    index = argv.index(flag)
    assert cli.main(argv[:index] + argv[index + 2 :]) != 0
    assert f"{flag} is required" in capsys.readouterr().err
