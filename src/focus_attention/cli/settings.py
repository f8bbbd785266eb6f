"""The settings of the commands that prepare the offline cache: ``focus setup``,
``focus data prepare`` and ``focus models prepare`` (each field with help text a flag and a
key of the command's ``--config`` table), composed from the shared groups of
:mod:`focus_attention.settings` (the assets, :mod:`focus_attention.assets`, come below the
settings, so these live with the commands). Imports neither torch nor transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..assets.benchmarks import BENCHMARK_DATA
from ..assets.corpora import DEFAULT_CORPUS
from ..assets.model_registry import DEFAULT_MODEL
from ..assets.ruler import RULER_DATA
from ..settings import Settings, settings_class

__all__ = ["ModelsPrepareConfig", "PrepareSettings", "SetupConfig"]


@dataclass
class PrepareSettings(Settings):
    """How an asset is prepared."""

    force: bool = field(default=False, metadata={"help": "rebuild even if already prepared"})


@settings_class()
class SetupConfig(PrepareSettings):
    """Settings of ``focus setup``: the models and corpora to prepare, and whether the
    benchmark data too.

    Raises:
        ValueError: on construction, an empty list or a name that is not text.
    """

    model: tuple[str, ...] = field(
        default=(DEFAULT_MODEL,), metadata={"help": "models to prepare", "metavar": "M"}
    )
    corpus: tuple[str, ...] = field(
        default=(DEFAULT_CORPUS,), metadata={"help": "corpora to prepare", "metavar": "C"}
    )
    benchmarks: bool = field(
        default=False,
        metadata={
            "help": f"also prepare the benchmark data ({BENCHMARK_DATA}: the zero-shot "
            f"sets; {RULER_DATA}: RULER's offline haystack and sentence splitter)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("model", "corpus"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            if not value or not all(isinstance(v, str) and v for v in value):
                raise ValueError(
                    f"SetupConfig.{name}: received {getattr(self, name)!r}, expected one or "
                    "more names"
                )
            setattr(self, name, value)


@settings_class()
class ModelsPrepareConfig(PrepareSettings):
    """Settings of ``focus models prepare`` (the names are its arguments)."""

    verify: bool = field(default=False, metadata={"help": "recompute sha256 of every file"})
