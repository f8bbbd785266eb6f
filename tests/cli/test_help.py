"""``focus --help`` and every ``focus CMD --help`` import neither torch nor transformers,
checked in a fresh interpreter; the listing of the commands matches their own help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from focus_attention.bench.commands import BENCH_COMMANDS
from focus_attention.cli import build_parser
from focus_attention.cli.common import COMMANDS

#: prints the heavy modules ``focus ARGS --help`` imported, after its help text
PROBE = """
import contextlib, io, sys
from focus_attention.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(sys.argv[1:] + ["--help"])
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "transformers", "lm_eval") if m in sys.modules)
print(("usage: focus" in out.getvalue()), ",".join(heavy), sep="|")
"""

HELP_COMMANDS = [
    [],
    *([name] for name, _, _ in COMMANDS if name != "lm-eval"),
    *(["bench", name] for name in BENCH_COMMANDS),
    ["data", "list"],
    ["models", "prepare"],
    ["data", "prepare"],
]


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=lambda a: " ".join(a) or "focus")
def test_help_imports_neither_torch_nor_transformers(argv):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    printed, heavy = done.stdout.strip().splitlines()[-1].split("|")
    assert printed == "True", done.stdout
    assert heavy == "", f"focus {' '.join(argv)} --help imported {heavy}"


@pytest.mark.parametrize(
    "statement",
    [
        "import focus_attention",
        "from focus_attention import FocusConfig",
        "from focus_attention.ops import GATES",
        "import focus_attention.settings",
        "import focus_attention.evaluation.settings",
        "import focus_attention.bench.settings",
        "import focus_attention.bench.commands",
        "import focus_attention.bench.results",
        "import focus_attention.cli.settings",
        "import focus_attention.training.settings",
        "import focus_attention.training.config",
        "import focus_attention.experiments.settings",
        "import focus_attention.assets.model_registry, focus_attention.assets.corpora",
        "import focus_attention.utils.versions",
        "from focus_attention.hf import FocusConfig",
    ],
)
def test_settings_and_the_package_import_without_torch(statement):
    code = f"import sys; {statement}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr


def _listing(parser) -> dict[str, str]:
    action = next(a for a in parser._actions if a.dest == "command")
    return {c.dest: c.help for c in action._choices_actions}


@pytest.mark.slow  # registers every command, training included (imports torch)
def test_the_listing_is_each_commands_own_help():
    full, light = _listing(build_parser()), _listing(build_parser(""))
    assert full == light == {name: text for name, _, text in COMMANDS}


def test_a_command_parses_with_only_its_module_registered():
    parser = build_parser("eval")
    args = parser.parse_args(["eval", "--adapter", "a", "--top-k", "1", "2"])
    assert args.top_k == [1, 2] and args.func is not None
    with pytest.raises(SystemExit):
        parser.parse_args(["inspect", "--adapter", "a"])  # a listed stub, not registered
