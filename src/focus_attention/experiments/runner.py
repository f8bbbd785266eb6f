"""Run a study (:mod:`focus_attention.experiments.study`) and resume it where it stopped.

Each step runs in order, unless its result tells it need not:

- ``done``: its result file records, under ``"experiment"``, the same command, settings
  and environment variables as ``config.toml`` now, and the same runs folder where its
  settings use ``{runs}`` (:func:`~.study.recorded_differences`); skipped.
- ``kept``: its result file has no record of the settings that made it (measured before the
  study's runner existed, or a file that is no JSON object), or a record without the runs
  folder its ``{runs}`` settings need; skipped and never overwritten by a plain run:
  ``--rerun STEP`` recomputes it.
- ``resume``: its result records an unfinished run (:func:`unfinished_result`: a training
  stopped by Ctrl-C, a benchmark stopped before its last cell; for a ``train`` step, any
  result that does not say it finished all its steps,
  :func:`~focus_attention.training.outputs.train_result_unfinished`, such as an older
  release's without its ``interrupted`` flag), or the runner started the step and it did
  not finish (a failure or a kill before its result was recorded: the study's
  ``results/.started.json`` still names it); it runs again, never kept.
- ``run``: no result yet. ``rerun``: a result recorded with other settings (or another runs
  folder), a result file that cannot be read (empty, truncated, not JSON: the reason names
  it), or a step named by ``--rerun``. ``always``: a ``report`` step (it only reads
  results) or a step without a result file.

A run (not a dry run) holds the study's lock (``results/.focus-sweep.lock``) while it runs:
a second run of the same study at the same time refuses at once, naming the first.

A step that runs gets its own process when it has variables (also under ``--no-isolate``);
one whose ``adapter``, ``init_adapter`` or ``export`` setting names a ``{runs}`` path that
does not exist stops the run before it starts, naming the path. A result the step leaves
behind gets the ``"experiment"`` record: the study, the step, its command, settings (as
written), variables, runs folder and command line, library versions, hardware and the git
commit (:func:`focus_attention.utils.env.environment`). A step that fails stops the run; the
steps before it keep their results, so the next run starts at it. A ``train`` step to run or
resume whose ``out`` holds a checkpoint was interrupted: it runs with ``--resume`` instead of
``--overwrite`` and continues from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..training.outputs import latest_checkpoint, train_result_unfinished
from ..utils.checks import bad
from ..utils.env import environment, library_versions
from ..utils.io import (
    UnreadableFileError,
    exclusive_lock,
    read_json_file,
    read_json_record,
    write_json_atomic,
)
from .report import write_report
from .settings import StudyConfig
from .study import (
    Step,
    Study,
    check_study,
    fill,
    load_study,
    recorded_differences,
    runs_folder,
    step_argv,
)

__all__ = [
    "RECORD_KEY",
    "STARTED_NAME",
    "StudyConfig",
    "missing_inputs",
    "resumed",
    "run_study",
    "step_plan",
    "step_status",
    "unfinished_result",
]

#: the key of a result file that records the step that wrote it
RECORD_KEY = "experiment"
#: step statuses (module docstring): done and kept are skipped, the others run
STATUSES = ("done", "kept", "resume", "run", "rerun", "always")
#: statuses of a step that continues where an earlier run left it (a training resumes)
CONTINUED = ("run", "resume")
#: the file of a study's ``results/`` naming the steps the runner started and has not
#: recorded yet: ``{step name: the result file it is to write}``
STARTED_NAME = ".started.json"
#: the statuses of a step that is skipped
SKIPPED = ("done", "kept")
#: settings that name what a step reads (an adapter, an exported model directory)
INPUT_SETTINGS = ("adapter", "init_adapter", "export")
#: the lock file of a study's ``results/`` that a run holds
LOCK_NAME = ".focus-sweep.lock"
STARTED_EXPECTED = ("the steps a focus sweep started and has not recorded (a JSON object of "
                    "step names to result files); delete it only when no run of the study is "
                    "in progress")  # fmt: skip


def _read_result(path: Path, step: Step) -> Any:
    """The parsed result file of ``step``.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: empty, truncated, not JSON, a directory or unreadable.
    """
    return read_json_file(path, f"the JSON result of step {step.name!r}")


def unfinished_result(data: dict[str, Any]) -> str | None:
    """Why the result ``data`` (a step's JSON object) records an unfinished run: a training's
    ``extra.interrupted`` (``focus train`` writes its output when Ctrl-C stops it) or
    ``"complete": false`` (the long benchmarks rewrite their result after every cell);
    None for a finished one."""
    extra = data.get("extra")
    if isinstance(extra, dict) and extra.get("interrupted") is True:
        config = data.get("config") if isinstance(data.get("config"), dict) else {}
        return (f"its result records a training interrupted at step {data.get('steps')} of "
                f"{config.get('steps', '?')}")  # fmt: skip
    if data.get("complete") is False:
        return "its result is incomplete (its run stopped before the last cell)"
    return None


def _started_path(study: Study) -> Path:
    return study.directory / "results" / STARTED_NAME


def _started(study: Study) -> dict[str, Any]:
    """The steps the runner started and has not recorded (:data:`STARTED_NAME`; ``{}``
    when there is none).

    Raises:
        UnreadableFileError: a damaged file, or one that is no JSON object of strings.
    """
    path = _started_path(study)
    if not path.is_file() and not path.is_dir():
        return {}
    return read_json_record(path, STARTED_EXPECTED, {"*": str})


def _mark_started(study: Study, step: Step, result: str | None) -> None:
    """Name ``step`` (and the result file it is to write) in :data:`STARTED_NAME`; with
    ``result`` None, remove it from there (the step finished and its result is recorded)."""
    started = _started(study)
    if result is None:
        started.pop(step.name, None)
    else:
        started[step.name] = result
    if started or _started_path(study).is_file():
        write_json_atomic(_started_path(study), started)


def _planned_steps(step: Step) -> int | None:
    """The step count a ``train`` step's settings give (None: not among them)."""
    steps = step.settings.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _unfinished(study: Study, step: Step, path: Path, data: Any) -> str | None:
    """Why ``step``'s result at ``path`` (parsed: ``data``) is not the finished step's
    output, or None."""
    why = unfinished_result(data) if isinstance(data, dict) else None
    if why is None and step.command == ("train",):
        reasons = train_result_unfinished(data, _planned_steps(step))
        why = f"its result is not a finished training ({'; '.join(reasons)})" if reasons else None
    if why is None and _started(study).get(step.name) == str(path):
        why = "its last run stopped before its result was recorded"
    if why is None:
        return None
    return why + ("; it continues from its newest checkpoint" if step.command == ("train",)
                  else "; it runs again")  # fmt: skip


def step_plan(
    study: Study, step: Step, runs: str = "runs", forced: bool = False
) -> tuple[str, str]:
    """What a run would do with ``step`` and why: ``(status, reason)``, the status one of
    :data:`STATUSES` (module docstring), the reason a short phrase (``"no result yet
    (results/x.json)"``, ``"settings changed: adapter, top_k"``, ``"forced by --rerun"``).

    Args:
        study: the study of ``step``.
        step: the step.
        runs: the runs folder (``{runs}``).
        forced: the step is named by ``--rerun``: it runs even when its result is there.
    """
    if step.result is None:
        return "always", ("rebuilt from the results on every run" if step.command == ("report",)
                          else "it records no result file, so it runs every time")  # fmt: skip
    path = Path(fill(step.result, study.paths(runs)))
    if not (path.exists() or path.is_symlink()):
        return "run", f"no result yet ({path})" + ("; named by --rerun" if forced else "")
    if forced:
        return "rerun", f"forced by --rerun (overwrites {path})"
    try:
        data = _read_result(path, step)
    except (OSError, UnreadableFileError) as err:
        return "rerun", f"{err}: it runs again"
    unfinished = _unfinished(study, step, path, data)
    if unfinished is not None:
        return "resume", unfinished
    keep = f"; --rerun {step.name} to recompute it"
    if not isinstance(data, dict):
        return "kept", f"{path} is no JSON object" + keep
    record = data.get(RECORD_KEY)
    if not isinstance(record, dict):
        return "kept", "result has no settings record" + keep
    changed = recorded_differences(step, record, runs)
    if changed is None:
        return "kept", "result records no runs folder for its {runs} settings" + keep
    if changed:
        return "rerun", "settings changed: " + ", ".join(changed)
    return "done", "recorded with these settings"


def step_status(study: Study, step: Step, runs: str = "runs") -> str:
    """The status of :func:`step_plan` (a step not forced by ``--rerun``)."""
    return step_plan(study, step, runs)[0]


def missing_inputs(study: Study, step: Step, runs: str = "runs") -> list[tuple[str, str]]:
    """The inputs of ``step`` under the runs folder that do not exist: ``(setting, path)``
    for each :data:`INPUT_SETTINGS` setting that uses ``{runs}`` and whose filled-in path
    names no file or directory now."""
    paths = study.paths(runs)
    found = [(key, fill(value, paths)) for key, value in step.settings.items()
             if key in INPUT_SETTINGS and isinstance(value, str) and "{runs}" in value]  # fmt: skip
    return [(key, path) for key, path in found if not Path(path).exists()]


def _record(study: Study, step: Step, argv: list[str], runs: str) -> dict[str, Any]:
    return {"study": study.name, "step": step.name, "command": step.command_text(),
            "settings": step.settings, "variables": step.variables, "runs": runs_folder(runs),
            "argv": argv, "versions": library_versions(), "environment": environment()}  # fmt: skip


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
    try:
        data = _read_result(path, step)
    except (OSError, UnreadableFileError) as err:
        raise RuntimeError(
            f"{study.name}: step {step.name} finished without writing its result: {err}"
        ) from err
    if not isinstance(data, dict):
        raise RuntimeError(f"{study.name}: step {step.name} finished without writing a JSON "
                           f"object to {path}")  # fmt: skip
    data[RECORD_KEY] = _record(study, step, argv, runs)
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
    """``step`` as it continues: a ``train`` step without its result, or whose result records
    an unfinished run (status ``run`` or ``resume``), whose ``out`` holds a checkpoint (an
    interrupted training) with ``resume`` instead of ``overwrite``; any other step
    unchanged."""
    out = step.settings.get("out")
    if (
        step.command != ("train",)
        or not isinstance(out, str)
        or step_status(study, step, runs) not in CONTINUED
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
    """Run ``step`` and record its result; the step is named in :data:`STARTED_NAME` from
    its start until its result is recorded."""
    if step.command == ("report",):
        write_report(study, step, config.runs)
        return
    result = None if step.result is None else fill(step.result, study.paths(config.runs))
    if result is not None:
        _mark_started(study, step, str(Path(result)))
    if step.command == ("script",):
        argv = _run_script(study, step, config.runs)
    else:
        argv = _run_focus(study, step, config, main)
    if step.result is not None:
        _stamp(study, step, argv, config.runs)
        _mark_started(study, step, None)


def _selected(study: Study, config: StudyConfig) -> list[Step]:
    """The steps a run takes (``config.only``, else all), checking ``config.rerun``.

    Raises:
        ValueError: an unknown step (the message lists the steps), a ``--rerun`` step that
            ``--only`` leaves out.
    """
    steps = [study.step(n) for n in config.only] if config.only else list(study.steps)
    for name in config.rerun or ():
        if study.step(name) not in steps:
            raise ValueError(f"--rerun {name}: not among the steps --only selects "
                             f"({', '.join(s.name for s in steps)})")  # fmt: skip
    return steps


def _made_by(study: Study, steps: list[Step], runs: str) -> set[str]:
    """The ``out`` directories of ``steps`` (what they make for the steps after them)."""
    paths = study.paths(runs)
    return {fill(s.settings["out"], paths) for s in steps if isinstance(s.settings.get("out"), str)}


def _missing_note(study: Study, step: Step, runs: str, made: set[str] | None = None) -> str:
    """What ``step`` reads under the runs folder and is not there (:func:`missing_inputs`),
    leaving out what an earlier step makes (``made``, for a dry run): ``"needs adapter
    /x/austen, not found under the runs folder --runs /x"``; ``""`` when nothing is
    missing."""
    missing = [f"{key} {path}" for key, path in missing_inputs(study, step, runs)
               if path not in (made or ())]  # fmt: skip
    if not missing:
        return ""
    folder = "" if Path(runs).is_dir() else " (that folder does not exist)"
    return f"needs {', '.join(missing)}, not found under the runs folder --runs {runs}{folder}"


def _say(study: Study, step: Step, status: str, why: str, dry_run: bool) -> None:
    """One line on stderr: what happens to ``step`` and why."""
    if status == "done":
        what = f"skipped ({why})"
    elif status == "kept":
        what = f"kept: {why}"
    else:
        what = ("would " if dry_run else "") + ("run" if status == "always" else status)
        what += f": {why}"
    print(f"focus sweep: {study.name}: {step.name} ({step.command_text()}): {what}",
          file=sys.stderr)  # fmt: skip


def run_study(
    config: StudyConfig, parser: argparse.ArgumentParser, main: Callable[[list[str]], int]
) -> dict[str, str]:
    """Run the study ``config.study`` (module docstring), or with ``config.dry_run`` only
    check it and report what would run and why. Each step's status and reason
    (:func:`step_plan`) is printed to stderr.

    Args:
        config: the run's settings.
        parser: the ``focus`` argument parser; every step's command line is checked with it
            before the first step runs.
        main: runs one ``focus`` command line in this process (``config.isolate`` False).

    Returns:
        ``{step name: status}``: the status of each selected step before the run
        (``done`` and ``kept`` steps were skipped).

    Raises:
        ValueError: no study given, an invalid study file or step (:func:`~.study.
            check_study`), an unknown step in ``config.only`` or ``config.rerun``.
        FileNotFoundError: no such study directory or no config.toml in it (naming
            ``--study``); a step to run whose ``{runs}`` input is missing (the steps before
            it keep their results).
        UnreadableFileError: a damaged ``results/.started.json`` (naming it).
        FolderInUseError: another run of the study holds its lock (a ``RuntimeError``
            naming that process).
        RuntimeError: a step that failed or wrote no result (the steps before it keep
            theirs).
    """
    if config.study is None:
        raise bad("StudyConfig", "study", None, "a study directory (experiments/<study>)")
    try:
        study = load_study(config.study)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"--study {err}") from None
    check_study(study, parser)
    steps = _selected(study, config)
    if config.dry_run:
        return _run_steps(study, steps, config, main)
    owner = f"focus sweep --study {study.directory}"
    with exclusive_lock(study.directory / "results" / LOCK_NAME, owner):
        return _run_steps(study, steps, config, main)


def _run_steps(study: Study, steps: list[Step], config: StudyConfig, main: Callable[[list[str]], int]) -> dict[str, str]:  # fmt: skip
    """Plan ``steps``, then run those that need it (or, with ``config.dry_run``, say what
    would run): :func:`run_study` once the study is checked (and held)."""
    forced = set(config.rerun or ())
    plan = {s.name: step_plan(study, s, config.runs, s.name in forced) for s in steps}
    for i, step in enumerate(steps):
        status, why = plan[step.name]
        if status in SKIPPED:
            _say(study, step, status, why, config.dry_run)
            continue
        if config.dry_run:
            missing = _missing_note(
                study, step, config.runs, _made_by(study, steps[:i], config.runs)
            )
            _say(study, step, status, why + (f"; {missing}" if missing else ""), True)
            continue
        missing = _missing_note(study, step, config.runs)
        if missing:
            raise FileNotFoundError(f"{study.name}: step {step.name} {missing}: give --runs the "
                                    "folder that holds it, or run what makes it first")  # fmt: skip
        _say(study, step, status, why, False)
        _run_step(study, step, config, main)
    return {name: status for name, (status, _) in plan.items()}
