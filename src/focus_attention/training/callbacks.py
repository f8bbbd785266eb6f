"""``transformers.TrainerCallback`` pieces shared by the training commands (docs/method.md §6):
the JSON-lines log, the step timer and Ctrl-C (SIGINT) handling that saves a Trainer
checkpoint of the last completed step and stops, so that ``resume_from_checkpoint`` (the
``--resume`` flag) continues to the uninterrupted run's result.

None of them reduces anything across ranks by hand except the stop decision of
:class:`SigintCheckpoint` (every rank must stop after the same step); the routing statistics
are combined by the routers themselves (:meth:`~focus_attention.hf.router.FocusRouter.
update_bias`).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["JsonlLog", "SigintCheckpoint", "StepTimer"]


class StepTimer(TrainerCallback):
    """Wall seconds spent in optimizer steps (forward, backward, optimizer; validation and
    checkpointing excluded), for the throughput: ``seconds`` (float, s) over ``steps``."""

    def __init__(self) -> None:
        self.seconds, self.steps, self._start = 0.0, 0, 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds += time.perf_counter() - self._start
        self.steps += 1


class JsonlLog(TrainerCallback):
    """Appends every Trainer log entry (``{"step": ..., **logs}``) to the JSON-lines file
    ``path``, on the main process only."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs:
            with self.path.open("a") as fh:
                fh.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the initialised default process group (the flag
    itself in one process): one ``all_reduce`` of one integer."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class SigintCheckpoint(TrainerCallback):
    """Ctrl-C during training: the step in progress completes, then the Trainer saves a
    checkpoint of it (``control.should_save``) and stops (``control.should_training_stop``).

    While training, SIGINT only sets a flag (installed in the main thread only; the previous
    handler is restored when training ends). After every optimizer step the ranks agree on
    the flag (one ``all_reduce`` when a process group is initialised), so a launcher's
    Ctrl-C, which reaches every rank at slightly different times, stops them all after the
    same step. A second Ctrl-C while the first is pending raises ``KeyboardInterrupt`` at
    once (no checkpoint). ``interrupted`` (bool) says whether training was stopped this way;
    the caller then saves what it saves at the end of a run and tells the user to resume.
    """

    def __init__(self) -> None:
        self.interrupted = False
        self._pending = False
        self._previous: Any = None
        self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self._pending:
            self._restore()
            raise KeyboardInterrupt
        self._pending = True

    def _restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if _any_rank(self._pending):
            self.interrupted = True
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._restore()
