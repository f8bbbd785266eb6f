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
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import TrainerCallback

__all__ = [
    "CurrentIntervals",
    "JsonlLog",
    "SigintCheckpoint",
    "StepHook",
    "StepProgress",
    "StepTimer",
]


class StepTimer(TrainerCallback):
    """Wall seconds spent in optimizer steps (forward, backward, optimizer; validation and
    checkpointing excluded), for the throughput: ``seconds`` (float, s; starting from
    ``seconds``, a resumed run's earlier ones) over ``steps`` (this process's, since it
    started). A log entry with a training ``loss`` gets ``seconds`` (callbacks listed
    after this one see it)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.steps, self._start = float(seconds), 0, 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds += time.perf_counter() - self._start
        self.steps += 1

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs is not None and "loss" in logs:
            logs["seconds"] = self.seconds


class JsonlLog(TrainerCallback):
    """Appends every Trainer log entry (``{"step": step_offset + global step, **logs}``) to
    the JSON-lines file ``path``, on the main process only; ``rows`` (a new list, or the one
    given, which several Trainer runs may share) keeps this process's entries in memory
    (every process)."""

    def __init__(self, path: Path, step_offset: int = 0, rows: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
        self.path, self.step_offset = Path(path), step_offset
        self.rows: list[dict[str, Any]] = [] if rows is None else rows

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not logs:
            return
        row = {"step": state.global_step + self.step_offset, **logs}
        self.rows.append(row)
        if state.is_world_process_zero:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")


class CurrentIntervals(TrainerCallback):
    """This run's logging, validation and checkpoint intervals after a resume: the Trainer
    takes them from the checkpoint's state, which was written with the earlier run's
    arguments (they do not change what trains, so a resumed run may change them)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        state.compute_steps(args, state.max_steps)


class StepProgress(TrainerCallback):
    """A tqdm bar of the optimizer steps on the main process (standard error), with the
    last entry's loss, dominance, learning rate and validation perplexity as its postfix:
    the Trainer's own progress and printer callbacks print every entry, one line each."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train") -> None:
        self.total, self.initial, self.desc, self.bar = total, initial, desc, None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.bar is None:
            self.bar = tqdm(total=self.total, initial=self.initial, desc=self.desc,
                            dynamic_ncols=True, file=sys.stderr)  # fmt: skip

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.bar is None or not logs:
            return
        post = {"loss": logs.get("loss"), "dom": logs.get("dominance"),
                "lr": logs.get("learning_rate"),
                "val_ppl": logs.get("val_ppl_topk", logs.get("val_ppl"))}  # fmt: skip
        shown = {k: (f"{v:.1e}" if k == "lr" else f"{v:.3f}") for k, v in post.items() if v is not None}  # fmt: skip
        if shown:
            self.bar.set_postfix(shown, refresh=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepHook(TrainerCallback):
    """Calls ``hook(step, logs)`` for every log entry with a training ``loss``, with the
    run's 1-based optimizer step (``step_offset`` + the Trainer's global step), after the
    entry is logged and before the step's validation and checkpoint. What ``hook`` raises
    stops training."""

    def __init__(self, hook: Any, step_offset: int = 0) -> None:
        self.hook, self.step_offset = hook, step_offset

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.hook(state.global_step + self.step_offset, logs)


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the initialised default process group (the flag
    itself in one process): one ``all_reduce`` of one integer."""
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
    handler is restored when training ends). After every optimizer step, log entry and validation the ranks agree on
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
        print("\nCtrl-C: stopping after the step in progress and saving it "
              "(Ctrl-C again stops at once, without saving)", file=sys.stderr, flush=True)  # fmt: skip

    def _restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(control)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(control)  # a Ctrl-C while the step is logged stops after it

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(control)  # a Ctrl-C during the step's validation stops after it

    def _check(self, control: Any) -> None:
        if _any_rank(self._pending):
            self.interrupted = True
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._restore()
