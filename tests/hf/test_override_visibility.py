"""``FocusModel.override_visibility()``: the routed Focus layers attend under a given mask.
Under the routing's own Focus mask it is the Focus model, under the causal mask the dense
model, with and without a KV cache; dense layers stay dense; outside the context nothing
changes."""

from __future__ import annotations

import pytest
import torch
from tiny import focus, ids
from tolerances import DIFFERENT, tolerance

from focus_attention.ops import focus_mask
from focus_attention.ops.diagnostic import near_and_distant

N = 36


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def _causal(layer, call):
    near, distant = near_and_distant(call.query.shape[2], call.key.shape[2], 1,
                                     sinks=call.sinks, real=call.real)  # fmt: skip
    return (near | distant).expand(call.query.shape[0], -1, -1)


def _causal_per_kv_head(layer, call):
    return _causal(layer, call)[:, None].expand(-1, call.key.shape[1], -1, -1)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])  # GQA; MHA; soft-capped logits
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_the_causal_mask_is_the_dense_model(arch, per_kv_head):
    _, fm = focus(arch)
    x = ids(2, N, seed=3)
    with torch.no_grad(), fm.disable_focus():
        dense = fm(input_ids=x).logits
    assert not torch.allclose(_logits(fm, x), dense, **DIFFERENT)  # guard: Focus differs
    with fm.override_visibility(_causal_per_kv_head if per_kv_head else _causal):
        torch.testing.assert_close(_logits(fm, x), dense, **tolerance("oracle"))


def test_the_routing_mask_is_the_focus_model_and_dense_layers_stay_dense():
    _, fm = focus("llama")
    fm.focus_config = fm.focus_config.replace(dense_layers=[fm.focus_layers[-1]])
    x = ids(1, N, seed=4)
    with fm.record_routing() as records:
        want = _logits(fm, x)
    masks = {r["layer"]: focus_mask(r["query_groups"], r["key_groups"], fm.focus_config.window)
             for r in records}  # fmt: skip
    seen = []

    def routed(layer, call):
        seen.append(layer)
        return masks[layer]

    with fm.override_visibility(routed):
        torch.testing.assert_close(_logits(fm, x), want, **tolerance("oracle"))
    assert seen == sorted(masks) and fm.focus_layers[-1] not in seen
    torch.testing.assert_close(_logits(fm, x), want, rtol=0, atol=0)  # off on exit


def test_decoding_with_a_cache_sees_every_key_so_far():
    _, fm = focus("llama")
    x = ids(1, 20, seed=5)
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    calls = []

    def causal(layer, call):
        calls.append((call.query.shape[2], call.key.shape[2]))
        return _causal(layer, call)

    with torch.no_grad(), fm.disable_focus():
        dense = fm.generate(x, **gen)
    with torch.no_grad(), fm.override_visibility(causal):
        assert torch.equal(fm.generate(x, **gen), dense)
    per_layer = calls[:: len(fm.focus_layers)]
    assert per_layer == [(20, 20), (1, 21), (1, 22), (1, 23), (1, 24)]
