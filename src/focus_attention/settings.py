"""The settings groups the commands share, each setting declared once with its default and
help text (docs/method.md §8-§9). A command's settings class composes the groups it needs by
inheriting them, adds its own fields, and is built with :func:`settings_class`, which can
give an inherited field another default for that command, accept deprecated names, and say
which ``int | tuple`` fields take several values there.

Every field with ``metadata["help"]`` is a command-line flag and a key of the command's
``--config`` table (:mod:`focus_attention.cli.flags`). This module and the settings modules
that build on it (``evaluation/settings.py``, ``bench/settings.py``, ``cli/settings.py``)
import neither torch nor transformers; checks that need torch import it when they run.

Groups: :class:`ThreadSettings` (``threads``), :class:`RunSettings` (it and ``progress``),
:class:`ResultFile` (``json``), :class:`PlotFile` (``plot``), :class:`GenerationLength`
(``max_new_tokens``), :class:`BaseModelSettings` (``model``),
:class:`ModelSettings` (it and ``adapter``),
:class:`CorpusSettings` (``corpus``), :class:`TextSettings` (it and ``split``), :class:`BlockSettings` (``seq_len``), :class:`TopKValues` (``top_k``),
:class:`WindowValues` (``window``), :class:`AttentionBackendSetting`
(``attention_backend``), :class:`AdapterOverrides` (those three and ``sink_tokens``,
``dense_layers``, ``dense_heads``, ``query_top_k``, ``inference_routing``),
:class:`FreshRouters` (``num_groups``), :class:`SeedSettings` (``seed``),
:class:`LengthSettings` (``lengths``), :class:`DeviceSettings` (``device``),
:class:`OutputSettings` (``out``), :class:`BosSettings` (``prepend_bos``),
:class:`BatchSettings` (``batch_size``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .assets.corpora import DEFAULT_CORPUS, SPLITS
from .assets.model_registry import DEFAULT_MODEL
from .hf.config import INFERENCE_SETTINGS, InferenceSetting, read_config_file
from .utils.checks import bad, check_int, check_known_keys

__all__ = [
    "ADAPTER_OVERRIDES",
    "NEEDLE_MIN_TOKENS",
    "SHARED_CHECKS",
    "AdapterOverrides",
    "AttentionBackendSetting",
    "BaseModelSettings",
    "BatchSettings",
    "BlockSettings",
    "BosSettings",
    "CorpusSettings",
    "DeviceSettings",
    "FreshRouters",
    "GenerationLength",
    "LengthSettings",
    "ModelSettings",
    "OutputSettings",
    "PlotFile",
    "ResultFile",
    "RunSettings",
    "SeedSettings",
    "Settings",
    "TextSettings",
    "ThreadSettings",
    "TopKValues",
    "WindowValues",
    "adapter_groups",
    "check_grid",
    "renamed_settings",
    "settings_class",
]

#: the shortest pass-key prompt, in tokens (its needle, its question and some haystack): the
#: least ``lengths`` of the needle benchmarks and ``ranking_length`` of focus calibrate
NEEDLE_MIN_TOKENS = 64


class Settings:
    """Base of every settings group: reading from a dict and the checks of the shared fields.

    Class attributes a command's :func:`settings_class` sets:

    * ``RENAMED``: ``{old name: field}``, deprecated names still accepted;
    * ``SEVERAL``: the ``int | tuple[int, ...]`` fields that take several values (stored as
      a tuple); the others take one (stored as an int);
    * ``COMMAND_DEFAULTS``: ``{field: default}``, inherited fields with this command's default.
    """

    RENAMED: ClassVar[dict[str, str]] = {}
    SEVERAL: ClassVar[tuple[str, ...]] = ()
    COMMAND_DEFAULTS: ClassVar[dict[str, Any]] = {}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """The settings from a dict of their fields (a ``--config`` table, a JSON record):
        lists become tuples, deprecated names are renamed with a ``DeprecationWarning``.

        Raises:
            ValueError: unknown keys (the message names the class) or invalid values.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: received {type(data).__name__}, expected a dict")
        data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        data = renamed_settings(cls, data)
        check_known_keys(cls.__name__, data, cls)
        return cls(**data)

    def check_shared(self) -> None:
        """Check (and normalise) the shared fields this class has; each command's
        ``__post_init__`` calls it first.

        Raises:
            ValueError: the first bad field, named ``<Class>.<field>``.
        """
        owner = type(self).__name__
        names = {f.name for f in dataclasses.fields(self)}
        for name, check in SHARED_CHECKS.items():
            if name in names:
                check(owner, self, name)


def _int_at_least(low: int, optional: bool) -> Callable[[str, Any, str], None]:
    def check(owner: str, obj: Any, name: str) -> None:
        check_int(owner, name, getattr(obj, name), low, optional=optional)

    return check


def _choice(choices: tuple[str, ...], optional: bool) -> Callable[[str, Any, str], None]:
    def check(owner: str, obj: Any, name: str) -> None:
        value = getattr(obj, name)
        if not (value is None and optional) and value not in choices:
            raise bad(owner, name, value, ("None or " if optional else "") + f"one of {choices}")

    return check


def _declared(check: Callable[[str, str, Any], None]) -> Callable[[str, Any, str], None]:
    """Check of a field by an inference setting's own ``check``: None, or a value it takes
    (an attention backend: one ``sparse_attention`` takes)."""

    def run(owner: str, obj: Any, name: str) -> None:
        value = getattr(obj, name)
        if value is not None:
            check(owner, name, value)

    return run


def _one_or_several(low: int) -> Callable[[str, Any, str], None]:
    """Check of an ``int | tuple[int, ...] | None`` field: a tuple where the class lists
    it in ``SEVERAL``, else one int (a one-element list is accepted)."""

    def check(owner: str, obj: Any, name: str) -> None:
        value = getattr(obj, name)
        if value is None:
            return
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        several = name in type(obj).SEVERAL
        if not values or (not several and len(values) != 1):
            want = "one or more ints" if several else "one int"
            raise bad(owner, name, value, f"None or {want} >= {low}")
        for v in values:
            check_int(owner, name, v, low)
        setattr(obj, name, values if several else values[0])

    return check


def _ints(low: int, optional: bool) -> Callable[[str, Any, str], None]:
    """Check of a ``tuple[int, ...]`` field: a list or tuple of ints ``>= low`` (stored as
    given)."""

    def check(owner: str, obj: Any, name: str) -> None:
        value = getattr(obj, name)
        if value is None and optional:
            return
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise bad(owner, name, value, f"a list of ints >= {low}")
        for v in value:
            check_int(owner, name, v, low)

    return check


def _text(optional: bool) -> Callable[[str, Any, str], None]:
    def check(owner: str, obj: Any, name: str) -> None:
        value = getattr(obj, name)
        if value is None and optional:
            return
        if not value or not isinstance(value, (str, bytes)) and not hasattr(value, "__fspath__"):
            raise bad(owner, name, value, "a name or path")
        setattr(obj, name, str(value))

    return check


def override_check(setting: InferenceSetting) -> Callable[[str, Any, str], None] | None:
    """The check of the override field of an inference setting (None passes: the adapter's
    value): the setting's own ``check``, else one of its ``choices``, else one int (or, for
    a setting that takes several, one or several) or a list of ints, at least its ``low``.
    None for a setting with none of these (:class:`~focus_attention.hf.FocusConfig` checks
    its value when it is applied)."""
    if setting.check is not None:
        return _declared(setting.check)
    if setting.choices is not None:
        return _choice(setting.choices, optional=True)
    if setting.low is None:
        return None
    if setting.several:
        return _one_or_several(setting.low)
    if setting.is_list:
        return _ints(setting.low, optional=True)
    return _int_at_least(setting.low, optional=True)


#: the check of each shared field (``check(owner, settings, name)``), the override fields'
#: built from their declarations; run by :meth:`Settings.check_shared` for the fields a
#: class has, in this order
SHARED_CHECKS: dict[str, Callable[[str, Any, str], None]] = {
    "model": _text(optional=False),
    "adapter": _text(optional=True),
    "corpus": _text(optional=False),
    "split": _choice(SPLITS, optional=False),
    "seq_len": _int_at_least(2, optional=False),
    **{
        name: check
        for name, setting in INFERENCE_SETTINGS.items()
        if (check := override_check(setting)) is not None
    },
    "num_groups": _int_at_least(1, optional=False),
    "seed": _int_at_least(0, optional=False),
    "lengths": _ints(1, optional=False),
    "threads": _int_at_least(1, optional=True),
    "out": _text(optional=True),
    "max_new_tokens": _int_at_least(1, optional=False),
}


@dataclass
class ThreadSettings(Settings):
    """The torch threads a command runs with."""

    threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (default: torch's own)"}
    )


@dataclass
class RunSettings(ThreadSettings):
    """How a command runs: torch threads and progress output."""

    progress: bool = field(default=True, metadata={"help": "progress bars and messages"})


@dataclass
class ResultFile(Settings):
    """Where a command writes its result."""

    json: str | None = field(default=None, metadata={"help": "write the result JSON here"})


@dataclass
class PlotFile(Settings):
    """Where a command draws its result."""

    plot: str | None = field(
        default=None, metadata={"help": "PNG plot path (default: the JSON path with .png)"}
    )


@dataclass
class GenerationLength(Settings):
    """How many tokens a command generates per answer."""

    max_new_tokens: int = field(
        default=32, metadata={"help": "tokens generated per answer, at most"}
    )


@dataclass
class BaseModelSettings(Settings):
    """The base model a command loads."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "base model: registered name, model directory or hub id"},
    )


@dataclass
class ModelSettings(BaseModelSettings):
    """The base model and the Focus adapter (or ``focus train`` run) on top of it."""

    adapter: str | None = field(
        default=None,
        metadata={"help": "directory of a saved Focus adapter or of a focus train run of any "
                  "--method"},
    )  # fmt: skip


@dataclass
class CorpusSettings(Settings):
    """The corpus a command reads."""

    corpus: str = field(
        default=DEFAULT_CORPUS,
        metadata={"help": "registered corpus or local text file / folder"},
    )


@dataclass
class TextSettings(CorpusSettings):
    """The text a command reads: a corpus and one of its splits."""

    split: str = field(
        default="test",
        metadata={"help": "split of the corpus (keep the test split for evaluation)",
                  "choices": SPLITS},
    )  # fmt: skip


@dataclass
class BlockSettings(Settings):
    """The length of the blocks (windows) the text is cut into."""

    seq_len: int = field(default=1024, metadata={"help": "tokens per block, each run on its own"})


def override_type(setting: InferenceSetting) -> str:
    """The annotation of the override field of ``setting``: its FocusConfig type or None
    (``int | tuple[int, ...] | None`` for a setting that takes several values)."""
    if setting.several:
        return f"{setting.type} | tuple[{setting.type}, ...] | None"
    return setting.type if setting.optional else f"{setting.type} | None"


def override_fields(*names: str) -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``) that declares on a settings group the
    override field of each inference setting of ``names``
    (:data:`~focus_attention.hf.config.INFERENCE_SETTINGS`) that its bases do not declare,
    in the order of ``names``: type :func:`override_type`, default None (the adapter's
    value), the help text ``override_help`` and the setting's flag choices, parser and
    metavar."""

    def build(cls: type) -> type:
        bases = cls.__mro__[1:]
        inherited = {n for base in bases for n in getattr(base, "__dataclass_fields__", {})}
        own = dict(cls.__dict__.get("__annotations__", {}))
        for name in names:
            if name in inherited or name in own:
                continue
            setting = INFERENCE_SETTINGS[name]
            own[name] = override_type(setting)
            metadata = setting.flag_metadata(setting.override_help)
            setattr(cls, name, field(default=None, metadata=metadata))
        cls.__annotations__ = own
        return cls

    return build


@dataclass
@override_fields("top_k")
class TopKValues(Settings):
    """``top_k`` of top-k routing, over the adapter's (one value, or several run in turn
    where the class lists it in ``SEVERAL``)."""


@dataclass
@override_fields("query_top_k")
class QueryTopKValue(Settings):
    """``query_top_k``, the groups each query keeps where it is not ``top_k``, over the
    adapter's."""


@dataclass
@override_fields("window")
class WindowValues(Settings):
    """The local window over the adapter's (one value, or several run in turn where the
    class lists it in ``SEVERAL``)."""


@dataclass
@override_fields("attention_backend")
class AttentionBackendSetting(Settings):
    """The backend of Focus's sparse attention, by name (docs/method.md §5, "Backends")."""


@dataclass
@override_fields(*INFERENCE_SETTINGS)
class AdapterOverrides(WindowValues, TopKValues, QueryTopKValue, AttentionBackendSetting):
    """The inference settings of a Focus adapter a command may override (None: the
    adapter's own): one field per setting of
    :data:`~focus_attention.hf.config.INFERENCE_SETTINGS`, in its order after those of the
    groups it composes; :class:`~focus_attention.hf.FocusConfig` documents each
    (docs/method.md §3-§4)."""

    def overrides(self, *, without: tuple[str, ...] = ()) -> dict[str, Any]:
        """The :class:`~focus_attention.hf.FocusConfig` fields these settings override
        (None: keep the adapter's), less those in ``without`` (the ones a command sets per
        run itself, as ``top_k`` when it runs several), for
        :meth:`FocusConfig.override <focus_attention.hf.FocusConfig.override>`."""
        return {name: getattr(self, name) for name in ADAPTER_OVERRIDES if name not in without}


#: the FocusConfig fields :class:`AdapterOverrides` can override: the inference settings,
#: in their declaration's order
ADAPTER_OVERRIDES = tuple(INFERENCE_SETTINGS)


@dataclass
class FreshRouters(Settings):
    """The routers a command initialises itself when it is given no adapter."""

    num_groups: int = field(
        default=8, metadata={"help": "K of fresh routers (without --adapter) and random groups"}
    )


@dataclass
class SeedSettings(Settings):
    """The seed of a command's random draws."""

    seed: int = field(
        default=0,
        metadata={"help": "seed of the random draws (data order, initialisation, inputs, "
                  "needles, prompts)"},
    )  # fmt: skip


@dataclass
class OutputSettings(Settings):
    """The directory a command writes its results into."""

    out: str | None = field(
        default=None,
        metadata={"help": "directory the results are written into (default: a folder under "
                  "runs/ where the command names one)"},
    )  # fmt: skip


@dataclass
class BosSettings(Settings):
    """Whether the text's blocks start with the tokenizer's BOS token."""

    prepend_bos: bool | None = field(
        default=None,
        metadata={"help": "start every block with BOS (default: automatic, on for Gemma)"},
    )


@dataclass
class BatchSettings(Settings):
    """How many sequences a batch holds."""

    batch_size: int = field(
        default=1,
        metadata={"help": "sequences per batch (training: blocks per process and micro-batch)"},
    )


@dataclass
class LengthSettings(Settings):
    """The sequence lengths a benchmark runs, in tokens."""

    lengths: tuple[int, ...] = field(
        default=(1024,), metadata={"help": "sequence or prompt lengths in tokens"}
    )


@dataclass
class DeviceSettings(Settings):
    """The torch device a command runs on."""

    device: str | None = field(
        default=None, metadata={"help": "torch device (default: cuda if available, else cpu)"}
    )


def renamed_settings(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the deprecated names of ``cls.RENAMED`` replaced by their fields (a
    ``DeprecationWarning`` each; the deprecated name wins when both are given, as
    ``dataclasses.replace`` passes every field)."""
    renamed = getattr(cls, "RENAMED", {})
    if not any(old in data for old in renamed):
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old in data:
            warnings.warn(
                f"{cls.__name__}: {old!r} is deprecated, use {new!r}",
                DeprecationWarning,
                stacklevel=4,
            )
            data[new] = data.pop(old)
    return data


def _inherited_field(cls: type, name: str) -> dataclasses.Field:
    for base in cls.__mro__[1:]:
        found = getattr(base, "__dataclass_fields__", {}).get(name)
        if found is not None:
            return found
    raise TypeError(f"{cls.__name__}: no inherited settings field {name!r} to give a default")


def settings_class(
    *,
    defaults: dict[str, Any] | None = None,
    renamed: dict[str, str] | None = None,
    several: tuple[str, ...] = (),
) -> Callable[[type], type]:
    """Class decorator that makes a command's settings dataclass from a class composing
    the groups (use it instead of ``@dataclass``).

    Args:
        defaults: ``{field: default}`` for inherited fields whose default differs for this
            command (the type and help text stay the group's).
        renamed: ``{old name: field}``: deprecated names the constructor,
            :meth:`Settings.from_dict` and the command line accept (with a
            ``DeprecationWarning``), and that read as the field.
        several: the ``int | tuple[int, ...]`` fields that take several values here.

    Raises:
        TypeError: a default for a field no group declares.
    """

    def build(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        for name, value in (defaults or {}).items():
            base = _inherited_field(cls, name)
            own[name] = base.type
            setattr(cls, name, field(default=value, metadata=base.metadata))
        cls.__annotations__ = own
        cls.COMMAND_DEFAULTS = dict(defaults or {})
        cls.RENAMED = dict(renamed or {})
        cls.SEVERAL = tuple(several)
        cls = dataclass(cls)
        _accept_renamed(cls)
        return cls

    return build


def _accept_renamed(cls: type) -> None:
    """The constructor of ``cls`` accepts the names of ``cls.RENAMED``, and each reads as
    its field."""
    if not cls.RENAMED:
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **renamed_settings(cls, kwargs))

    cls.__init__ = __init__
    for old, new in cls.RENAMED.items():
        setattr(cls, old, property(lambda self, new=new: getattr(self, new),
                                   doc=f"Deprecated name of ``{new}``."))  # fmt: skip


#: the fields of several values a command runs in turn (stored without repeats)
GRID_FIELDS = ("top_k", "window", "lengths", "contexts", "concurrency", "depths", "levels",
               "haystacks", "tasks", "batch_size")  # fmt: skip


def adapter_groups(adapter: str | None) -> int | None:
    """K (``num_groups``) of the Focus adapter in the local folder ``adapter``, read from its
    config file; None without one (no adapter, a hub id, a run without Focus routers: their
    loaders report what is missing).

    Raises:
        ValueError: a damaged config file (the message names it).
    """
    if adapter is None:
        return None
    from .hf.files import CONFIG_NAME  # hf.files imports torch; this module stays torch-free

    path = Path(adapter) / CONFIG_NAME
    return read_config_file(path)[0].num_groups if path.is_file() else None


def check_grid(owner: str, config: Any) -> None:
    """Drop repeated values of the :data:`GRID_FIELDS` ``config`` has (each value once, in
    the order given, so that no row is run twice), and check ``top_k`` and ``query_top_k``
    against K: the adapter's (:func:`adapter_groups`), else ``num_groups`` of fresh
    routers. Call it after ``check_shared``.

    Raises:
        ValueError: a ``top_k`` or ``query_top_k`` outside ``1..K``, naming the field and K.
    """
    for name in GRID_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (tuple, list)) and all(
            isinstance(v, (int, float, str)) for v in value
        ):
            setattr(config, name, tuple(dict.fromkeys(value)))
    adapter = getattr(config, "adapter", None)
    groups = adapter_groups(adapter)
    if groups is not None:
        whose = f"the K of the adapter {adapter}"
    elif adapter is None and hasattr(config, "num_groups"):
        groups, whose = config.num_groups, "K, num_groups"
    else:
        return
    for name in ("top_k", "query_top_k"):
        value = getattr(config, name, None)
        values = value if isinstance(value, tuple) else (value,)
        if any(v is not None and not 1 <= v <= groups for v in values):
            raise bad(owner, name, value, f"ints in 1..{groups} ({whose})")
