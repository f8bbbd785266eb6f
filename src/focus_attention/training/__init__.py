"""Training of Focus routers and the baselines (docs/method.md §6): the settings
(:mod:`.config` for ``focus train``, :mod:`.settings` for ``focus pretrain``), the run on
``transformers.Trainer`` (:mod:`.run`, :mod:`.trainer`, :mod:`.callbacks`), the run's files
(:mod:`.outputs`), the schedule and data order (:mod:`.schedule`) and the plot
(:mod:`.plot`). Each name is imported from its module on first access
(:mod:`focus_attention.utils.lazy`), so the settings modules load without torch."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            ".config": ("RESUME_FREE_FIELDS", "TrainConfig"),
            ".outputs": ("CHECKPOINT_DIR", "latest_checkpoint"),
            ".plot": ("write_plot",),
            ".run": ("TrainResult", "train"),
            ".schedule": ("EpochPermutations", "lr_factor"),
        }
    ),
)
