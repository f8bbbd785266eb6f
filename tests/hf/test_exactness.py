"""Exactness: where the Focus mask is dense causal attention, Focus top-k logits equal the
unmodified model's (docs/method.md §4), and disable_focus() / unload() give the base model."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, build_model, focus, ids, left_pad, positions
from tolerances import tolerance

N = 48


def logits(model, x, **kw):
    with torch.no_grad():
        return model(input_ids=x, **kw).logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_groups=4, top_k=4, window=8),  # top_k = K: every pair shares a group
        dict(num_groups=1, top_k=1, window=8),  # K = 1: one group holds every token
        dict(num_groups=4, top_k=1, window=N),  # window >= sequence length
    ],
    ids=["topk=K", "K=1", "window>=N"],
)
def test_topk_equals_base_when_mask_is_dense(arch, cfg):
    ref, fm = focus(arch, **cfg)
    x = ids(2, N, seed=1)
    base = logits(ref, x)
    out = logits(fm, x)
    assert fm.routing_mode == "topk"
    torch.testing.assert_close(out, base, **tolerance("oracle"))


@pytest.mark.parametrize("arch", ARCHS)
def test_topk_equals_base_under_left_padding(arch):
    ref, fm = focus(arch, num_groups=4, top_k=4, window=8)
    x, mask = left_pad([ids(1, 40, seed=2)[0], ids(1, 13, seed=3)[0]])
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    real = mask.bool()
    torch.testing.assert_close(
        logits(fm, x, **kw)[real], logits(ref, x, **kw)[real], **tolerance("oracle")
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gate", ["paper", "log"])
def test_soft_equals_base_when_window_covers_sequence(arch, gate):
    ref, fm = focus(arch, num_groups=4, top_k=1, window=N, gate=gate)
    fm.set_routing("soft")
    x = ids(2, N, seed=4)
    torch.testing.assert_close(logits(fm, x), logits(ref, x), **tolerance("oracle"))


@pytest.mark.parametrize("arch", ARCHS)
def test_focus_changes_the_model_when_mask_is_sparse(arch):
    """Guard for the tests above: with top_k < K and a short window Focus is not dense."""
    ref, fm = focus(arch, num_groups=4, top_k=1, window=4, sink_tokens=0)
    x = ids(1, N, seed=5)
    assert (logits(fm, x) - logits(ref, x)).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_disable_focus_is_exactly_the_base_model(arch):
    ref, fm = focus(arch, num_groups=4, top_k=1, window=4)
    x, mask = left_pad([ids(1, 30, seed=6)[0], ids(1, 21, seed=7)[0]])
    for kw in ({}, {"attention_mask": mask}):
        base = logits(ref, x, **kw)
        with fm.disable_focus():
            # the switch is the calling thread's: the model-wide config keeps "focus"
            assert fm.base_model.config._attn_implementation == "focus"
            assert torch.equal(logits(fm, x, **kw), base)
        assert fm.base_model.config._attn_implementation == "focus"
    with torch.no_grad(), fm.disable_focus():
        a = fm.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False)
    b = ref.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_unload_returns_the_untouched_base_model(arch):
    ref = build_model(arch)
    flags = {n: p.requires_grad for n, p in ref.named_parameters()}
    impl = ref.config._attn_implementation
    x = ids(1, 40, seed=8)
    before = logits(ref, x)
    _, fm = focus(arch)
    base = fm.base_model
    fm_base = fm.unload()
    assert fm_base is base
    assert base.config._attn_implementation == impl
    assert {n: p.requires_grad for n, p in base.named_parameters()} == flags
    assert not any("_focus_handle" in m.__dict__ for m in base.modules())
    assert all(not m._forward_pre_hooks for m in base.modules())
    assert torch.equal(logits(base, x), before)
    with pytest.raises(ValueError, match="unloaded"):
        fm(input_ids=x)
