"""The learning-rate schedule and the data order of a training run (docs/method.md §6):
both depend only on the step and the seed, so a resumed run repeats an uninterrupted one
exactly, and the data order does not depend on the number of processes."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import torch

__all__ = ["EpochPermutations", "lr_factor", "warn_long_warmup"]


def lr_factor(step: int, steps: int, warmup_steps: int) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based): ``(step + 1) /
    warmup_steps`` during warm-up, then a cosine from 1 to 0 over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    rest = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / rest)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warn_long_warmup(command: str, steps: int, warmup_steps: int, peak: float, lr: float,
                     phase: str = "") -> bool:  # fmt: skip
    """Warn (``UserWarning``) when a warm-up of ``warmup_steps`` optimizer steps does not end
    before the last of ``steps``: the whole run (or ``phase``, such as ``"phase 1"``) then
    warms up, its learning rate peaks at ``peak`` times ``lr`` and never decays.

    Args:
        command: the command, for the message (``"focus train"``).
        steps: the optimizer steps of the run or phase.
        warmup_steps: the warm-up steps (``--warmup-steps``).
        peak: the largest learning-rate multiplier the schedule reaches in ``steps`` steps.
        lr: the peak learning rate asked for (``--lr``).
        phase: which phase, for a run of several (``""``: the run).

    Returns:
        whether it warned.
    """
    if steps <= 0 or warmup_steps < steps:
        return False
    what = f"{phase} ({steps} steps)" if phase else f"--steps {steps}"
    warnings.warn(
        f"{command}: --warmup-steps {warmup_steps} is not below {what}: the learning rate "
        f"only warms up, peaking at {peak:.3g} x --lr {lr:g} = {peak * lr:.3g} and never "
        f"decaying; give fewer warm-up steps (below {steps}) to reach --lr",
        UserWarning,
        stacklevel=3,
    )
    return True


class EpochPermutations(torch.utils.data.Sampler[int]):
    """The training blocks' order: the indices ``0 .. num_blocks - 1`` in a seeded random
    permutation, a fresh one per epoch (``torch.randperm`` with a CPU generator seeded by
    ``seed * 1_000_003 + epoch``), cut to a whole number of ``step_blocks`` (the blocks one
    optimizer step takes over every process: batch size x accumulation x processes; the
    rest of a permutation waits for a later epoch). ``set_epoch`` (called by the Trainer and
    by accelerate's data loader) picks the epoch. Under data parallelism accelerate deals
    the batches of this one order to the ranks in turn, so every step takes the blocks one
    process takes with the ranks' micro-batches in rank order, in every epoch.

    Raises:
        ValueError: fewer blocks than one step takes.
    """

    def __init__(self, num_blocks: int, seed: int, step_blocks: int = 1) -> None:
        if step_blocks < 1 or num_blocks < step_blocks:
            raise ValueError(
                f"EpochPermutations: {num_blocks} training blocks, {step_blocks} per optimizer "
                "step; expected at least one step's blocks (more text, a shorter seq_len or a "
                "smaller batch_size x grad_accum x processes)"
            )
        self.num_blocks, self.seed, self.epoch = num_blocks, seed, 0
        self.length = num_blocks // step_blocks * step_blocks

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.num_blocks, generator=gen)[: self.length].tolist())

    def __len__(self) -> int:
        return self.length
