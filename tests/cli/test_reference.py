"""The command-line reference (docs/cli.md) is generated from the parser that ``focus`` runs:
the committed page equals a fresh rendering, and the rendering covers every command and flag
whatever the terminal width."""

from __future__ import annotations

import argparse
from pathlib import Path

from focus_attention.cli import build_parser
from focus_attention.cli.reference import REGENERATE, iter_commands, main, render_reference

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "cli.md"


def test_committed_reference_equals_the_parser():
    fresh = render_reference()
    assert COMMITTED.read_text(encoding="utf-8") == fresh, (
        f"docs/cli.md is out of date with the focus parser: run `{REGENERATE}` "
        "from the repository root and commit the result"
    )


def test_every_command_and_flag_is_in_the_reference():
    text = render_reference()
    commands = list(iter_commands(build_parser()))
    assert len(commands) > 20  # focus, its commands, and the sub-commands of bench/data/models
    for path, parser, _ in commands:
        assert f"`{' '.join(('focus', *path))}`" in text
        for action in parser._actions:
            for flag in action.option_strings:
                if action.help != argparse.SUPPRESS and flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, (path, flag)


def _toy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy", description="A toy   command.")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run | it", description="Run it once.")
    run.add_argument("path", help="where")
    run.add_argument("--lengths", type=int, nargs="+", default=[1, 2], help="N (%(default)s)")
    run.add_argument("--mode", choices=["a", "b"], default="a", help="one of %(choices)s")
    run.add_argument("--rank", metavar="R|match", help="rank")
    run.add_argument("--hidden", help=argparse.SUPPRESS)
    group = run.add_argument_group("Extra", "Settings of the extra part.")
    group.add_argument("--flag", action="store_true", help="a switch")
    nested = sub.add_parser("nest", help="has children").add_subparsers(dest="inner")
    nested.add_parser("leaf", help="a leaf")
    return parser


def test_rendering_of_a_toy_parser():
    text = render_reference(_toy_parser())
    assert [p for p, _, _ in iter_commands(_toy_parser())] == [
        (),
        ("run",),
        ("nest",),
        ("nest", "leaf"),
    ]
    assert "| [`toy run`](#toy-run) | run \\| it |" in text
    assert "| [`toy nest leaf`](#toy-nest-leaf) | a leaf |" in text
    assert "A toy command." in text and "Run it once." in text
    assert "toy run [OPTIONS] path" in text
    assert "| `--lengths` | `LENGTHS [LENGTHS ...]` | `1 2` | N (1, 2) |" in text
    assert "| `--mode` | `{a,b}` | `a` | one of a, b |" in text
    assert "| `--rank` | R\\|match |  | rank |" in text
    assert "--hidden" not in text and "| `-h`" not in text and "| `--help`" not in text
    assert "**Extra**\n\nSettings of the extra part.\n" in text
    assert "| `--flag` |  | a switch |" in text  # no default column: nothing to show
    assert "### `toy nest leaf`" in text


def test_rendering_does_not_depend_on_the_terminal_width(monkeypatch):
    outs = []
    for columns in ("30", "250"):
        monkeypatch.setenv("COLUMNS", columns)  # what argparse's help formatter reads
        outs.append(render_reference())
    assert outs[0] == outs[1]


def test_write_replaces_the_file(tmp_path):
    target = tmp_path / "cli.md"
    target.write_text("stale")
    assert main(["--write", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == render_reference()
    assert [p.name for p in tmp_path.iterdir()] == ["cli.md"]
