"""Head gates (DuoAttention-style): a scalar per (layer, key-value head) mixing the head's
dense output and its Focus output. The mixing is exact: every gate 1 is the dense layer,
every gate 0 the Focus layer, bit for bit; a gate 1 on one head is that head dense; gradients
reach the gates; the ranking file round-trips."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import ARCHS, focus, ids
from tolerances import DIFFERENT, tolerance

from focus_attention.hf.head_gates import GATES_NAME, HeadGates, mix_heads

N = 40


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def _gates(fm, value):
    cfg = fm.base_model.config
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return HeadGates(fm.focus_layers, kv, init=value)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("routing", ["topk", "soft"])
def test_gates_one_are_the_dense_layers_and_gates_zero_the_focus_layers(arch, routing):
    _, fm = focus(arch)
    fm.set_routing(routing)
    x = ids(2, N, seed=3)
    routed = _logits(fm, x)
    cfg = fm.focus_config
    fm.focus_config = cfg.replace(dense_layers=fm.focus_layers)
    dense = _logits(fm, x)
    fm.focus_config = cfg
    _gates(fm, 1.0).attach(fm)
    assert torch.equal(_logits(fm, x), dense)
    _gates(fm, 0.0).attach(fm)
    assert torch.equal(_logits(fm, x), routed)
    HeadGates.detach(fm)
    assert torch.equal(_logits(fm, x), routed)
    # guard: the dense and the Focus layers differ here, so the test can fail
    assert not torch.allclose(dense, routed, **DIFFERENT)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_open_gate_is_that_head_dense(arch):
    _, fm = focus(arch)
    x = ids(2, N, seed=4)
    last = fm.focus_layers[-1]
    gates = _gates(fm, 0.0)
    kv = gates.values.shape[1]
    with torch.no_grad():
        gates.values[gates.row[last], kv - 1] = 1.0
    gates.attach(fm)
    mixed = _logits(fm, x)
    HeadGates.detach(fm)
    fm.focus_config = fm.focus_config.replace(dense_heads=[(last, kv - 1)])
    torch.testing.assert_close(mixed, _logits(fm, x), **tolerance("oracle"))


def test_mix_heads_weighs_each_key_value_heads_query_heads():
    dense, focus_out = torch.randn(2, 6, 5, 4), torch.randn(2, 6, 5, 4)
    alpha = torch.tensor([0.0, 0.25, 1.0])
    out = mix_heads(alpha, dense, focus_out)
    a = torch.tensor([0.0, 0.0, 0.25, 0.25, 1.0, 1.0])[None, :, None, None]
    torch.testing.assert_close(out, a * dense + (1 - a) * focus_out)
    assert torch.equal(out[:, :2], focus_out[:, :2]) and torch.equal(out[:, 4:], dense[:, 4:])
    with pytest.raises(ValueError, match="multiple"):
        mix_heads(torch.ones(4), dense, focus_out)


def test_only_the_gates_get_gradients_and_are_clamped(tmp_path):
    _, fm = focus("llama")
    fm.requires_grad_(False)
    fm.set_routing("topk")
    gates = _gates(fm, 0.5).attach(fm)
    fm(input_ids=ids(1, N, seed=5)).logits.pow(2).mean().backward()
    assert gates.values.grad is not None and gates.values.grad.abs().sum() > 0
    assert all(p.grad is None for p in fm.parameters())
    with torch.no_grad():
        gates.values[0, 0], gates.values[-1, -1] = 1.7, -0.3
    assert gates.alpha(fm.focus_layers[0])[0] == 1.0 and gates.alpha(fm.focus_layers[-1])[-1] == 0.0
    assert gates.alpha(999) is None


def test_the_ranking_file_round_trips(tmp_path):
    gates = HeadGates([0, 2], 2, init=0.5)
    with torch.no_grad():
        gates.values.copy_(torch.tensor([[0.2, 0.9], [1.3, 0.2]]))
    gates.save(tmp_path, config={"model": "m"})
    data = json.loads((tmp_path / GATES_NAME).read_text())
    assert data["head_ranking"] == [[2, 0], [0, 1], [0, 0], [2, 1]]
    assert data["by_head"]["2:0"] == 1.0 and data["config"] == {"model": "m"}
    again = HeadGates([0, 2], 2).load(tmp_path)
    assert torch.equal(again.values, gates.values)
    with pytest.raises(ValueError, match="expected"):
        HeadGates([0, 1], 2).load(tmp_path)
    with pytest.raises(FileNotFoundError):
        HeadGates([0, 2], 2).load(tmp_path / "none")


def test_gates_of_other_layers_are_refused():
    _, fm = focus("llama")
    with pytest.raises(ValueError, match="Focus layers"):
        HeadGates([99], 2).attach(fm)
    with pytest.raises(ValueError, match="no Focus adapter"):
        HeadGates([0], 2).attach(torch.nn.Linear(2, 2))
