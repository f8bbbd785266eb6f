"""A study: one experiment as data. ``experiments/<study>/config.toml`` names the study and
lists its steps; each step is a ``focus`` sub-command with its settings as a TOML table, a
script of the study run by the same interpreter, or the built-in ``report``.

The file::

    [study]
    title = "Attention kernel speed"          # required
    question = "..."                          # optional text

    [[steps]]
    name = "kernel"                           # required: a file-name-like word, unique
    command = "bench kernel"                  # a focus sub-command, "script" or "report"
    result = "{results}/kernel.json"          # optional: the JSON file the step writes
                                              # (default: its ``json`` setting)
    [steps.settings]                          # the flags: lengths = [1024, 4096] is
    lengths = [1024, 4096]                    # --lengths 1024 4096, window = 128 is
    json = "{results}/kernel.json"            # --window 128, dense = false --no-dense
    [steps.variables]                         # optional: environment variables of the
    FOCUS_NO_EXTENSION = "1"                  # step's process (strings)

String settings (and ``result``) may name three directories: ``{study}`` (the study's
directory), ``{results}`` (its ``results/``) and ``{runs}`` (where trainings and adapters go;
``runs`` unless the run says otherwise); any other ``{name}`` is refused when the file is read.
A list is given as several values (``nargs``); a flag that reads one comma-separated value
takes a string (``position_buckets = "0,128,512"``).

A ``script`` step runs ``settings.path`` (relative to the study's directory) with
``settings.args`` (a list of strings). A ``report`` step rebuilds the study's tables and plots
from the results of the other steps (:mod:`focus_attention.experiments.report`): settings
``out`` (the markdown file, default ``{results}/report.md``) and ``plots`` (default true).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils.io import read_toml

__all__ = [
    "BUILTIN_COMMANDS",
    "CONFIG_NAME",
    "Step",
    "Study",
    "check_study",
    "load_study",
    "recorded_differences",
    "runs_folder",
    "step_argv",
]

#: the file of a study's directory that describes it
CONFIG_NAME = "config.toml"
#: commands that are not focus sub-commands
BUILTIN_COMMANDS = ("report", "script")
#: a step name: a file name without separators
STEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: the placeholders a string setting may use
PLACEHOLDERS = ("study", "results", "runs")
#: a placeholder written in a string: ``{name}``
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_-]*)\}")
STEP_KEYS = frozenset({"name", "command", "result", "settings", "variables"})
#: an environment variable's name
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
REPORT_KEYS = frozenset({"out", "plots"})
SCRIPT_KEYS = frozenset({"path", "args"})


@dataclass(frozen=True)
class Step:
    """One step of a study: ``name``, ``command`` (the words of a ``focus`` sub-command,
    ``("script",)`` or ``("report",)``), ``settings`` (the TOML table as written, before the
    placeholders are filled in), ``result`` (the JSON file it writes, with placeholders;
    None: it records nothing and runs every time) and ``variables``, the environment
    variables set for its process (a step with some runs in a subprocess)."""

    name: str
    command: tuple[str, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    result: str | None = None
    variables: dict[str, str] = field(default_factory=dict)

    @property
    def builtin(self) -> bool:
        """True for ``report`` and ``script`` steps."""
        return self.command[0] in BUILTIN_COMMANDS

    def command_text(self) -> str:
        """The command as written in ``config.toml`` (``"bench kernel"``)."""
        return " ".join(self.command)


@dataclass(frozen=True)
class Study:
    """A study read from ``directory / config.toml``: ``title``, ``question`` and the
    ``steps`` in file order."""

    directory: Path
    title: str
    steps: tuple[Step, ...]
    question: str = ""

    @property
    def name(self) -> str:
        """The study's name: its directory's name."""
        return self.directory.name

    def paths(self, runs: str | Path = "runs") -> dict[str, str]:
        """The placeholder values: ``study``, ``results`` and ``runs``."""
        return {"study": str(self.directory), "results": str(self.directory / "results"),
                "runs": str(runs)}  # fmt: skip

    def step(self, name: str) -> Step:
        """The step called ``name``.

        Raises:
            ValueError: no such step (the message lists the steps).
        """
        for step in self.steps:
            if step.name == name:
                return step
        raise ValueError(f"{self.directory}: no step {name!r}; the steps are "
                         f"{[s.name for s in self.steps]}")  # fmt: skip


def fill(value: Any, paths: dict[str, str]) -> Any:
    """``value`` with the placeholders of :data:`PLACEHOLDERS` filled in (strings, and the
    strings of lists); other values unchanged."""
    if isinstance(value, str):
        for key, path in paths.items():
            value = value.replace("{" + key + "}", path)
        return value
    if isinstance(value, list):
        return [fill(v, paths) for v in value]
    return value


def _texts(value: Any) -> list[str]:
    """The strings of a setting's value: itself, or the strings of a list."""
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]


def _check_placeholders(key: str, value: Any, where: str) -> None:
    """Every ``{name}`` in ``value`` (a string, or the strings of a list) is one of
    :data:`PLACEHOLDERS`.

    Raises:
        ValueError: naming ``where``, the setting ``key`` and the unknown placeholder.
    """
    for text in _texts(value):
        for name in PLACEHOLDER.findall(text):
            if name not in PLACEHOLDERS:
                raise ValueError(f"{where}: {key} {text!r}: unknown placeholder {{{name}}}; "
                                 f"the placeholders are "
                                 f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}")  # fmt: skip


def _step(table: Any, where: str, seen: set[str]) -> Step:
    """One ``[[steps]]`` table, checked for its form (not its flags)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table, got {table!r}")
    unknown = sorted(set(table) - STEP_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected {sorted(STEP_KEYS)}")
    name = table.get("name")
    if not isinstance(name, str) or STEP_NAME.fullmatch(name) is None:
        raise ValueError(f"{where}: name {name!r} is not a file name; expected letters, "
                         "digits, '.', '_' or '-', starting with a letter or digit")  # fmt: skip
    if name in seen:
        raise ValueError(f"{where}: two steps are named {name!r}")
    seen.add(name)
    command = table.get("command")
    if not isinstance(command, str) or not command.split():
        raise ValueError(f"{where} ({name}): command {command!r}: expected a focus "
                         "sub-command such as 'eval' or 'bench kernel', 'script' or 'report'")  # fmt: skip
    settings = table.get("settings", {})
    if not isinstance(settings, dict):
        raise ValueError(f"{where} ({name}): settings must be a table, got {settings!r}")
    result = table.get("result", settings.get("json"))
    if result is not None and (not isinstance(result, str) or not result.endswith(".json")):
        raise ValueError(f"{where} ({name}): result {result!r}: expected the path of a JSON file")
    labelled = [(f"setting {key}", value) for key, value in settings.items()]
    for label, value in [*labelled, ("result", result)]:
        _check_placeholders(label, value, f"{where} ({name})")
    return Step(name, tuple(command.split()), dict(settings), result,
                _variables(table.get("variables", {}), f"{where} ({name})"))  # fmt: skip


def _variables(table: Any, where: str) -> dict[str, str]:
    """A step's ``[steps.variables]`` table: names of environment variables to strings."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: variables must be a table, got {table!r}")
    for key, value in table.items():
        if VARIABLE_NAME.fullmatch(key) is None or not isinstance(value, str):
            raise ValueError(f"{where}: variable {key} = {value!r}: expected a name of letters, "
                             "digits and '_' set to a string")  # fmt: skip
    return dict(table)


def load_study(directory: str | Path) -> Study:
    """Read ``directory / config.toml`` (module docstring) and check its form: the
    ``[study]`` table, step names, commands and result files. :func:`check_study` checks
    each step's settings against its command.

    Raises:
        FileNotFoundError: no such directory or no ``config.toml`` in it (the message
            starts with ``directory``).
        ValueError: invalid TOML, unknown tables or keys, a missing title, a bad or repeated
            step name, a step without a command, a result that is not a JSON file.
    """
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        what = f"no {CONFIG_NAME} in it" if directory.is_dir() else "no such directory"
        raise FileNotFoundError(f"{directory}: {what}; expected a study directory "
                                f"(experiments/<study>) holding {CONFIG_NAME}")  # fmt: skip
    data = read_toml(path, "study file")
    unknown = sorted(set(data) - {"study", "steps"})
    if unknown:
        raise ValueError(f"{path}: unknown tables {unknown}; expected [study] and [[steps]]")
    head = data.get("study")
    if not isinstance(head, dict) or not isinstance(head.get("title"), str):
        raise ValueError(f"{path}: [study] needs a title (a string)")
    extra = sorted(set(head) - {"title", "question"})
    if extra:
        raise ValueError(f"{path}: [study] has unknown keys {extra}; expected title, question")
    tables = data.get("steps")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{path}: no [[steps]] tables")
    seen: set[str] = set()
    steps = tuple(_step(t, f"{path} [[steps]] #{i + 1}", seen) for i, t in enumerate(tables))
    return Study(directory, head["title"], steps, str(head.get("question", "")))


def _flag_words(key: str, value: Any) -> list[str]:
    """The command-line words of one setting (module docstring)."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + key.replace("_", "-")]
    if isinstance(value, list):
        if not value or any(isinstance(v, (list, dict)) for v in value):
            raise ValueError(f"setting {key} = {value!r}: expected a non-empty list of values")
        return [flag, *(str(v) for v in value)]
    if isinstance(value, dict) or value is None:
        raise ValueError(f"setting {key} = {value!r}: expected a string, number, bool or list")
    return [flag, str(value)]


def step_argv(step: Step, paths: dict[str, str]) -> list[str]:
    """The ``focus`` command line of a sub-command step (without ``focus``), placeholders
    filled in from ``paths`` (:meth:`Study.paths`).

    Raises:
        ValueError: a built-in step, or a setting that is no flag value (a table, an empty
            list, a nested list).
    """
    if step.builtin:
        raise ValueError(f"step {step.name}: {step.command_text()} is not a focus sub-command")
    argv = list(step.command)
    for key, value in step.settings.items():
        try:
            argv += _flag_words(key, fill(value, paths))
        except ValueError as err:
            raise ValueError(f"step {step.name}: {err}") from err
    return argv


def runs_folder(runs: str | Path) -> str:
    """The runs folder as a study's results record it: an absolute path, symbolic links
    resolved (``runs`` -> ``/home/me/focus/runs``)."""
    return str(Path(runs).resolve())


def _uses_runs(settings: dict[str, Any]) -> bool:
    return any("{runs}" in text for value in settings.values() for text in _texts(value))


def recorded_differences(step: Step, record: dict[str, Any], runs: str | Path) -> list[str] | None:
    """What differs between ``step`` run now with the runs folder ``runs`` and the
    ``record`` of its result (the ``experiment`` record of
    :mod:`focus_attention.experiments.runner`: ``command``, ``settings`` as written,
    ``variables`` and ``runs``, the :func:`runs_folder` it ran with).

    Settings are compared with ``{runs}`` filled in on both sides (another runs folder
    means other adapters); ``{study}`` and ``{results}`` stay as written (the results move
    with the study).

    Returns:
        ``[]`` when they are the same; else what differs: ``"command"``, ``"variables"``,
        and the names of the settings that differ (``"adapter (runs folder /a -> /b)"``
        when only the runs folder makes the difference); None when the record cannot tell:
        the step's settings or the recorded ones use ``{runs}`` but the record has no
        ``runs`` (made before results recorded it).
    """
    then_settings = record.get("settings")
    then_settings = then_settings if isinstance(then_settings, dict) else {}
    then_runs, now_runs = record.get("runs"), runs_folder(runs)
    if (_uses_runs(step.settings) or _uses_runs(then_settings)) and not isinstance(then_runs, str):
        return None
    changed = [] if record.get("command") == step.command_text() else ["command"]
    for key in dict.fromkeys([*then_settings, *step.settings]):
        then, now = then_settings.get(key), step.settings.get(key)
        if fill(then, {"runs": str(then_runs)}) == fill(now, {"runs": now_runs}):
            continue
        same_text = then == now and then_runs != now_runs
        changed.append(f"{key} (runs folder {then_runs} -> {now_runs})" if same_text else key)
    if record.get("variables", {}) != step.variables:
        changed.append("variables")
    return changed


def _check_builtin(step: Step) -> None:
    allowed = REPORT_KEYS if step.command == ("report",) else SCRIPT_KEYS
    if len(step.command) != 1:
        raise ValueError(f"command {step.command_text()!r}: {step.command[0]} takes no words")
    unknown = sorted(set(step.settings) - allowed)
    if unknown:
        raise ValueError(f"unknown settings {unknown} for {step.command[0]}; expected "
                         f"{sorted(allowed)}")  # fmt: skip
    if step.command == ("script",):
        args = step.settings.get("args", [])
        if not isinstance(step.settings.get("path"), str):
            raise ValueError("script needs path (a file of the study's directory)")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"script args {args!r}: expected a list of strings")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """Parse ``argv`` with ``parser``; returns what it printed (``--help``).

    Raises:
        ValueError: the last line argparse wrote to stderr when it refused ``argv``.
    """
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            parser.parse_args(argv)
        except SystemExit as stop:
            if stop.code not in (0, None):
                message = err.getvalue().strip().splitlines()
                raise ValueError(message[-1] if message else "invalid command line") from None
    return out.getvalue()


def _check_listed(step: Step, help_text: str) -> None:
    """Every flag of ``step`` appears in its command's ``--help`` (a hidden flag is a
    deprecated spelling, refused in a study).

    Raises:
        ValueError: naming the first flag not listed.
    """
    for key, value in step.settings.items():
        flag = _flag_words(key, value)[0]
        if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is None:
            raise ValueError(f"setting {key}: {flag} is not a flag that `focus "
                             f"{step.command_text()} --help` lists (a deprecated name?)")  # fmt: skip


def check_study(study: Study, parser: argparse.ArgumentParser) -> None:
    """Check every step without running anything: a sub-command step's command line must
    parse with the ``focus`` parser ``parser`` (known sub-command, known flags, values of
    the flags' types) and use only the flags its ``--help`` lists (no deprecated names), a
    script must exist, a report may only set ``out`` and ``plots``.

    Raises:
        ValueError: naming the study file, the step and what argparse or the check said.
    """
    where = study.directory / CONFIG_NAME
    helps: dict[tuple[str, ...], str] = {}
    for step in study.steps:
        try:
            if step.builtin:
                _check_builtin(step)
                if step.command == ("script",):
                    script = study.directory / step.settings["path"]
                    if not script.is_file():
                        raise ValueError(f"script {script} does not exist")
                continue
            _parse(parser, step_argv(step, study.paths()))
            if step.command not in helps:
                helps[step.command] = _parse(parser, [*step.command, "--help"])
            _check_listed(step, helps[step.command])
        except ValueError as err:
            raise ValueError(f"{where}: step {step.name} ({step.command_text()}): {err}") from err
