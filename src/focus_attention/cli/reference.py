"""The command-line reference: every ``focus`` command and sub-command, rendered from the
parser that ``focus`` itself runs (:func:`focus_attention.cli.build_parser`) into Markdown.

The committed ``docs/cli.md`` is this module's output::

    python -m focus_attention.cli.reference --write docs/cli.md

The rendering reads the parser's actions, not argparse's formatted help, so it depends
neither on the terminal's width nor on the wording and layout that argparse's help
formatter changes between Python versions (``options:`` against ``optional arguments:``,
where a metavar is repeated). argparse has no public way to list a parser's actions or
sub-commands; this module reads its ``_actions``, ``_action_groups`` and ``_choices_actions``
attributes, which every supported Python version (3.10+) has.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from ..utils.io import atomic_write_text
from . import build_parser

#: the command that writes the committed reference, named in its header and in the test
REGENERATE = "python -m focus_attention.cli.reference --write docs/cli.md"

#: argparse's own titles of its two default argument groups, by Python version
DEFAULT_GROUP_TITLES = {
    "positional arguments": "Arguments",
    "options": "Options",  # Python 3.10+
    "optional arguments": "Options",  # before 3.10
}


def iter_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Yield ``(path, parser, summary)`` for ``parser`` and every sub-command below it,
    depth first, in the order ``--help`` lists them.

    ``path`` is the words after the program name (``()`` for ``focus`` itself,
    ``("bench", "needle")`` for ``focus bench needle``); ``summary`` is the one-line help the
    parent lists for the command (``""`` for the top level).
    """
    yield from _walk(parser, path, "")


def _walk(parser, path, summary):
    yield path, parser, summary
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, child in action.choices.items():
            if name in helps:  # aliases are listed under their command's name only
                yield from _walk(child, (*path, name), helps[name])


def render_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The Markdown reference of ``parser`` (default: the ``focus`` command's parser).

    One section per command (a heading, its description, a synopsis, and a table per
    argument group: the flags, the value they take, the default and the help text, with
    ``%(default)s``-style placeholders filled in as ``--help`` fills them). The output ends
    with a newline and is the same on every terminal width and Python version.
    """
    parser = parser or build_parser()
    prog = parser.prog
    lines = [
        "# Command-line reference",
        "",
        f"Every `{prog}` command and its options, generated from the parser that `{prog}` "
        f"runs. Do not edit by hand: `{REGENERATE}` rewrites this page (a test compares it "
        "with the parser). Every command also prints this help with `--help`.",
        "",
    ]
    commands = list(iter_commands(parser))
    lines += ["| command | what it does |", "|---|---|"]
    for path, _, summary in commands[1:]:
        name = " ".join((prog, *path))
        lines.append(f"| [`{name}`](#{_anchor(name)}) | {_cell(summary)} |")
    lines.append("")
    for path, sub, summary in commands:
        lines += _command_section(prog, path, sub, summary)
    return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(name: str) -> str:
    """The anchor that Markdown renderers (Python-Markdown's toc, GitHub) give a heading
    made of ``name`` in backquotes: lower case, spaces to hyphens, other punctuation dropped."""
    kept = "".join(c for c in name.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _command_section(prog, path, parser, summary):
    name = " ".join((prog, *path))
    level = "#" * min(2 + max(len(path) - 1, 0), 4)
    out = [f"{level} `{name}`", ""]
    text = parser.description or summary
    if text:
        out += [_paragraph(text), ""]
    out += ["```", _synopsis(name, parser), "```", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _documented(a)]
        if not actions:
            continue
        title = DEFAULT_GROUP_TITLES.get(group.title, group.title)
        out += [f"**{title}**", ""]
        if group.description:
            out += [_paragraph(group.description), ""]
        out += _table(parser, actions)
        out.append("")
    return out


def _documented(action: argparse.Action) -> bool:
    """Whether ``action`` gets a row: not hidden, not ``--help`` (every command has it), not
    the sub-command list (each sub-command has its own section)."""
    return not (
        action.help == argparse.SUPPRESS
        or isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    )


def _table(parser, actions):
    """A Markdown table of ``actions``; the default column only where one of them has a
    default that ``--help`` would not otherwise show."""
    defaults = [_default(a) for a in actions]
    with_default = any(defaults)
    head = ["option", "value", *(["default"] if with_default else []), "description"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for action, default in zip(actions, defaults, strict=True):
        flags = ", ".join(_code(s) for s in action.option_strings) or _code(_metavar(action))
        value = _code(_metavar(action)) if action.option_strings else ""
        cells = [flags, value, *([default] if with_default else [])]
        cells.append(_cell(_help(parser, action)))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _default(action: argparse.Action) -> str:
    if action.required and action.option_strings:
        return "required"
    value = action.default
    if value is None or value is argparse.SUPPRESS or action.nargs == 0:
        return ""
    if isinstance(value, list | tuple):
        value = " ".join(str(v) for v in value)
    return _code(str(value))


def _code(text: str) -> str:
    """``text`` as inline code in a table cell; a text holding ``|`` as escaped plain text
    (GitHub's tables split code spans at a pipe, Python-Markdown's do not)."""
    if not text:
        return ""
    return text.replace("|", "\\|") if "|" in text else f"`{text}`"


def _synopsis(name, parser):
    words = [name]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words.append("COMMAND ...")
        elif not action.option_strings:
            words.append(_metavar(action))
        elif action.required:
            words.append(f"{action.option_strings[-1]} {_metavar(action)}".strip())
    if any(a.option_strings and not a.required for a in parser._actions):
        words.insert(1, "[OPTIONS]")
    return " ".join(words)


def _metavar(action: argparse.Action) -> str:
    """The value an action takes as ``--help`` shows it (``N``, ``{a,b}``, ``N [N ...]``);
    ``""`` for a flag that takes none."""
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        base = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None and not isinstance(action.choices, dict):
        base = "{" + ",".join(str(c) for c in action.choices) + "}"
    elif action.option_strings:
        base = action.dest.upper()
    else:
        base = action.dest
    return {
        "?": f"[{base}]",
        "*": f"[{base} ...]",
        "+": f"{base} [{base} ...]",
        argparse.REMAINDER: "...",
    }.get(action.nargs, base)


def _help(parser, action):
    """``action.help`` with argparse's ``%(name)s`` placeholders filled in, as ``--help``
    fills them (argparse's ``HelpFormatter._expand_help``)."""
    text = action.help or ""
    if "%" not in text:
        return text
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    for key in ("default", "choices"):
        value = params.get(key)
        if isinstance(value, list | tuple | set | dict):
            params[key] = ", ".join(str(v) for v in value)
    return text % params


def _paragraph(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return _paragraph(text).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    """``python -m focus_attention.cli.reference [--write PATH]``: print the reference, or
    write it to ``PATH`` (UTF-8; all or nothing: a temporary file renamed over it).

    Returns the exit status (0). Raises ``SystemExit`` on unknown arguments (argparse) and
    ``OSError`` when ``PATH`` cannot be written (its parent folder must exist; the file is then
    unchanged).
    """
    cli = argparse.ArgumentParser(
        prog="python -m focus_attention.cli.reference",
        description="Render the `focus` command-line reference as Markdown.",
    )
    cli.add_argument("--write", type=Path, metavar="PATH", help="write it here (docs/cli.md)")
    args = cli.parse_args(argv)
    text = render_reference()
    if args.write is None:
        sys.stdout.write(text)
        return 0
    atomic_write_text(args.write, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
