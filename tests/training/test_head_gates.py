"""``focus train --method head-gates``: a gate per key-value head of a trained adapter,
trained alone (routers and base frozen) on needle prompts of the validation split with the
KL from the dense model plus a penalty on the mean gate; the gates are written as a ranking
file that ``focus calibrate --head-budget --head-ranking`` reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_assets import tiny_config

from focus_attention.evaluation.calibration import CalibrateConfig, calibrate_adapter
from focus_attention.hf.files import WEIGHTS_NAME
from focus_attention.hf.head_gates import GATES_NAME
from focus_attention.training import train


def _gates_config(assets, adapter, out, **kw):
    settings = dict(method="head-gates", objective="distill", init_adapter=str(adapter),
                    steps=3, seq_len=64, batch_size=1, lr=0.2, warmup_steps=0, eval_every=-1,
                    save_every=0, top_k=1, gate_penalty=1.0)  # fmt: skip
    return tiny_config(assets, out, **(settings | kw))


@pytest.mark.parametrize(
    "changes, match",
    [(dict(objective="lm"), "'distill' with --method head-gates"),
     (dict(init_adapter=None), "init_adapter"), (dict(gate_penalty=-1.0), "gate_penalty")],
)  # fmt: skip
def test_bad_gate_settings_are_refused(assets, adapter, tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        _gates_config(assets, adapter, tmp_path / "x", **changes)


def test_a_gate_penalty_needs_the_head_gates_method(assets, tmp_path):
    with pytest.raises(ValueError, match="gate_penalty.*head-gates"):
        tiny_config(assets, tmp_path / "x", gate_penalty=0.1)


def test_only_the_gates_train_and_calibrate_reads_them(assets, adapter, tmp_path):
    out = tmp_path / "gates"
    result = train(_gates_config(assets, adapter, out))
    data = json.loads((out / GATES_NAME).read_text())
    assert len(data["head_ranking"]) == 4 and data["config"]["model"] == str(assets["model"])
    gates = sorted(data["by_head"].values())
    assert gates[0] < 1.0  # the penalty closed gates from their start at 1
    assert [data["by_head"][f"{a}:{b}"] for a, b in data["head_ranking"]] == gates[::-1]
    new, old = load_file(str(out / WEIGHTS_NAME)), load_file(str(adapter / WEIGHTS_NAME))
    for name in ("projection", "centroids"):
        assert all(torch.equal(new[k], old[k]) for k in new if name in k)
    assert result.extra["method"]["groups"] == {"gates": 4} and result.trainable_parameters == 4
    assert result.extra["base_weights_sha256"]["equal"]
    record = calibrate_adapter(CalibrateConfig(
        model=str(assets["model"]), adapter=str(adapter), out=str(tmp_path / "cal"),
        corpus=str(assets["corpus"]), seq_len=64, blocks=0, progress=False, head_budget=0.5,
        head_ranking=str(out / GATES_NAME)))  # fmt: skip
    assert record["focus"]["dense_heads"] == sorted(data["head_ranking"][:2])
