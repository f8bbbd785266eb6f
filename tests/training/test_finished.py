"""A ``focus train`` run is "finished" only when its result says so, it resumes only on the
data it trained on, from a checkpoint whose files are whole, and only one run writes its
folder at a time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from tiny_assets import make_corpus_dir, tiny_config, use_tiny_assets

from focus_attention import cli
from focus_attention.training import train
from focus_attention.training.outputs import (
    LOCK_NAME,
    RESULT_NAME,
    RUN_STATE_NAME,
    newest_checkpoint,
    train_result_unfinished,
)
from focus_attention.utils.io import FolderInUseError, UnreadableFileError

FINISHED = {"steps": 4, "trainable_parameters": 576, "train_seconds": 1.5,
            "extra": {"interrupted": False}, "config": {"steps": 4}}  # fmt: skip


def _changed(change):
    doc = json.loads(json.dumps(FINISHED))
    change(doc)
    return doc


@pytest.mark.parametrize("case, doc, why", [
    ("no interrupted flag", _changed(lambda d: d["extra"].pop("interrupted")),
     "train_result.json: extra: no key 'interrupted' (an older release's result"),
    ("no extra", _changed(lambda d: d.pop("extra")), "train_result.json: no key 'extra'"),
    ("a flag of null", _changed(lambda d: d["extra"].update(interrupted=None)),
     "train_result.json: extra.interrupted is null, not true or false"),
    ("a flag as text", _changed(lambda d: d["extra"].update(interrupted="false")),
     "train_result.json: extra.interrupted is a string, not true or false"),
    ("interrupted", _changed(lambda d: d["extra"].update(interrupted=True)),
     "train_result.json records an interrupted run"),
    ("fewer steps", _changed(lambda d: d.update(steps=3)), "train_result.json records 3 steps, the run has 4"),  # fmt: skip
    ("more steps", _changed(lambda d: d["config"].update(steps=3)), "train_result.json records 4 steps, the run has 3"),  # fmt: skip
    ("no step count", _changed(lambda d: d.pop("steps")), "train_result.json: no key 'steps'"),
    ("no settings", _changed(lambda d: d.pop("config")), "train_result.json: no key 'config'"),
    ("a JSON list", [FINISHED], "train_result.json: the document is a JSON array"),
])  # fmt: skip
def test_a_result_is_finished_only_when_its_steps_and_flags_say_so(case, doc, why):
    """Every way a result can fall short of a finished run's, the interrupted flag's
    absence first among them, gives a reason; the finished result gives none."""
    assert train_result_unfinished(FINISHED) == []
    reasons = train_result_unfinished(doc)
    assert any(why in r for r in reasons), reasons


def test_the_planned_steps_are_the_runs_settings_when_given():
    assert train_result_unfinished(FINISHED, 4) == []
    assert train_result_unfinished(FINISHED, 30) == ["train_result.json records 4 steps, the run has 30"]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# runs of a tiny model
# ---------------------------------------------------------------------------------------------


def _config(assets, out, **changes):
    """A 4-step run, a checkpoint every 2 steps, no validation (quick)."""
    return tiny_config(assets, out, **{"steps": 4, "eval_every": -1, **changes})


@pytest.fixture(scope="module")
def books(module_assets, tmp_path_factory):
    """A corpus folder of this module's own (its text is changed by a test)."""
    return make_corpus_dir(tmp_path_factory.mktemp("books") / "books")


@pytest.fixture(scope="module")
def finished(module_assets, books, tmp_path_factory):
    """A finished 4-step run on ``books`` (checkpoints 2 and 4)."""
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        out = tmp_path_factory.mktemp("finished") / "run"
        train(_config(module_assets, out, corpus=str(books)))
    return out


def _at_step_two(finished, tmp_path):
    """A copy of ``finished`` as a run stopped after step 2: its newest checkpoint is step
    2's and its output is not the final one."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints" / "checkpoint-4")
    (out / RESULT_NAME).unlink()
    return out


def _result(out) -> dict:
    return json.loads((out / RESULT_NAME).read_text())


def test_the_run_records_the_fingerprint_of_its_data(finished):
    data = _result(finished)["extra"]["data"]
    assert len(data["train_blocks"]) == 64 and data["blocks"] > 0
    assert newest_checkpoint(finished).data == data
    state = json.loads((finished / "checkpoints" / "checkpoint-2" / RUN_STATE_NAME).read_text())
    assert state["data"] == data


def test_a_resume_after_the_corpus_text_changed_is_refused(assets, books, finished, tmp_path):
    out = _at_step_two(finished, tmp_path)
    book = books / "book0.txt"
    text = book.read_text()
    try:
        book.write_text(text.replace(" the ", " a "))
        with pytest.raises(ValueError) as err:
            train(_config(assets, out, corpus=str(books), resume=True))
        message = str(err.value)
        then = _result(finished)["extra"]["data"]["train_blocks"]
        assert message.startswith(f"--resume: the training data differ from those the run in {out} trained on: checkpoint-2 records ")  # fmt: skip
        assert then in message and "--overwrite" in message
        assert newest_checkpoint(out).step == 2 and not (out / RESULT_NAME).exists()  # untouched
    finally:
        book.write_text(text)
    resumed = train(_config(assets, out, corpus=str(books), resume=True))  # the same text again
    assert resumed.start_step == 2 and resumed.steps == 4


def test_a_checkpoint_without_a_fingerprint_resumes_and_says_so(assets, books, finished, tmp_path, capsys):  # fmt: skip
    out = _at_step_two(finished, tmp_path)
    state = out / "checkpoints" / "checkpoint-2" / RUN_STATE_NAME
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "data"}))  # fmt: skip
    capsys.readouterr()
    assert train(_config(assets, out, corpus=str(books), resume=True)).steps == 4
    assert "checkpoint-2 records no fingerprint of its training data" in capsys.readouterr().err


def test_a_result_without_its_interrupted_flag_is_not_taken_as_finished(assets, books, finished, tmp_path, capsys):  # fmt: skip
    """An older release's result (no ``interrupted`` flag) of a run whose checkpoints reach
    the last step: ``--resume`` writes the output anew from the last checkpoint instead of
    calling the run finished."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    doc = _result(out)
    del doc["extra"]["interrupted"]
    (out / RESULT_NAME).write_text(json.dumps(doc))
    capsys.readouterr()
    resumed = train(_config(assets, out, corpus=str(books), resume=True))
    assert "already_finished" not in resumed.extra
    err = capsys.readouterr().err
    assert "not its final one (train_result.json: extra: no key 'interrupted'" in err
    assert _result(out)["extra"]["interrupted"] is False and _result(out)["steps"] == 4
    again = train(_config(assets, out, corpus=str(books), resume=True))
    assert again.extra.get("already_finished")


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_optimizer_state_is_named_before_the_resume(assets, books, finished, tmp_path, capsys, damage):  # fmt: skip
    out = _at_step_two(finished, tmp_path)
    state = out / "checkpoints" / "checkpoint-2" / "optimizer.pt"
    if damage == "missing":
        state.unlink()
    else:
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    config = _config(assets, out, corpus=str(books), resume=True)
    error = FileNotFoundError if damage == "missing" else UnreadableFileError
    with pytest.raises(error, match=rf"^{state}: truncated or not a torch.save file .*; expected the optimizer \(AdamW\) state|^{state} not found; expected the optimizer"):  # fmt: skip
        train(config)
    capsys.readouterr()
    argv = ["train", "--model", config.model, "--corpus", config.corpus, "--out", str(out),
            "--resume", "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2",
            "--warmup-steps", "2", "--eval-every", "-1", "--eval-tokens", "64", "--save-every", "2",
            "--threads", "1", "--num-groups", "4", "--top-k", "2", "--window", "8",
            "--group-dim", "8", "--sink-tokens", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.startswith(f"focus: error: {state}")


HOLD = """
import sys, time
from focus_attention.utils.io import exclusive_lock
with exclusive_lock(sys.argv[1], "focus train --out " + sys.argv[2]):
    print("held", flush=True)
    time.sleep(300)
"""


def test_a_second_run_into_a_folder_in_use_refuses_naming_the_first(assets, books, finished, tmp_path, capsys):  # fmt: skip
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(out / LOCK_NAME), str(out)],
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "held"
        before = sorted(p.name for p in out.rglob("*"))
        for changes in ({"resume": True}, {"overwrite": True}):
            with pytest.raises(FolderInUseError) as err:
                train(_config(assets, out, corpus=str(books), **changes))
            assert str(err.value).startswith(f"{out} is in use by process {first.pid} on ")
            assert f"(focus train --out {out}, since " in str(err.value)
        assert sorted(p.name for p in out.rglob("*")) == before  # nothing written or deleted
    finally:
        first.kill()
        first.wait()
    capsys.readouterr()
    train(_config(assets, out, corpus=str(books), resume=True))  # the holder is gone
    assert not (out / LOCK_NAME).exists()
