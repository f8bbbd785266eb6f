"""Changing the settings of a built adapter: ``FocusModel.focus_config = ...`` and
``set_top_k`` take effect on the next forward (as if the adapter had been built with them),
invalid or shape-changing configs raise ``ValueError``, and ``FocusConfig`` is immutable."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import build_model, focus, ids

from focus_attention.hf import FIXED_CONFIG_FIELDS, FocusConfig, FocusModel, get_focus_model

BASE = dict(num_groups=4, window=8, top_k=2, sink_tokens=2)


def logits(fm, x):
    with torch.no_grad():
        return fm(input_ids=x, use_cache=False).logits


@pytest.mark.parametrize(
    "start, change",
    [
        ({}, {"top_k": 1}),
        ({}, {"window": 4}),
        ({}, {"sink_tokens": 0}),
        ({}, {"inference_routing": "sequence"}),
        ({}, {"routing": "soft"}),
        ({"routing": "soft"}, {"temperature": 0.5}),
        ({"routing": "soft"}, {"gate": "paper"}),
        ({"routing": "soft", "gate": "paper"}, {"gate_sharpness": 2.0}),
        ({"routing": "soft"}, {"sinkhorn_iters": 2}),
    ],
)
def test_assigned_config_matches_a_fresh_adapter(start, change):
    x = ids(2, 40, seed=1)
    _, fm = focus("llama", **{**BASE, **start})
    before = logits(fm, x)
    fm.focus_config = fm.focus_config.replace(**change)
    after = logits(fm, x)
    _, fresh = focus("llama", **{**BASE, **start, **change})
    assert fm.focus_config == fresh.focus_config
    assert torch.equal(after, logits(fresh, x))
    assert not torch.allclose(after, before)  # the change mattered: not silently ignored


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_set_top_k_changes_the_routing_and_back(arch):
    x = ids(1, 48, seed=2)
    _, fm = focus(arch, **BASE)
    two = logits(fm, x)
    assert fm.set_top_k(1) is fm and fm.focus_config.top_k == 1
    with fm.record_routing() as records:
        one = logits(fm, x)
    assert records and all(bool((r["query_groups"].sum(-1) == 1).all()) for r in records)
    _, fresh = focus(arch, **{**BASE, "top_k": 1})
    assert torch.equal(one, logits(fresh, x)) and not torch.allclose(one, two)
    fm.set_top_k(2)
    assert torch.equal(logits(fm, x), two)


def test_bias_momentum_reaches_the_routers():
    _, fm = focus("llama", **BASE)
    fm.focus_config = fm.focus_config.replace(bias_momentum=0.5, temperature=0.2)
    assert all(r.bias_momentum == 0.5 and r.temperature == 0.2 for r in fm.routers.values())


def test_assigned_config_is_saved_and_reloaded(tmp_path):
    x = ids(1, 40, seed=3)
    _, fm = focus("llama", **BASE)
    fm.set_top_k(1)
    fm.save_pretrained(tmp_path)
    again = FocusModel.from_pretrained(build_model("llama"), tmp_path)
    assert again.focus_config.top_k == 1
    assert torch.equal(logits(again, x), logits(fm, x))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_groups": 8}, "FocusModel.focus_config.num_groups: received 8, expected 4"),
        ({"group_dim": 8}, "FocusModel.focus_config.group_dim: received 8, expected 16"),
        ({"layers": [1]}, r"FocusModel.focus_config.layers: received \(1,\), expected \(0, 1\)"),
        ({"seed": 1}, "FocusModel.focus_config.seed: received 1, expected 0"),
        ({"layers": [0, 7]}, r"layers \[7\] do not exist"),
    ],
)
def test_fixed_fields_cannot_change(change, message):
    x = ids(1, 32)
    _, fm = focus("llama", **BASE)
    before, out = fm.focus_config, logits(fm, x)
    with pytest.raises(ValueError, match=message):
        fm.focus_config = fm.focus_config.replace(top_k=1, **change)
    assert fm.focus_config is before and torch.equal(logits(fm, x), out)
    assert set(FIXED_CONFIG_FIELDS) == {"num_groups", "group_dim", "router_input", "layers", "seed"}


def test_invalid_assignments_raise():
    x = ids(1, 32)
    _, fm = focus("llama", **BASE)
    before, out = fm.focus_config, logits(fm, x)
    with pytest.raises(ValueError, match="received dict, expected a FocusConfig"):
        fm.focus_config = before.to_dict()
    with pytest.raises(ValueError, match="FocusConfig.top_k: received 5"):
        fm.set_top_k(5)  # > num_groups
    with pytest.raises(ValueError, match="FocusConfig.top_k: received 0"):
        fm.set_top_k(0)
    forged = before.replace(top_k=1)
    object.__setattr__(forged, "window", 0)  # bypasses the frozen dataclass
    with pytest.raises(ValueError, match="FocusConfig.window: received 0"):
        fm.focus_config = forged
    assert fm.focus_config is before and torch.equal(logits(fm, x), out)
    fm.unload()
    with pytest.raises(ValueError, match="unloaded"):
        fm.set_top_k(1)


def test_layers_none_means_this_models_default_layers():
    _, fm = focus("gemma2", **BASE)  # layer 0 is sliding-window: Focus on layer 1 only
    fm.focus_config = FocusConfig(**{**BASE, "top_k": 1})
    assert fm.focus_config.layers == (1,) and fm.focus_config.top_k == 1
    explicit = get_focus_model(build_model("llama"), FocusConfig(**BASE, layers=[1]))
    with pytest.raises(ValueError, match=r"layers: received \(0, 1\), expected \(1,\)"):
        explicit.focus_config = FocusConfig(**BASE)


def test_in_place_mutation_is_refused():
    _, fm = focus("llama", **BASE)
    cfg = fm.focus_config
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"immutable.*replace\(top_k="):
        fm.focus_config.top_k = 0
    with pytest.raises(AttributeError):
        cfg.layers.append(5)  # a tuple
    with pytest.raises(AttributeError):
        FocusConfig().window = 4
    assert fm.focus_config is cfg and cfg.top_k == 2 and cfg.layers == (0, 1)
