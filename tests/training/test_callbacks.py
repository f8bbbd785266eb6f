"""The Trainer callbacks shared by the training commands: Ctrl-C saves a checkpoint of the
step in progress and stops, and resuming from it gives the uninterrupted run; the JSON-lines
log and the step timer."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from tiny import FOCUS_DEFAULTS, build_model, ids
from tolerances import tolerance

from focus_attention.hf import FocusConfig, get_focus_model
from focus_attention.training.callbacks import JsonlLog, SigintCheckpoint, StepTimer

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class CtrlCDuringStep(TrainerCallback):
    """Delivers SIGINT to this process in the middle of optimizer step ``step`` (1-based)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            signal.raise_signal(signal.SIGINT)


def run(out, *callbacks, resume=None):
    torch.set_num_threads(1)
    model = get_focus_model(build_model("llama"), FocusConfig(**FOCUS_DEFAULTS))
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids(12, 32, seed=3)]
    args = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=2,
                             learning_rate=1e-2, save_steps=10, report_to=[], use_cpu=True,
                             seed=0, disable_tqdm=True, logging_steps=1)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {k: v.detach().clone() for k, v in model.routers.state_dict().items()}


@pytest.mark.slow
def test_ctrl_c_saves_the_step_in_progress_and_resume_gives_the_uninterrupted_run(tmp_path):
    _, straight = run(tmp_path / "straight")
    sigint = SigintCheckpoint()
    before = signal.getsignal(signal.SIGINT)
    trainer, _ = run(tmp_path / "cut", sigint, CtrlCDuringStep(2))
    assert sigint.interrupted and trainer.state.global_step == 2
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored
    checkpoints = sorted(p.name for p in (tmp_path / "cut").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2"]  # not a save step: saved because of Ctrl-C
    _, resumed = run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-2"))
    for name, want in straight.items():
        torch.testing.assert_close(resumed[name], want, **tolerance("rounding"), msg=name)
    assert int(resumed["0.bias_updates"]) == 4


def test_a_second_ctrl_c_interrupts_at_once_and_restores_the_handler():
    sigint = SigintCheckpoint()
    before = signal.getsignal(signal.SIGINT)
    sigint.on_train_begin(None, None, None)
    signal.raise_signal(signal.SIGINT)  # first: only noted
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_the_log_has_every_step_and_the_timer_counts_them(tmp_path):
    log, timer = JsonlLog(tmp_path / "log.jsonl"), StepTimer()
    run(tmp_path / "run", log, timer)
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert timer.steps == 4 and timer.seconds > 0
