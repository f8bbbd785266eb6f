"""The record of a prepared GPU run (``scripts/gpu-check.sh``): the hardware and versions it
ran on, which GPU tests ran and how they ended, and each step's exit status, time and the end
of its output, in one JSON file rewritten after every step (a run stopped early keeps what it
recorded).

``python -m focus_attention.bench.run_record hardware FILE`` writes the hardware record;
``python -m focus_attention.bench.run_record record FOLDER FILE`` gathers the run's record
from the folder the script writes its steps into (``hardware.json``, ``steps.tsv``: one line
``name, exit status, seconds, limit`` per step, and ``NAME.log``, each step's output).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..utils.env import environment, library_versions
from ..utils.io import write_json_atomic

__all__ = ["hardware_record", "pytest_outcomes", "run_record", "main"]

#: distributions the hardware record names beside the results' own
RUN_DISTRIBUTIONS = ("focus-attention", "torch", "transformers", "triton", "numpy", "kernels")
#: a test's outcome line in ``pytest -v`` output
OUTCOME = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
#: lines of each step's output the record keeps (its end)
LOG_TAIL_LINES = 40


def hardware_record() -> dict[str, Any]:
    """The machine: :func:`~focus_attention.utils.env.environment`, library versions, the
    CUDA build and devices (name, memory, multiprocessors, compute capability) and
    ``nvidia-smi``'s report (None where it cannot run)."""
    import torch  # the record step reads the files alone, without torch

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append({"name": props.name, "total_memory": props.total_memory,
                        "multi_processor_count": props.multi_processor_count,
                        "capability": f"{props.major}.{props.minor}"})  # fmt: skip
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        smi = None
    return {"environment": environment(), "versions": library_versions(RUN_DISTRIBUTIONS),
            "cuda_build": torch.version.cuda, "devices": devices, "nvidia_smi": smi}  # fmt: skip


def pytest_outcomes(log: str) -> dict[str, list[str]]:
    """The tests a ``pytest -v`` output reports, by outcome (lower case): ``{"passed": [node
    ids], "failed": [...], ...}``; a run stopped early reports the tests it finished."""
    found: dict[str, list[str]] = {}
    for node, outcome in OUTCOME.findall(log):
        found.setdefault(outcome.lower(), []).append(node)
    return found


def _steps(folder: Path) -> list[dict[str, Any]]:
    """The steps of ``steps.tsv`` with the end of each one's log."""
    table = folder / "steps.tsv"
    steps = []
    for line in table.read_text().splitlines() if table.is_file() else []:
        name, status, seconds, limit = (line.split("\t") + ["", "", "", ""])[:4]
        log = folder / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if log.is_file() else []  # fmt: skip
        steps.append({"name": name, "status": status, "seconds": int(seconds or 0),
                      "limit": int(limit or 0), "timed_out": status in ("124", "137"),
                      "output_tail": tail})  # fmt: skip
    return steps


def run_record(folder: str | Path) -> dict[str, Any]:
    """The record of the run whose steps wrote into ``folder`` (module docstring):
    ``{"hardware", "tests", "steps"}``; ``tests`` holds the outcomes of the GPU tests
    (:func:`pytest_outcomes` of ``gpu-tests.log``) and the test files they ran from
    (``gpu-tests.files``)."""
    folder = Path(folder)
    hardware = folder / "hardware.json"
    tests_log, files = folder / "gpu-tests.log", folder / "gpu-tests.files"
    return {
        "hardware": json.loads(hardware.read_text()) if hardware.is_file() else None,
        "tests": {
            "files": files.read_text().split() if files.is_file() else [],
            "outcomes": pytest_outcomes(tests_log.read_text(errors="replace"))
            if tests_log.is_file()
            else {},  # fmt: skip
        },
        "steps": _steps(folder),
    }


def main(argv: list[str] | None = None) -> int:
    """``hardware FILE`` or ``record FOLDER FILE`` (module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "hardware":
        write_json_atomic(args[1], hardware_record())
        return 0
    if len(args) == 3 and args[0] == "record":
        write_json_atomic(args[2], run_record(args[1]))
        return 0
    print("usage: python -m focus_attention.bench.run_record hardware FILE | record FOLDER FILE",
          file=sys.stderr)  # fmt: skip
    return 2


if __name__ == "__main__":
    sys.exit(main())
