"""Centroid-only training of a frozen model (docs/method.md §6): the settings
(:mod:`.config`), the loop (:mod:`.loop`), checkpoints and run files (:mod:`.checkpoint`),
the schedule and data order (:mod:`.schedule`) and the plot (:mod:`.plot`)."""

from .checkpoint import CHECKPOINT_DIR, STATE_NAME, latest_checkpoint
from .config import RESUME_FREE_FIELDS, TrainConfig
from .loop import TrainResult, train
from .plot import write_plot
from .schedule import block_indices, lr_factor

__all__ = [
    "CHECKPOINT_DIR",
    "RESUME_FREE_FIELDS",
    "STATE_NAME",
    "TrainConfig",
    "TrainResult",
    "block_indices",
    "latest_checkpoint",
    "lr_factor",
    "train",
    "write_plot",
]
