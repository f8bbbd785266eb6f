"""``focus calibrate``'s output is written all or nothing: the new adapter and its
``calibration.json`` are staged and put in place together, so a failure at any rename leaves
an earlier calibrated adapter in ``--out`` byte for byte (docs/method.md §8, "Files and
failures")."""

from __future__ import annotations

import errno
import json
import os

import pytest
from stops import ERRORS, run_until_stopped, stop_writes

from focus_attention.evaluation import calibration
from focus_attention.evaluation.calibration import CalibrateConfig, calibrate_adapter


def _calibrate(assets, adapter, out, **kw):
    return calibrate_adapter(CalibrateConfig(model=str(assets["model"]), adapter=str(adapter),
                                             out=str(out), corpus=str(assets["corpus"]),
                                             seq_len=64, blocks=1, progress=False,
                                             overwrite=True, **kw))  # fmt: skip


def _files(root):
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_a_failed_calibration_leaves_the_earlier_output(assets, adapter, tmp_path, monkeypatch, fail_at):  # fmt: skip
    out = tmp_path / "calibrated"
    _calibrate(assets, adapter, out, window=5)
    before = _files(out)
    assert {"focus_config.json", "focus_model.safetensors", "calibration.json"} <= set(before)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        _calibrate(assets, adapter, out, window=6)
    monkeypatch.undo()
    assert _files(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no staging left
    _calibrate(assets, adapter, out, window=6)  # and the next try replaces it
    assert _files(out)["focus_config.json"] != before["focus_config.json"]


def _held_window(out) -> int:
    """The window of the calibrated adapter in ``out``, checked to be its record's and its
    weights file's too (the adapter loader compares the config copy inside the weights)."""
    from safetensors import safe_open

    window = json.loads((out / "focus_config.json").read_text())["window"]
    assert json.loads((out / "calibration.json").read_text())["config"]["window"] == window
    with safe_open(str(out / "focus_model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["focus_config"])["window"] == window
    return window


def _calibrate_through(module, assets, adapter, out, window):
    config = CalibrateConfig(model=str(assets["model"]), adapter=str(adapter), out=str(out),
                             corpus=str(assets["corpus"]), seq_len=64, blocks=1,
                             progress=False, overwrite=True, window=window)  # fmt: skip
    return module.calibrate_adapter(config)


@pytest.mark.parametrize("error", list(ERRORS))
def test_a_stop_at_any_write_leaves_the_earlier_output_or_the_new_one(assets, adapter, tmp_path, monkeypatch, error):  # fmt: skip
    """Ctrl-C or a full disk at each write of a calibration over an earlier one: ``--out``
    holds the earlier output (window 5) or the new one (window 6), never a mix; the next
    run writes the new one."""
    out = tmp_path / "calibrated"
    _calibrate(assets, adapter, out, window=5)
    with monkeypatch.context() as m:
        seen = stop_writes(m, calibration, "calibrate_adapter")
        _calibrate_through(calibration, assets, adapter, tmp_path / "count", 6)
    assert seen.count("replace") >= 3
    for at in range(len(seen)):
        with monkeypatch.context() as m:
            stop_writes(m, calibration, "calibrate_adapter", at, ERRORS[error])
            run = lambda: _calibrate_through(calibration, assets, adapter, out, 6)  # noqa: E731
            run_until_stopped(run, ERRORS[error])
        assert _held_window(out) in (5, 6), f"write {at} ({seen[at]})"
        assert not [p for p in out.iterdir() if p.name.startswith(".")]
        _calibrate(assets, adapter, out, window=5)
    _calibrate(assets, adapter, out, window=6)
    assert _held_window(out) == 6
