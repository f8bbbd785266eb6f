"""``focus calibrate``'s output is written all or nothing: the new adapter and its
``calibration.json`` are staged and put in place together, so a failure at any rename leaves
an earlier calibrated adapter in ``--out`` byte for byte (docs/method.md §8, "Files and
failures")."""

from __future__ import annotations

import errno
import os

import pytest

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
