"""Command-line flags generated from a settings dataclass, so that each setting has one
source: its dataclass field (name, default, help text in ``metadata["help"]``, optional
``metadata["choices"]`` and ``metadata["type"]``, a parser of the flag's text).

Settings come from three layers, the later winning: the dataclass defaults, a TOML settings
file (``--config FILE``, one table per command, for example ``[train]`` with a ``[train.focus]``
sub-table, or ``[bench.kernel]`` for ``focus bench kernel``), and the flags given on the
command line. Flags have no argparse default for that
reason: :func:`flag_values` returns only those given.

A field ``seq_len`` becomes ``--seq-len``; a ``bool`` field becomes ``--flag / --no-flag``;
``int | None`` and the like parse as ``int``; ``tuple[int, ...]`` takes one or more ints
(``--lengths 1024 4096``); ``int | tuple[int, ...]`` takes several where the settings class
lists the field in ``SEVERAL``, else one; a field without help text is not a flag. The
deprecated names of a class's ``RENAMED`` stay as hidden flags that print a deprecation
message to stderr.
argparse does the parsing; this module only declares the flags and reads them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

from ..utils.checks import comma_ints
from ..utils.io import read_toml

#: the flag types inferred from annotations; any other type needs ``metadata["type"]``
_SCALARS = (int, float, str)


def flag_name(field_name: str) -> str:
    """``seq_len`` -> ``--seq-len``."""
    return "--" + field_name.replace("_", "-")


def _scalar(annotation: Any) -> tuple[Any, bool | None]:
    """``(type, several)``: ``int``, ``float``, ``str`` or ``bool`` from an annotation such
    as ``int | None`` (``several`` False), ``tuple[int, ...]`` (``several`` True) or
    ``int | tuple[int, ...]`` (``several`` None: one or several, as the class says); the
    type is None for anything else."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 2 and _scalar(rest[1]) == (rest[0], True):
            return rest[0], None
        return _scalar(rest[0]) if len(rest) == 1 else (None, False)
    if typing.get_origin(annotation) in (tuple, list) and args and args[0] in _SCALARS:
        return args[0], True
    return (annotation if annotation in _SCALARS + (bool,) else None), False


def flag_fields(cls: type, exclude: Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that are flags: those with help text, minus
    ``exclude``."""
    skip = set(exclude)
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata and f.name not in skip]


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def add_flags(
    parser: Any,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    required: Iterable[str] = (),
) -> None:
    """Add one flag per field of ``cls`` (see the module docstring), with the field's default;
    the help of a field in ``required`` (those :func:`command_config` requires) says
    ``(required)`` instead of a default (a group's ``(default: ...)`` note dropped).

    Raises:
        TypeError: a field whose type cannot be read from the command line and has no
            ``metadata["type"]``.
    """
    hints = typing.get_type_hints(cls)
    required = set(required)
    note_flags(parser, [f.name for f in flag_fields(cls, exclude)], owners=(cls.__name__,))
    for field in flag_fields(cls, exclude):
        meta = field.metadata
        default = _default(field)
        kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS}
        joiner = "," if "type" in meta else " "  # a custom type parses one comma-separated value
        shown = "" if default in (None, ()) else f" (default {_shown(default, joiner)})"
        parse, several = _scalar(hints[field.name])
        if several is None:  # one or several, as the class says
            several = field.name in getattr(cls, "SEVERAL", ())
            shown = ("; one or more, each run in turn" if several else "") + shown
        text = meta["help"] + shown
        if field.name in required:
            text = _DEFAULT_NOTE.sub("", meta["help"]) + " (required)"
        kwargs["help"] = text.replace("%", "%%")
        parse = meta.get("type", parse)
        if parse is None:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag type (set metadata['type'])")
        if parse is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = parse if parse in _SCALARS else flag_parser(parse)
            if several and "type" not in meta:
                kwargs["nargs"] = "+"
            for key in ("choices", "metavar"):
                if key in meta:
                    kwargs[key] = meta[key]
        parser.add_argument(flag_name(field.name), **kwargs)
        for old in _old_names(cls, field.name):
            _add_deprecated(parser, old, field.name, kwargs)


def note_flags(parser: Any, names: Iterable[str], owners: Iterable[str] = ()) -> None:
    """Record on ``parser`` (a command's parser or one of its argument groups) that the
    fields ``names`` are its flags and that the settings classes ``owners`` check them, so
    that :func:`in_flag_words` can name them in its error messages (the parsed arguments
    carry both, as defaults: ``flag_fields`` and ``flag_owners``)."""
    for dest, new in (("flag_fields", names), ("flag_owners", owners)):
        known = parser.get_default(dest) or ()
        parser.set_defaults(**{dest: tuple(dict.fromkeys((*known, *new)))})


#: a settings check's message: ``<Class>.<field>: ...`` (``focus_attention.utils.checks.bad``)
_OWNER_FIELD = re.compile(r"([A-Z]\w*)\.([A-Za-z_]\w*): ")


def in_flag_words(message: str, args: argparse.Namespace) -> str:
    """``message`` (of an error a command raised) in the words of its command line: a
    leading ``<Class>.<field>: `` of a field that is one of the command's flags becomes
    the flag as typed (``--top-k: ``), and, when that class checks the command's flags, the
    other flags the message names as settings (``num_groups=4``, ``seq_len (64)``,
    ``hidden_size``) become theirs too (``--num-groups=4``). A setting read from the
    ``--config`` file (not given as a flag) keeps its name, a key of that file. Other
    messages are returned as they are."""
    flags = set(getattr(args, "flag_fields", ()) or ())
    config = getattr(args, "config", None)
    prefix = f"{config}: " if config and message.startswith(f"{config}: ") else ""
    match = _OWNER_FIELD.match(message, len(prefix))
    if match is None or match.group(2) not in flags:
        return message

    def typed(name: str) -> bool:  # a flag whose value came from the command line
        return name in flags and (not config or hasattr(args, name))

    owner, field = match.groups()
    if not typed(field):
        return message
    rest = message[match.end() :]
    if owner in (getattr(args, "flag_owners", ()) or ()):
        for name in sorted(filter(typed, flags), key=len, reverse=True):
            after = r"\b" if "_" in name else r"(?==|\s\(-?\d)"  # a bare word: as a setting
            rest = re.sub(rf"(?<![-\w])(?<![A-Za-z]\.){name}{after}", flag_name(name), rest)
    return f"{flag_name(field)}: {rest}"


#: a group's note on its default at the end of a help text, dropped for a required flag
_DEFAULT_NOTE = re.compile(r" \(default[^()]*\)$")

#: the ``<Class>.<field>: `` a settings check starts its message with (argparse names the flag)
_FIELD_PREFIX = re.compile(r"^[A-Za-z_]\w*\.[A-Za-z_]\w*: ")


def flag_parser(parse: Any) -> Any:
    """``parse`` (a flag's ``metadata["type"]``) for argparse: a ``ValueError`` it raises
    becomes an ``argparse.ArgumentTypeError`` with its own message (less a leading
    ``<Class>.<field>: ``, as argparse names the flag), so that the error reads
    ``argument --flag: <message>`` instead of ``invalid <function name> value``."""

    @functools.wraps(parse)
    def read(text: str) -> Any:
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            raise
        except ValueError as err:
            raise argparse.ArgumentTypeError(_FIELD_PREFIX.sub("", str(err))) from err

    return read


def _old_names(cls: type, name: str) -> list[str]:
    """The deprecated names of field ``name`` of ``cls`` (its ``RENAMED``)."""
    return [old for old, new in getattr(cls, "RENAMED", {}).items() if new == name]


def _add_deprecated(parser: Any, old: str, name: str, kwargs: dict[str, Any]) -> None:
    """A hidden ``--old-name`` flag for field ``name``: the same value (lists of ints also
    comma-separated, ``1,2``), and a deprecation message on stderr when given."""
    alias = {**kwargs, "help": argparse.SUPPRESS, "action": DeprecatedFlag}
    alias["replacement"] = flag_name(name)
    if alias.get("type") is int and alias.get("nargs") == "+":
        alias["type"] = comma_ints
    if kwargs.get("action") is argparse.BooleanOptionalAction:
        raise TypeError(f"{old}: a renamed bool flag is not supported")
    parser.add_argument(flag_name(old), **alias)


class DeprecatedFlag(argparse.Action):
    """A flag kept under an old name: stores its value like the new flag and prints
    ``focus: warning: --old is deprecated, use --new`` to stderr."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.replacement = replacement

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        print(f"focus: warning: {option_string} is deprecated, use {self.replacement}",
              file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def _flat(value: Any) -> Any:
    """Several values given as a list (of values or of comma-separated tuples) -> a tuple."""
    if not isinstance(value, list):
        return value
    out: list[Any] = []
    for v in value:
        out.extend(v if isinstance(v, tuple) else (v,))
    return tuple(out)


def _shown(value: Any, joiner: str = " ") -> str:
    """A default as the user would type it."""
    if isinstance(value, (tuple, list)):
        return joiner.join(str(v) for v in value)
    return str(value)


def flag_values(
    args: argparse.Namespace, cls: type, *, exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """The values of the ``cls`` flags given on the command line, by field name (lists
    given as several values become tuples)."""
    out = {}
    for f in flag_fields(cls, exclude):
        if hasattr(args, f.name):
            out[f.name] = _flat(getattr(args, f.name))
    return out


def add_config_flag(parser: Any, table: str) -> None:
    """Add ``--config FILE``: settings read from table ``[table]`` of a TOML file."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML settings file: its [{table}] table; flags given here override it",
    )


def command_config(
    args: argparse.Namespace, cls: type, table: str, *, required: Iterable[str] = ()
) -> Any:
    """The settings dataclass ``cls`` of a command: its defaults, then table ``[table]`` of
    ``--config``, then the flags given; the fields in ``required`` must come from one of the
    two (``cls.from_dict`` builds it).

    Raises:
        ValueError: a required field given nowhere; unknown or invalid settings (the message
            names the file); a ``--config`` file that is missing, a folder, not TOML or
            without the table.
    """
    settings = renamed_keys(read_config_table(args.config, table), cls, table)
    settings.update(flag_values(args, cls))
    for name in required:
        if settings.get(name) is None:
            raise ValueError(
                f"{flag_name(name)} is required (or `{name}` in the [{table}] table of --config)"
            )
    try:
        return cls.from_dict(settings)
    except ValueError as err:
        raise ValueError(f"{args.config}: {err}" if args.config else str(err)) from err


def renamed_keys(settings: dict[str, Any], cls: type, table: str) -> dict[str, Any]:
    """``settings`` (a ``--config`` table) with the deprecated keys of ``cls.RENAMED``
    renamed, each with a deprecation message on stderr."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in settings:
            print(f"focus: warning: [{table}] key {old!r} is deprecated, use {new!r}",
                  file=sys.stderr)  # fmt: skip
            settings[new] = settings.pop(old)
    return settings


def read_config_table(path: str | None, table: str) -> dict[str, Any]:
    """Table ``[table]`` of the TOML file ``path`` (``--config``) as a dict (``{}`` when
    ``path`` is None); a dotted name such as ``bench.kernel`` is a sub-table.

    Raises:
        ValueError: no such file, a folder or an unreadable file, invalid TOML, or no such
            table (the message names ``--config``, the file and what it holds).
    """
    if path is None:
        return {}
    expected = f"expected a TOML settings file (its [{table}] table is read)"
    try:
        data = read_toml(path, "settings file")
    except FileNotFoundError as err:
        raise ValueError(f"--config: {path} not found; {expected}") from err
    except IsADirectoryError as err:
        raise ValueError(f"--config: {path} is a folder; {expected}") from err
    except OSError as err:
        raise ValueError(f"--config: {path} cannot be read ({err.strerror or err}); "
                         f"{expected}") from err  # fmt: skip
    found: Any = data
    for depth, part in enumerate(table.split(".")):
        if not isinstance(found.get(part), dict):
            where = "the file" if depth == 0 else f"[{'.'.join(table.split('.')[:depth])}]"
            raise ValueError(f"--config: {path} has no [{table}] table ({where} holds "
                             f"{_contents(found)})")  # fmt: skip
        found = found[part]
    return dict(found)


def _contents(data: dict[str, Any]) -> str:
    """What a TOML table holds, for a message: its keys and its sub-tables."""
    tables = sorted(k for k, v in data.items() if isinstance(v, dict))
    keys = sorted(k for k, v in data.items() if not isinstance(v, dict))
    held = [f"keys {keys}"] if keys else []
    held.append(f"tables {['[' + t + ']' for t in tables]}" if tables else "no table")
    return " and ".join(held)
