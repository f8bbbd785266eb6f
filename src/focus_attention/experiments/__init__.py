"""Experiments as data: a study is a directory ``experiments/<study>/`` with a
``config.toml`` (its steps, each a ``focus`` sub-command with its settings), a ``README.md``
and ``results/``; ``focus sweep --study DIR`` runs it, resumes it and rebuilds its report.
An ablation grid (``focus sweep --grid FILE``) is :mod:`.grid`. The settings live in the
torch-free :mod:`.settings`; each name is imported from its module on first access
(:mod:`focus_attention.utils.lazy`)."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            ".grid": ("run_sweep",),
            ".report": ("report_markdown", "write_report"),
            ".runner": ("run_study", "step_status"),
            ".settings": ("StudyConfig", "SweepConfig"),
            ".study": ("Step", "Study", "check_study", "load_study", "step_argv"),
        }
    ),
)
