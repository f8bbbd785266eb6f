"""``FocusConfig.dense_layers``: a dense Focus layer is exactly the base model's layer (the
model equals one with Focus on the other layers only), in top-k and soft routing, with
padding and with KV-cache decoding; its router gets no gradient; the set is saved with the
adapter and checked."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, build_model, focus, ids, left_pad, positions
from tolerances import DIFFERENT, tolerance

from focus_attention.hf import FocusConfig, FocusModel
from focus_attention.hf.compat import cache_kwargs, cache_of

N = 40


def _logits(model, x, **kw):
    with torch.no_grad():
        return model(input_ids=x, **kw).logits


def _pair(arch: str, **cfg):
    """``(fm, reference)``: ``fm`` with its last Focus layer dense, ``reference`` with Focus
    on the other layers only (the base model when there is no other)."""
    _, fm = focus(arch, **cfg)
    *rest, last = fm.focus_layers
    fm.focus_config = fm.focus_config.replace(dense_layers=[last])
    reference = focus(arch, layers=rest, **cfg)[1] if rest else build_model(arch)
    return fm, reference


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("routing", ["topk", "soft"])
def test_a_dense_layer_is_the_base_layer(arch, routing):
    fm, ref = _pair(arch)
    x = ids(2, N, seed=5)
    before = _logits(fm, x)
    for m in (fm, ref):
        if isinstance(m, FocusModel):
            m.set_routing(routing)
    torch.testing.assert_close(_logits(fm, x), _logits(ref, x), **tolerance("oracle"))
    # guard: with the layer routed again the model changes (the test can fail)
    fm.set_routing("topk")
    fm.focus_config = fm.focus_config.replace(dense_layers=())
    assert not torch.allclose(_logits(fm, x), before, **DIFFERENT)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_dense_layer_under_left_padding_and_decoding(arch):
    fm, ref = _pair(arch)
    x, mask = left_pad([ids(1, 30, seed=6)[0], ids(1, 11, seed=7)[0]])
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    real = mask.bool()
    torch.testing.assert_close(
        _logits(fm, x, **kw)[real], _logits(ref, x, **kw)[real], **tolerance("oracle")
    )
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(fm.generate(x, **gen), ref.generate(x, **gen))


def test_every_layer_dense_is_the_base_model():
    ref, fm = focus("llama")
    fm.focus_config = fm.focus_config.replace(dense_layers=fm.focus_layers)
    x = ids(2, N, seed=8)
    torch.testing.assert_close(_logits(fm, x), _logits(ref, x), **tolerance("oracle"))


def test_switching_a_layer_while_a_cache_holds_keys_says_why():
    _, fm = focus("llama")
    x = ids(1, 20, seed=9)
    layer = fm.focus_layers[-1]
    fm.focus_config = fm.focus_config.replace(dense_layers=[layer])
    with torch.no_grad():
        cache = cache_of(fm(input_ids=x, use_cache=True))
        fm.focus_config = fm.focus_config.replace(dense_layers=())
        with pytest.raises(ValueError, match="without Focus.*dense_layers"):
            fm(input_ids=x[:, -1:], **cache_kwargs(cache), use_cache=True)
        cache = cache_of(fm(input_ids=x, use_cache=True))  # filled routed
        fm.focus_config = fm.focus_config.replace(dense_layers=[layer])
        fm(input_ids=x[:, -1:], **cache_kwargs(cache), use_cache=True)  # the dense step
        fm.focus_config = fm.focus_config.replace(dense_layers=())
        with pytest.raises(ValueError, match="Focus group rows.*dense_layers"):
            fm(input_ids=x[:, -1:], **cache_kwargs(cache), use_cache=True)


def test_the_router_of_a_dense_layer_gets_no_gradient():
    _, fm = focus("llama")
    first, *_, last = fm.focus_layers
    fm.focus_config = fm.focus_config.replace(dense_layers=[last])
    fm.train().requires_grad_(True)
    x = ids(2, N, seed=10)
    fm(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is None for p in fm.routers[str(last)].parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0
               for p in fm.routers[str(first)].parameters())  # fmt: skip


def test_dense_layers_are_saved_with_the_adapter(tmp_path):
    fm, _ = _pair("llama")
    fm.save_pretrained(tmp_path)
    again = FocusModel.from_pretrained(build_model("llama"), tmp_path)
    assert again.focus_config.dense_layers == fm.focus_config.dense_layers
    x = ids(1, N, seed=11)
    torch.testing.assert_close(_logits(again, x), _logits(fm, x), **tolerance("bitwise"))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([1, 1], "distinct"),
        ([-1], "ints >= 0"),
        ("0", "list of layer indices"),
        ([True], "ints >= 0"),
    ],
)
def test_bad_dense_layers_are_refused(value, match):
    with pytest.raises(ValueError, match=rf"FocusConfig.dense_layers.*{match}"):
        FocusConfig(dense_layers=value)


def test_dense_layers_must_be_focus_layers():
    with pytest.raises(ValueError, match=r"dense_layers.*Focus layers \(layers \[1\] are not\)"):
        FocusConfig(layers=[0], dense_layers=[0, 1])
    _, fm = focus("llama")
    with pytest.raises(ValueError, match=r"dense_layers.*layers \[7\] are not"):
        fm.focus_config = fm.focus_config.replace(dense_layers=[7])
    FocusConfig(dense_layers=[3])  # layers resolved later: any index is accepted here
    with pytest.raises(ValueError, match=r"dense_layers.*layers \[7\] are not"):
        focus("llama", dense_layers=[7])


def test_maps_of_dense_layers_need_eager():
    fm, _ = _pair("llama")
    layer = fm.focus_config.dense_layers[0]
    with pytest.raises(ValueError, match=rf"layers \[{layer}\] run the base implementation"):
        fm(input_ids=ids(1, 12), output_attentions=True)
