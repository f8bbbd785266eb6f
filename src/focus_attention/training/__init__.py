"""Training of Focus routers and the baselines (docs/method.md §6): the settings
(:mod:`.config` for ``focus train``, :mod:`.settings` for ``focus pretrain``), the loop
(:mod:`.loop`), checkpoints and run files (:mod:`.checkpoint`), the schedule and data order
(:mod:`.schedule`) and the plot (:mod:`.plot`). Each name is imported from its module on
first access (:mod:`focus_attention.utils.lazy`), so the settings modules load without torch."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            ".checkpoint": ("CHECKPOINT_DIR", "STATE_NAME", "latest_checkpoint"),
            ".config": ("RESUME_FREE_FIELDS", "TrainConfig"),
            ".loop": ("TrainResult", "train"),
            ".plot": ("write_plot",),
            ".schedule": ("block_indices", "lr_factor"),
        }
    ),
)
