"""Run a study (:mod:`focus_attention.experiments.study`) and resume it where it stopped.

Each step runs in order. A step whose result file exists and records, under
``"experiment"``, the same command, settings and environment variables as ``config.toml``
now is skipped; any other step runs (one with variables in a subprocess whose environment
has them, also under ``--no-isolate``), and a result it leaves behind gets the
``"experiment"`` record: the study, the step, its command, settings, variables and command
line, library versions, hardware and the git commit
(:func:`focus_attention.utils.env.environment`). A result without the record (measured before
the study existed, or by an interrupted run) or with other settings runs again. A step that
fails stops the run; the steps before it keep their results, so the next run starts at it.
A ``report`` step runs every time (it only reads results). A ``train`` step without its
result whose ``out`` holds a checkpoint was interrupted: it runs with ``--resume`` instead of
``--overwrite`` and continues from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils.checks import bad
from ..utils.io import write_json_atomic
from .study import Step, Study, check_study, fill, load_study, step_argv

__all__ = ["RECORD_KEY", "StudyConfig", "resumed", "run_study", "step_status"]

#: the key of a result file that records the step that wrote it
RECORD_KEY = "experiment"
#: step statuses: skipped (result recorded with these settings), run (no result), rerun
#: (a result without the record or with other settings), always (report, script without
#: result)
STATUSES = ("done", "run", "rerun", "always")


@dataclass
class StudyConfig:
    """Settings of one run of a study; every field is a ``focus sweep`` flag.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    study: str | None = field(
        default=None,
        metadata={"help": "study directory (experiments/<study>): run the steps of its "
                  "config.toml, skipping those whose results are recorded with the same "
                  "settings", "metavar": "DIR"},
    )  # fmt: skip
    only: tuple[str, ...] | None = field(
        default=None, metadata={"help": "run only these steps of the study", "metavar": "STEP"}
    )
    runs: str = field(
        default="runs",
        metadata={"help": "directory of the study's trainings and adapters ({runs} in "
                  "config.toml)"},
    )  # fmt: skip
    dry_run: bool = field(
        default=False,
        metadata={"help": "check every step of the study and print what would run; run "
                  "nothing"},
    )  # fmt: skip
    isolate: bool = field(
        default=True,
        metadata={"help": "run each focus step in a subprocess of this interpreter "
                  "(--no-isolate: in this process, but for steps with variables)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.study is not None and not isinstance(self.study, str):
            raise bad("StudyConfig", "study", self.study, "a directory (str)")
        if self.only is not None and not self.only:
            raise bad("StudyConfig", "only", self.only, "one or more step names")


def _read_result(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_status(study: Study, step: Step, runs: str = "runs") -> str:
    """What a run would do with ``step`` (:data:`STATUSES`): ``done`` when its result file
    records this command and these settings, ``run`` when there is no result, ``rerun`` when
    the result has no record or another one, ``always`` for steps without a result."""
    if step.result is None:
        return "always"
    path = Path(fill(step.result, study.paths(runs)))
    if not path.is_file():
        return "run"
    data = _read_result(path)
    record = data.get(RECORD_KEY) if isinstance(data, dict) else None
    if not isinstance(record, dict):
        return "rerun"
    same = (record.get("command") == step.command_text()
            and record.get("settings") == step.settings
            and record.get("variables", {}) == step.variables)  # fmt: skip
    return "done" if same else "rerun"


def _record(study: Study, step: Step, argv: list[str]) -> dict[str, Any]:
    from ..utils.env import environment, library_versions

    return {"study": study.name, "step": step.name, "command": step.command_text(),
            "settings": step.settings, "variables": step.variables, "argv": argv,
            "versions": library_versions(), "environment": environment()}  # fmt: skip


def _process_environment(step: Step) -> dict[str, str] | None:
    """The environment of a step's subprocess: this one's with the step's variables (None:
    this one's, unchanged)."""
    return {**os.environ, **step.variables} if step.variables else None


def _stamp(study: Study, step: Step, argv: list[str], runs: str) -> None:
    """Add the ``experiment`` record to the step's result file.

    Raises:
        RuntimeError: the step wrote no result file, or not a JSON object.
    """
    path = Path(fill(str(step.result), study.paths(runs)))
    data = _read_result(path) if path.is_file() else None
    if not isinstance(data, dict):
        raise RuntimeError(f"{study.name}: step {step.name} finished without writing a JSON "
                           f"object to {path}")  # fmt: skip
    data[RECORD_KEY] = _record(study, step, argv)
    write_json_atomic(path, data)


def _run_script(study: Study, step: Step, runs: str) -> list[str]:
    paths = study.paths(runs)
    script = study.directory / step.settings["path"]
    argv = [sys.executable, str(script), *fill(list(step.settings.get("args", [])), paths)]
    done = subprocess.run(argv, check=False, env=_process_environment(step))
    if done.returncode != 0:
        raise RuntimeError(f"{study.name}: step {step.name}: {script} exited with status "
                           f"{done.returncode}")  # fmt: skip
    return argv


def resumed(study: Study, step: Step, runs: str = "runs") -> Step:
    """``step`` as it continues: a ``train`` step without its result whose ``out`` holds a
    checkpoint (an interrupted training) with ``resume`` instead of ``overwrite``; any other
    step unchanged."""
    from ..training.outputs import latest_checkpoint

    out = step.settings.get("out")
    if (
        step.command != ("train",)
        or not isinstance(out, str)
        or step_status(study, step, runs) != "run"
    ):
        return step
    if latest_checkpoint(fill(out, study.paths(runs))) is None:
        return step
    settings = {k: v for k, v in step.settings.items() if k != "overwrite"}
    return dataclasses.replace(step, settings={**settings, "resume": True})


def _run_focus(study: Study, step: Step, config: StudyConfig, main: Callable) -> list[str]:
    argv = step_argv(resumed(study, step, config.runs), study.paths(config.runs))
    if config.isolate or step.variables:  # variables need a process of their own
        command = [sys.executable, "-m", "focus_attention.cli", *argv]
        code = subprocess.run(command, env=_process_environment(step)).returncode
    else:
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"{study.name}: step {step.name}: focus {' '.join(argv)} exited "
                           f"with status {code}")  # fmt: skip
    return argv


def _run_step(study: Study, step: Step, config: StudyConfig, main: Callable) -> None:
    from .report import write_report

    if step.command == ("report",):
        write_report(study, step, config.runs)
        return
    if step.command == ("script",):
        argv = _run_script(study, step, config.runs)
    else:
        argv = _run_focus(study, step, config, main)
    if step.result is not None:
        _stamp(study, step, argv, config.runs)


def run_study(
    config: StudyConfig, parser: argparse.ArgumentParser, main: Callable[[list[str]], int]
) -> dict[str, str]:
    """Run the study ``config.study`` (module docstring), or with ``config.dry_run`` only
    check it and report what would run.

    Args:
        config: the run's settings.
        parser: the ``focus`` argument parser; every step's command line is checked with it
            before the first step runs.
        main: runs one ``focus`` command line in this process (``config.isolate`` False).

    Returns:
        ``{step name: status}``: the :func:`step_status` of each selected step before the
        run (``done`` steps were skipped).

    Raises:
        ValueError: no study given, an invalid study file or step (:func:`~.study.
            check_study`), an unknown step in ``config.only``.
        FileNotFoundError: no such study directory.
        RuntimeError: a step that failed or wrote no result (the steps before it keep
            theirs).
    """
    if config.study is None:
        raise bad("StudyConfig", "study", None, "a study directory (experiments/<study>)")
    study = load_study(config.study)
    check_study(study, parser)
    steps = [study.step(n) for n in config.only] if config.only else list(study.steps)
    plan = {s.name: step_status(study, s, config.runs) for s in steps}
    for step in steps:
        status = plan[step.name]
        what = "skipped (recorded with these settings)" if status == "done" else status
        print(f"focus sweep: {study.name}: {step.name} ({step.command_text()}): "
              f"{'would ' + status if config.dry_run and status != 'done' else what}",
              file=sys.stderr)  # fmt: skip
        if status != "done" and not config.dry_run:
            _run_step(study, step, config, main)
    return plan
