"""``focus calibrate``: an adapter whose routing bias was collected at a length and whose
config carries new inference settings. It must equal the source adapter with the same
overrides and ``focus eval --calibrate-blocks``, copy the trained routers unchanged, and
refuse outputs that would lose an adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tolerances import tolerance

from focus_attention import cli
from focus_attention.evaluation import evaluate
from focus_attention.evaluation.calibration import (  # fmt: skip
    CALIBRATION_NAME,
    CalibrateConfig,
    calibrate_adapter,
)
from focus_attention.hf.files import WEIGHTS_NAME

SETTINGS = dict(window=5, sink_tokens=2, top_k=1)


def _calibrate(assets, adapter, out, **kw):
    kw.setdefault("seq_len", 64)
    return calibrate_adapter(CalibrateConfig(model=str(assets["model"]), adapter=str(adapter),
                                             out=str(out), corpus=str(assets["corpus"]),
                                             progress=False, **kw))  # fmt: skip


def _evaluate(assets, adapter, **kw):
    return evaluate(model=str(assets["model"]), adapter=str(adapter), corpus=str(assets["corpus"]),
                    split="test", seq_len=64, max_tokens=192, top_k=[1, 2], soft=False,
                    threads=1, progress=False, **kw).to_dict()  # fmt: skip


def test_a_calibrated_adapter_equals_evaluating_with_calibration(assets, adapter, tmp_path):
    """The new adapter scores exactly what ``focus eval`` scores with the same overrides and
    calibration blocks; its projections and centroids are the source's, its bias is not."""
    out = tmp_path / "calibrated"
    record = _calibrate(assets, adapter, out, blocks=2, **SETTINGS)
    assert record["tokens"] == 2 * 64 and record["bias_change"] > 0
    assert {k: record["focus"][k] for k in SETTINGS} == SETTINGS
    saved = json.loads((out / CALIBRATION_NAME).read_text())
    assert saved["source"]["weights_sha256"] == record["source"]["weights_sha256"]
    new, old = load_file(str(out / WEIGHTS_NAME)), load_file(str(adapter / WEIGHTS_NAME))
    assert new.keys() == old.keys()
    for name in new:
        same = torch.equal(new[name], old[name])
        assert same != name.endswith(("routing_bias", "bias_updates")), name
    direct = _evaluate(assets, out)
    overridden = _evaluate(assets, adapter, calibrate_blocks=2, window=5, sink_tokens=2)
    assert direct["ppl"] == overridden["ppl"]
    assert direct["config"]["focus"]["window"] == 5


def test_no_blocks_changes_only_the_settings(assets, adapter, tmp_path):
    out = tmp_path / "settings"
    record = _calibrate(assets, adapter, out, blocks=0, dense_layers=(1,), query_top_k=2)
    assert record["tokens"] == 0 and record["bias_change"] == 0.0
    assert record["focus"]["dense_layers"] == [1] and record["focus"]["query_top_k"] == 2
    new, old = load_file(str(out / WEIGHTS_NAME)), load_file(str(adapter / WEIGHTS_NAME))
    assert all(torch.equal(new[k], old[k]) for k in new)
    overridden = _evaluate(assets, adapter, dense_layers=(1,), query_top_k=2)
    assert _evaluate(assets, out)["ppl"] == overridden["ppl"]


def test_outputs_that_would_lose_an_adapter_are_refused(assets, adapter, tmp_path):
    with pytest.raises(ValueError, match="is the source adapter"):
        _calibrate(assets, adapter, adapter, blocks=0)
    out = tmp_path / "once"
    _calibrate(assets, adapter, out, blocks=0)
    with pytest.raises(FileExistsError, match="--overwrite"):
        _calibrate(assets, adapter, out, blocks=0, window=3)
    assert _calibrate(assets, adapter, out, blocks=0, window=3, overwrite=True)["focus"]["window"] == 3  # fmt: skip
    with pytest.raises(ValueError, match="9999 blocks"):
        _calibrate(assets, adapter, tmp_path / "long", blocks=9999)
    assert not (tmp_path / "long").exists()


def test_paths_that_cannot_be_an_adapter_or_the_output_fail_before_the_model_loads(
    adapter, tmp_path, monkeypatch
):

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the paths were checked")

    monkeypatch.setattr("focus_attention.evaluation.calibration.load_model", no_loading)
    (tmp_path / "afile").write_text("")

    def run(source, out):
        calibrate_adapter(CalibrateConfig(adapter=str(source), out=str(out), progress=False))

    with pytest.raises(ValueError, match=r"out \(--out\): received .*afile', which is a file, "
                       "not a folder; expected a folder"):  # fmt: skip
        run(adapter, tmp_path / "afile")
    with pytest.raises(FileNotFoundError, match=r"focus_model\.safetensors is a file, not a "
                       r"folder; .*: pass .*, the folder that holds it"):  # fmt: skip
        run(adapter / WEIGHTS_NAME, tmp_path / "o")
    (tmp_path / "sweep" / "cells" / "k4").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"output folder of focus sweep: pass one of its "
                       r"1 cells, such as .*sweep/cells/k4"):  # fmt: skip
        run(tmp_path / "sweep", tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("have", "words"), [(0, "0 blocks"), (1, "1 block"), (2, "2 blocks")])
def test_too_few_calibration_blocks_are_counted_in_words(monkeypatch, have, words):
    from focus_attention.evaluation import calibration
    from focus_attention.evaluation.calibration import calibration_blocks

    class Corpus:
        def texts(self, split):
            return ["text"]

    monkeypatch.setattr(calibration, "load_corpus", lambda *a, **k: Corpus())
    monkeypatch.setattr(calibration, "token_blocks", lambda *a, **k: torch.zeros(have, 8))
    with pytest.raises(ValueError, match=f"the validation split of austen has {words} of 8 tokens$"):  # fmt: skip
        calibration_blocks(None, "austen", "validation", 8, 1000, False)


@pytest.mark.parametrize(
    "changes, match",
    [(dict(adapter=None), "adapter"), (dict(out=""), "out"), (dict(blocks=-1), "blocks"),
     (dict(seq_len=1), "seq_len"), (dict(split="dev"), "split"),
     (dict(query_top_k=0), "query_top_k")],
)  # fmt: skip
def test_bad_settings_are_refused(changes, match):
    settings = dict(adapter="a", out="b") | changes
    with pytest.raises(ValueError, match=match):
        CalibrateConfig(**settings)


def test_the_command_line(assets, adapter, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli.main(["calibrate", "--model", str(assets["model"]), "--adapter", str(adapter),
                   "--out", str(out), "--corpus", str(assets["corpus"]), "--seq-len", "64",
                   "--blocks", "1", "--window", "6", "--no-progress"])  # fmt: skip
    assert rc == 0 and "window 6" in capsys.readouterr().out
    assert json.loads((out / CALIBRATION_NAME).read_text())["config"]["blocks"] == 1
    assert cli.main(["calibrate", "--adapter", str(adapter)]) != 0


def test_every_calibration_block_is_folded_into_the_saved_bias(assets, adapter, tmp_path):
    """``focus calibrate --blocks 3`` saves the bias of the three validation blocks folded in
    order (``bias_updates`` 3), computed here from each block's bias taken alone."""
    from focus_attention.assets.models import auto_prepend_bos, load_model
    from focus_attention.evaluation.calibration import calibration_blocks
    from focus_attention.hf import FocusModel

    out = tmp_path / "three"
    _calibrate(assets, adapter, out, blocks=3)
    saved = load_file(str(out / WEIGHTS_NAME))
    base, tokenizer = load_model(str(assets["model"]), quiet=True)
    fm = FocusModel.from_pretrained(base, adapter)
    momentum = fm.focus_config.bias_momentum
    blocks = calibration_blocks(tokenizer, str(assets["corpus"]), "validation", 64, 3,
                                auto_prepend_bos(base))  # fmt: skip
    alone = []
    for block in blocks:
        fm.calibrate(block[None], reset=True)
        alone.append({i: r.routing_bias.double().clone() for i, r in fm.routers.items()})
    for i in fm.routers:
        want = torch.zeros_like(alone[0][i])
        for n, part in enumerate(a[i] for a in alone):
            weight = max(momentum, 1.0 / (n + 1))
            want = (1.0 - weight) * want + weight * part
        assert int(saved[f"layer.{i}.bias_updates"].reshape(())) == 3
        torch.testing.assert_close(saved[f"layer.{i}.routing_bias"].double(), want,
                                   **tolerance("reordered"))  # fmt: skip
