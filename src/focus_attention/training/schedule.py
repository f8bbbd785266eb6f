"""The learning-rate schedule and the data order of a training run (docs/method.md §6):
both depend only on the step, so a resumed run repeats an uninterrupted one exactly."""

from __future__ import annotations

import math

import torch

__all__ = ["block_indices", "lr_factor"]


def lr_factor(step: int, steps: int, warmup_steps: int) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based): ``(step + 1) /
    warmup_steps`` during warm-up, then a cosine from 1 to 0 over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    rest = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / rest)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def block_indices(
    step: int, micro: int, *, batch_size: int, grad_accum: int, num_blocks: int, seed: int
) -> list[int]:
    """Indices of the training blocks of micro-batch ``micro`` of optimizer step ``step``.

    The blocks are visited in a seeded random permutation, a fresh one per epoch (a pass
    over the ``num_blocks`` blocks), so the result depends only on ``(seed, step, micro)``.
    """
    first = step * batch_size * grad_accum + micro * batch_size
    out = []
    perm_epoch, perm = -1, None
    for i in range(first, first + batch_size):
        epoch, pos = divmod(i, num_blocks)
        if epoch != perm_epoch:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perm = torch.randperm(num_blocks, generator=gen)
            perm_epoch = epoch
        out.append(int(perm[pos]))
    return out
