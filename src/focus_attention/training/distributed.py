"""The end of a run that a launcher (``torchrun``, ``accelerate launch``) started on several
processes: the ranks leave the default process group together."""

from __future__ import annotations

import torch.distributed as dist


def end_process_group() -> bool:
    """Destroy the default ``torch.distributed`` process group once every rank reaches this
    call (a barrier first): a rank that destroys it while another still communicates can
    leave that one waiting in gloo's shutdown, and a process that exits with the group alive
    can abort in its teardown (``terminate called without an active exception``) or, with
    NCCL, warn of leaked resources.

    The Trainer (through accelerate) initialises the group and never destroys it; the
    command that ran the Trainer calls this after its last collective operation.

    Returns:
        True when a group was destroyed, False when none was initialised (one process).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True
