"""``focus train`` stopped at every point of its final save (Ctrl-C, a failed write, a kill):
the output folder keeps the previous output or holds the finished one, never a mix, and the
next ``--resume`` reaches the uninterrupted run's result; "finished" is said only of an output
whose step count, interrupted flag and weights are the finished run's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from stops import ERRORS, run_until_stopped, stop_writes
from tiny_assets import tiny_config, use_tiny_assets

from focus_attention.training import CHECKPOINT_DIR, latest_checkpoint, train
from focus_attention.training import run as run_module
from focus_attention.training.outputs import trained_parts_differences


def _ctrl_c_at(stop: int):
    """A step hook that sends a real SIGINT (as from the terminal) after step ``stop``."""

    def hook(step, entry):
        if step == stop:
            os.kill(os.getpid(), signal.SIGINT)

    return hook


def _stop_plot(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.fixture(scope="module")
def reference(module_assets, tmp_path_factory):
    """An uninterrupted 6-step run (checkpoints every 2 steps, validation every 3)."""
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        out = tmp_path_factory.mktemp("reference") / "run"
        train(tiny_config(module_assets, out))
    return out


@pytest.fixture(scope="module")
def stopped(module_assets, tmp_path_factory):
    """The reference run stopped with Ctrl-C after step 3 (its output saved, interrupted)."""
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        out = tmp_path_factory.mktemp("stopped") / "run"
        with pytest.raises(KeyboardInterrupt):
            train(tiny_config(module_assets, out), callback=_ctrl_c_at(3))
    return out


@pytest.fixture(scope="module")
def unsaved(module_assets, stopped, tmp_path_factory):
    """``stopped`` resumed to step 6, with a second Ctrl-C in its final save: the last
    checkpoint is step 6's, the output still step 3's."""
    out = tmp_path_factory.mktemp("unsaved") / "run"
    shutil.copytree(stopped, out)
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        mp.setattr(run_module, "write_plot", _stop_plot)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_config(module_assets, out, resume=True))
    return out


def _result(out) -> dict:
    return json.loads((out / "train_result.json").read_text())


def _output_step(out) -> int:
    """The step of the output in ``out``: its result's, checked to be its weights' too."""
    step = _result(out)["steps"]
    assert not trained_parts_differences(out, out / CHECKPOINT_DIR / f"checkpoint-{step}")
    return step


def _log(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows
            if "train_runtime" not in r]  # fmt: skip


def _is_the_finished_run(out, reference) -> None:
    """``out`` holds the uninterrupted run's result: 6 steps, not interrupted, its weights
    and log, and a further resume has nothing to do."""
    doc = _result(out)
    assert doc["steps"] == 6 and doc["extra"]["interrupted"] is False
    ref, got = load_file(str(reference / "focus_model.safetensors")), load_file(str(out / "focus_model.safetensors"))  # fmt: skip
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert _log(out) == _log(reference)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left


def test_the_finish_check_names_what_is_not_finished(assets, unsaved):
    from focus_attention.training.outputs import newest_checkpoint

    ckpt = newest_checkpoint(unsaved)
    why = run_module.unfinished_output(tiny_config(assets, unsaved, resume=True), unsaved, ckpt)
    assert ckpt.step == 6 and len(why) == 3, why
    assert "train_result.json records 3 steps, the run has 6" in why[0]
    assert "records an interrupted run" in why[1]
    assert why[2] == "focus_model.safetensors not those of checkpoint-6"


def _stop_digest():
    """``weights_sha256`` that stops at its second call (the base weights' digest after
    training; the first is before)."""
    real, calls = run_module.weights_sha256, []

    def digest(model):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(model)

    return digest


def _stop_rename(monkeypatch):
    """``replace_entries`` that stops after its first entry is in place."""
    real = run_module.replace_entries

    def replace_entries(staged, dest):
        rename, calls = os.replace, []

        def counted(a, b):
            calls.append(1)
            if len(calls) == 3:  # entry 1 set aside and moved in; entry 2 set aside
                raise KeyboardInterrupt
            return rename(a, b)

        with monkeypatch.context() as m:
            m.setattr(os, "replace", counted)
            return real(staged, dest)

    return replace_entries


@pytest.mark.parametrize("point", ["plot", "digest", "rename"])
def test_a_second_ctrl_c_in_the_final_save_keeps_the_output_and_resume_finishes(assets, reference, stopped, tmp_path, monkeypatch, capsys, point):  # fmt: skip
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    stop = {"plot": ("write_plot", _stop_plot), "digest": ("weights_sha256", _stop_digest()),
            "rename": ("replace_entries", _stop_rename(monkeypatch))}[point]  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr(run_module, *stop)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_config(assets, out, resume=True))
    assert latest_checkpoint(out).name == "checkpoint-6"
    assert _output_step(out) == 3 and _result(out)["extra"]["interrupted"]  # kept as it was
    capsys.readouterr()
    resumed = train(tiny_config(assets, out, resume=True))
    assert "already_finished" not in resumed.extra and resumed.steps == 6
    assert "not its final one" in capsys.readouterr().err
    _is_the_finished_run(out, reference)
    again = train(tiny_config(assets, out, resume=True))
    assert again.extra.get("already_finished")


def _stopped_save_then_resume(assets, reference, unsaved, out, monkeypatch, at, error) -> None:
    shutil.copytree(unsaved, out)
    with monkeypatch.context() as m:
        stop_writes(m, run_module._Run, "publish", at, error)
        run_until_stopped(lambda: train(tiny_config(assets, out, resume=True)), error)
    assert _output_step(out) in (3, 6)  # the previous output or the finished one, whole
    train(tiny_config(assets, out, resume=True))
    _is_the_finished_run(out, reference)


def _write_points(assets, unsaved, tmp_path, monkeypatch) -> int:
    """How many write operations the final save of ``unsaved`` makes."""
    out = tmp_path / "count"
    shutil.copytree(unsaved, out)
    with monkeypatch.context() as m:
        seen = stop_writes(m, run_module._Run, "publish")
        train(tiny_config(assets, out, resume=True))
    assert seen.count("replace") >= 8 and "fsync" in seen  # the save does write
    return len(seen)


def test_a_stop_at_the_first_middle_and_last_write_of_the_final_save(assets, reference, unsaved, tmp_path, monkeypatch):  # fmt: skip
    points = _write_points(assets, unsaved, tmp_path, monkeypatch)
    cases = [(0, ERRORS["ctrl-c"]), (points // 2, ERRORS["disk-full"]), (points - 1, ERRORS["ctrl-c"])]  # fmt: skip
    for i, (at, error) in enumerate(cases):
        _stopped_save_then_resume(assets, reference, unsaved, tmp_path / f"run{i}", monkeypatch, at, error)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("error", list(ERRORS))
def test_a_stop_at_every_write_of_the_final_save(assets, reference, unsaved, tmp_path, monkeypatch, error):  # fmt: skip
    points = _write_points(assets, unsaved, tmp_path, monkeypatch)
    for at in range(points):
        _stopped_save_then_resume(assets, reference, unsaved, tmp_path / f"run{at}", monkeypatch, at, ERRORS[error])  # fmt: skip


#: a process that resumes a run and is killed (SIGKILL) at one rename of its final save
KILLED = textwrap.dedent("""
    import json, os, signal, sys
    from focus_attention.training import TrainConfig, train
    from focus_attention.training import run
    config, at = TrainConfig.from_dict(json.loads(sys.argv[1])), int(sys.argv[2])
    real_publish, real_replace, seen = run._Run.publish, os.replace, []
    def replace(a, b):
        seen.append(1)
        if len(seen) - 1 == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(a, b)
    def publish(self, result):
        os.replace = replace
        return real_publish(self, result)
    run._Run.publish = publish
    train(config)
""")


@pytest.mark.slow
@pytest.mark.parametrize("at", [0, 3, 7])
def test_a_kill_in_the_final_save_then_resume_finishes(assets, reference, unsaved, tmp_path, at):
    out = tmp_path / "run"
    shutil.copytree(unsaved, out)
    config = tiny_config(assets, out, resume=True).to_dict()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", KILLED, json.dumps(config), str(at)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert any(p.name.startswith(".") for p in out.iterdir())  # the kill left its staging
    train(tiny_config(assets, out, resume=True))
    _is_the_finished_run(out, reference)
