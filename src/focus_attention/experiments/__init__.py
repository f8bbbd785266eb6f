"""Experiments as data: a study is a directory ``experiments/<study>/`` with a
``config.toml`` (its steps, each a ``focus`` sub-command with its settings), a ``README.md``
and ``results/``; ``focus sweep --study DIR`` runs it, resumes it and rebuilds its report."""

from .report import report_markdown, write_report
from .runner import StudyConfig, run_study, step_status
from .study import Step, Study, check_study, load_study, step_argv

__all__ = [
    "Step",
    "Study",
    "StudyConfig",
    "check_study",
    "load_study",
    "report_markdown",
    "run_study",
    "step_argv",
    "step_status",
    "write_report",
]
