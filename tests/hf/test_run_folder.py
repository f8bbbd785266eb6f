"""The run-folder format (``focus_attention.hf.run_folder``): which parts a run directory
holds, and the per-tensor digests of a model's base weights (peft's names undone, LoRA
tensors apart) with the whole-model digest over the same tensors."""

from __future__ import annotations

import types

import torch

from focus_attention.hf.run_folder import (
    LORA_DIR,
    MODEL_DIR,
    base_state,
    base_weights_report,
    run_parts,
    tensor_digests,
    tuned_model,
)
from focus_attention.utils.env import state_sha256


def _model(state: dict[str, torch.Tensor]) -> types.SimpleNamespace:
    return types.SimpleNamespace(state_dict=lambda: state)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 4, generator=g),
        "a.bias": torch.arange(5, dtype=torch.bfloat16),
        "e": torch.empty(0),
        "c.base_layer.weight": torch.ones(2, 2, dtype=torch.float16).t(),
        "c.lora_A.weight": torch.zeros(1, 2),
    }


def test_run_parts_reads_the_layout(tmp_path):
    assert run_parts(tmp_path) == {"focus": False, "lora": False, "model": False}
    (tmp_path / "focus_config.json").write_text("{}")
    (tmp_path / LORA_DIR).mkdir()
    (tmp_path / LORA_DIR / "adapter_config.json").write_text("{}")
    assert run_parts(tmp_path) == {"focus": True, "lora": True, "model": False}
    (tmp_path / MODEL_DIR).mkdir()
    (tmp_path / MODEL_DIR / "config.json").write_text("{}")
    assert run_parts(tmp_path)["model"]


def test_a_run_without_lora_or_trained_weights_is_the_base_itself(tmp_path):
    base = torch.nn.Linear(2, 2)
    assert tuned_model(base, tmp_path) is base


def test_base_state_undoes_peft_names_and_leaves_lora_out():
    assert sorted(base_state(_model(_state()))) == ["a.bias", "b.weight", "c.weight", "e"]


def test_digests_are_the_ones_results_recorded():
    model = _model(_state())
    # the values every earlier result file holds for these tensors
    assert tensor_digests(model) == {
        "b.weight": "ad05e3355dba29fd0eac92bd0258e56e7cbee1e390f099e0d1c9ccc5161d7aa5",
        "a.bias": "5eaea1fda70d03a98f1992be66303ef3ab78ba02fc675ce7dd6c58ed3e2b4eaf",
        "e": "ec7f76f7472e04c647204f36a089f0c56ca1159def9357b99d026970faeadc9d",
        "c.weight": "eff53bac1323de2645d5c1eac58c53dbff3932231252dd603b0c0a6e03487512",
    }
    report = base_weights_report({}, model)
    assert report["after"] == state_sha256(base_state(model))
    assert report["after"] == "d6dbecbdc02e5f01c9598325ca3ed90d51a7760cdb435c9046191c013fd302ff"
    assert (report["changed_count"], report["tensors"], report["lora_tensors"]) == (4, 4, 1)


def test_an_unchanged_model_reports_no_change():
    model = _model(_state())
    report = base_weights_report(tensor_digests(model), model)
    assert report["changed"] == [] and report["changed_count"] == 0
