"""The settings of ``focus sweep`` (torch-free, so that ``focus sweep --help`` and the
flags load without torch): :class:`SweepConfig` for an ablation grid
(:mod:`focus_attention.experiments.grid`) and :class:`StudyConfig` for a study
(:mod:`focus_attention.experiments.runner`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..settings import OutputSettings
from ..utils.checks import bad, check_int

__all__ = ["StudyConfig", "SweepConfig"]


@dataclass
class SweepConfig(OutputSettings):
    """Settings of one sweep; every field is a ``focus sweep`` flag.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    grid: str | None = field(
        default=None,
        metadata={
            "help": "grid file (TOML: [train], [train.focus], [eval], [grid], [[cells]], "
            "[[evals]]); one of --grid / --study is required",
            "metavar": "FILE",
        },
    )
    jobs: int = field(default=1, metadata={"help": "cells run at once, in separate processes"})
    threads: int | None = field(
        default=None,
        metadata={"help": "torch threads in all, split evenly over --jobs (default: the "
                  "cells' own [train]/[eval] threads, else torch's choice)"},
    )  # fmt: skip
    progress: bool = field(
        default=True,
        metadata={"help": "messages per cell (with --jobs above 1: a line per finished "
                  "cell); --no-progress also silences the cells' bars (else the grid file's "
                  "[train]/[eval] progress decides)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_int("SweepConfig", "jobs", self.jobs, 1)
        check_int("SweepConfig", "threads", self.threads, 1, optional=True)

    def out_dir(self) -> Path:
        """``out``, or ``runs/sweep-<grid file stem>``."""
        if self.out is not None:
            return Path(self.out)
        return Path("runs") / f"sweep-{Path(str(self.grid)).stem}"

    def cell_threads(self) -> int | None:
        """Torch threads of each cell: ``threads // jobs`` (at least 1), or None."""
        return None if self.threads is None else max(1, self.threads // self.jobs)


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
                  "settings and keeping results without a settings record", "metavar": "DIR"},
    )  # fmt: skip
    only: tuple[str, ...] | None = field(
        default=None, metadata={"help": "run only these steps of the study", "metavar": "STEP"}
    )
    rerun: tuple[str, ...] | None = field(
        default=None,
        metadata={"help": "run these steps of the study even when their result is there "
                  "(kept: it has no settings record, or done: recorded with these "
                  "settings), overwriting it", "metavar": "STEP"},
    )  # fmt: skip
    runs: str = field(
        default="runs",
        metadata={"help": "directory of the study's trainings and adapters ({runs} in "
                  "config.toml)"},
    )  # fmt: skip
    dry_run: bool = field(
        default=False,
        metadata={"help": "check every step of the study and print what would run and "
                  "why; run nothing"},
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
        if self.rerun is not None and not self.rerun:
            raise bad("StudyConfig", "rerun", self.rerun, "one or more step names")
