"""The files of a ``focus train`` run (training/outputs.py): which checkpoint a resume
continues from (complete Trainer checkpoints only, phase 2 after phase 1), the log's
truncation, and the rule that an output directory holds one run."""

from __future__ import annotations

import json

import pytest

from focus_attention.training.outputs import (
    LOG_NAME,
    checkpoint_root,
    latest_checkpoint,
    newest_checkpoint,
    prepare_out,
    read_log,
    truncate_log,
    write_run_state,
)


def _checkpoint(out, step, *, phase=1, offset=0, world_size=1, trainer_state=True):
    path = checkpoint_root(out, phase) / f"checkpoint-{step}"
    path.mkdir(parents=True)
    write_run_state(path, world_size=world_size, phase=phase, step_offset=offset)
    if trainer_state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_the_newest_complete_checkpoint_is_resumed(tmp_path):
    assert newest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 2)
    ten = _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, trainer_state=False)  # cut before the Trainer's state
    torn = _checkpoint(tmp_path, 14)
    (torn / "trainer_state.json").write_text('{"global_st')  # cut while written
    (checkpoint_root(tmp_path) / "checkpoint-16").mkdir()  # nothing in it
    (checkpoint_root(tmp_path) / "other-20").mkdir()
    found = newest_checkpoint(tmp_path)
    assert (found.path, found.step, found.phase, found.local_step) == (ten, 10, 1, 10)
    assert latest_checkpoint(tmp_path) == ten


def test_phase_two_checkpoints_count_the_steps_of_phase_one(tmp_path):
    _checkpoint(tmp_path, 4)
    second = _checkpoint(tmp_path, 3, phase=2, offset=4, world_size=2)
    found = newest_checkpoint(tmp_path)
    assert (found.path, found.step, found.phase, found.local_step, found.world_size) == (
        second, 7, 2, 3, 2,
    )  # fmt: skip


def test_a_resumed_log_drops_what_came_after_the_checkpoint(tmp_path):
    log = tmp_path / LOG_NAME
    rows = [{"step": 0, "val_ppl": 9.0}, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5},
            {"step": 2, "train_runtime": 3.0}, {"step": 3, "loss": 1.0}]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    assert read_log(log) == rows  # the line cut by a kill is dropped
    truncate_log(log, 2)
    assert read_log(log) == rows[:3]


def test_an_output_directory_holds_one_run(tmp_path):
    prepare_out(tmp_path, resume=False, overwrite=False)  # empty: fine
    checkpoint_root(tmp_path).mkdir(parents=True)  # a run that stopped before a checkpoint
    prepare_out(tmp_path, resume=False, overwrite=False)
    (tmp_path / LOG_NAME).write_text("")
    _checkpoint(tmp_path, 1)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds a training run.*--resume.*--overwrite"):
        prepare_out(tmp_path, resume=False, overwrite=False)
    prepare_out(tmp_path, resume=True, overwrite=False)  # kept
    assert (tmp_path / LOG_NAME).exists()
    prepare_out(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # the user's file stays
