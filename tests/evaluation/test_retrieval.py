"""``needle_attention`` and ``needle_attention_by_head``: the attention the last query gives
a span, per Focus layer (and per key-value head), equals the base model's own eager
attention maps, sliding-window layers included."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, build_model, focus, ids

from focus_attention.evaluation.retrieval import (
    base_sliding_window,
    needle_attention,
    needle_attention_by_head,
)

SPAN = (5, 12)
N = 60  # longer than the sliding window of the tiny configs that have one


def _oracle(arch: str, x: torch.Tensor, **model_overrides) -> tuple:
    eager = build_model(arch, **model_overrides)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        return eager(input_ids=x, output_attentions=True).attentions


@pytest.mark.parametrize("arch", ARCHS)
def test_needle_attention_equals_the_eager_maps_on_every_layer(arch):
    """Every layer a Focus layer (Gemma's sliding ones too), one made dense: each share is
    the eager map's best head summed over the span."""
    x = ids(1, N, seed=7)
    maps = _oracle(arch, x)
    _, fm = focus(arch, layers=list(range(len(maps))), dense_layers=[0])
    got = needle_attention(fm, x, SPAN)
    assert sorted(got) == list(range(len(maps)))
    for layer, share in got.items():
        want = float(maps[layer][0, :, -1, SPAN[0] : SPAN[1]].sum(-1).max())
        assert share == pytest.approx(want, abs=1e-5), layer


def test_a_model_wide_sliding_window_applies():
    x = ids(1, N, seed=8)
    maps = _oracle("mistral", x, sliding_window=16)
    _, fm = focus("mistral", model_overrides={"sliding_window": 16})
    assert base_sliding_window(fm.base_model.config, 0) == 16
    got = needle_attention(fm, x, SPAN)
    for layer, share in got.items():
        assert share == pytest.approx(float(maps[layer][0, :, -1, 5:12].sum(-1).max()), abs=1e-6)
        assert share == 0.0  # the span lies outside the last query's 16 keys


def test_needle_attention_refuses_a_disabled_model():
    _, fm = focus("llama")
    with fm.disable_focus(), pytest.raises(ValueError, match="no Focus layer recorded"):
        needle_attention(fm, ids(1, 20), (2, 5))


@pytest.mark.parametrize("arch", ARCHS)
def test_needle_attention_by_head_is_the_best_query_head_of_each_key_value_head(arch):
    """Each key-value head's share is the eager map's best query head among those that share
    it, with dense layers and dense heads configured (they do not change what is recorded)."""
    x = ids(1, N, seed=9)
    maps = _oracle(arch, x)
    _, fm = focus(arch, layers=list(range(len(maps))), dense_layers=[0])
    fm.focus_config = fm.focus_config.replace(dense_heads=[(1, 0)])
    got = needle_attention_by_head(fm, x, SPAN)
    cfg = fm.base_model.config
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for layer, shares in got.items():
        per_query = maps[layer][0, :, -1, SPAN[0] : SPAN[1]].sum(-1)  # [H]
        want = per_query.view(kv, -1).max(dim=1).values
        assert shares == pytest.approx(want.tolist(), abs=1e-5), layer
    assert {k: max(v) for k, v in got.items()} == needle_attention(fm, x, SPAN)
