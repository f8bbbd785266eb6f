"""Future tokens never change the past, and registration keeps the causal mask,
on every supported architecture."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, VOCAB, focus, ids
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from focus_attention.hf import FocusMask, focus_attention_forward, focus_mask_interface

N, CUT = 200, 150


def two_sequences(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    a = ids(1, N, seed=seed)
    b = a.clone()
    gen = torch.Generator().manual_seed(seed + 1)
    shift = torch.randint(1, VOCAB - 3, (1, N - CUT), generator=gen)
    b[:, CUT:] = 3 + (a[:, CUT:] - 3 + shift) % (VOCAB - 3)
    assert not torch.equal(a[:, CUT:], b[:, CUT:])
    return a, b


def call(model, x, mode: str) -> torch.Tensor:
    with torch.no_grad():
        if mode == "mask=None":
            return model(input_ids=x, attention_mask=None).logits
        if mode == "mask=ones":
            return model(input_ids=x, attention_mask=torch.ones_like(x)).logits
        raise KeyError(mode)


def test_focus_is_registered_with_both_interfaces():
    from focus_attention.hf import register_focus_attention

    register_focus_attention()
    assert ALL_ATTENTION_FUNCTIONS["focus"] is focus_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["focus"] is focus_mask_interface


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["mask=None", "mask=ones"])
def test_future_tokens_do_not_change_past_logits(arch, mode):
    _, fm = focus(arch, num_groups=4, top_k=1, window=16)
    a, b = two_sequences()
    la, lb = call(fm, a, mode), call(fm, b, mode)
    assert (la[:, CUT:] - lb[:, CUT:]).abs().max() > 0  # the change is visible after CUT
    # fp32 summation-order noise only (a leak is orders larger); float64 is bit-exact below
    assert (la[:, :CUT] - lb[:, :CUT]).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_reproduces_the_full_forward_logits(arch):
    """generate() from the first 150 tokens produces, at its first step, the full forward's
    logits at position 149 of both 200-token sequences, and decodes consistently."""
    _, fm = focus(arch, num_groups=4, top_k=1, window=16)
    a, b = two_sequences()
    full_a, full_b = call(fm, a, "mask=None"), call(fm, b, "mask=None")
    with torch.no_grad():
        out = fm.generate(
            a[:, :CUT],
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    first = out.logits[0]
    assert (first - full_a[:, CUT - 1]).abs().max() <= 1e-5
    assert (first - full_b[:, CUT - 1]).abs().max() <= 1e-5
    # the generated continuation, fed back as a plain sequence, reproduces the step logits
    full_gen = call(fm, out.sequences, "mask=None")
    for step, step_logits in enumerate(out.logits):
        assert (step_logits - full_gen[:, CUT - 1 + step]).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["mask=None", "mask=ones", "generate"])
def test_dense_window_equals_base_in_every_call_mode(arch, mode):
    ref, fm = focus(arch, num_groups=4, top_k=1, window=64)
    x = ids(1, 60, seed=3)
    if mode == "generate":
        with torch.no_grad():
            kw = dict(max_new_tokens=4, do_sample=False, output_logits=True)
            got = fm.generate(x, return_dict_in_generate=True, **kw)
            want = ref.generate(x, return_dict_in_generate=True, **kw)
        assert torch.equal(got.sequences, want.sequences)
        for g, w in zip(got.logits, want.logits, strict=True):
            assert (g - w).abs().max() <= 1e-5
    else:
        assert (call(fm, x, mode) - call(ref, x, mode)).abs().max() <= 1e-5


class _Spy:
    """Wraps the registered attention function to record what transformers passes it."""

    def __init__(self, monkeypatch):
        self.masks: list[object] = []
        inner = focus_attention_forward

        def spy(module, query, key, value, attention_mask, *args, **kwargs):
            handle = module.__dict__.get("_focus_handle")
            if handle is not None and handle.router is not None:  # Focus layers only
                self.masks.append((attention_mask, query.shape[2], key.shape[2]))
            return inner(module, query, key, value, attention_mask, *args, **kwargs)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "focus", spy)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma2"])
def test_a_causal_focus_mask_arrives_in_every_call_mode(arch, monkeypatch):
    """With the mask function registered a FocusMask arrives in every call mode: causal,
    with the 2-D padding (None when there is none) covering every key."""
    _, fm = focus(arch, num_groups=4, top_k=1, window=8)
    spy = _Spy(monkeypatch)
    x = ids(2, 20, seed=4)
    left = torch.ones_like(x)
    left[0, :5] = 0
    right = torch.ones_like(x)
    right[1, 15:] = 0
    cases = {"None": None, "ones": torch.ones_like(x), "left": left, "right": right}
    for name, mask in cases.items():
        spy.masks.clear()
        with torch.no_grad():
            fm(input_ids=x, attention_mask=mask)
        assert spy.masks, name
        for m, nq, nk in spy.masks:
            assert isinstance(m, FocusMask), (name, type(m))
            m.check_causal()
            real, _ = m.keys(nk, 0)
            if name in ("None", "ones"):
                assert real is None
            else:
                assert torch.equal(real, mask.bool())
            assert nq == nk == 20
    spy.masks.clear()
    with torch.no_grad():
        fm.generate(x, attention_mask=left, max_new_tokens=3, do_sample=False)
    decode = [(m, nq, nk) for m, nq, nk in spy.masks if nq == 1]
    assert decode and all(isinstance(m, FocusMask) for m, _, _ in decode)
    for m, _, nk in decode:
        real, _ = m.keys(nk, 0)
        assert nk > 20 and real is not None and real.shape == (2, nk)
        assert not real[0, :5].any() and real[0, 5:].all() and real[1].all()


def test_packed_sequences_are_refused():
    """position_ids that restart without an attention_mask mean packed sequences, whose
    mask pattern is not causal: Focus layers refuse them with a clear error."""
    _, fm = focus("llama")
    x = ids(1, 20, seed=5)
    pos = torch.cat([torch.arange(10), torch.arange(10)])[None]
    with pytest.raises(ValueError, match="causal attention with a 2-D padding mask only"):
        fm(input_ids=x, position_ids=pos, use_cache=False)


def test_prepared_4d_mask_is_refused():
    _, fm = focus("llama")
    x = ids(1, 12, seed=6)
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="prepared Tensor mask"):
        fm(input_ids=x, attention_mask=mask)


@pytest.mark.parametrize("arch", ARCHS)
def test_past_logits_are_bit_identical_in_float64(arch):
    """In float64 the past logits are bit-identical: the ~1e-6 fp32 differences some
    architectures show are summation-order noise (the sparse kernel splits its calls
    according to all tokens' groups), not information from the future."""
    _, fm = focus(arch, dtype=torch.float64, num_groups=4, top_k=1, window=16)
    assert all(p.dtype == torch.float32 for p in fm.routers.parameters())  # always fp32
    a, b = two_sequences(seed=2)
    la, lb = call(fm, a, "mask=None"), call(fm, b, "mask=None")
    assert torch.equal(la[:, :CUT], lb[:, :CUT])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_soft_and_sequence_routing_are_not_causal(arch):
    """Documented non-causality (docs/method.md §2): Sinkhorn columns run over the whole
    sequence, so in soft routing (training) and with inference_routing="sequence" later
    tokens change earlier outputs. Causal top-k routing is the inference default."""
    _, fm = focus(arch, num_groups=4, top_k=1, window=16)
    a, b = two_sequences(seed=3)
    leaks = {}
    for routing, inference in (("topk", "causal"), ("soft", "causal"), ("topk", "sequence")):
        fm.set_routing(routing)
        fm.focus_config = fm.focus_config.replace(inference_routing=inference)
        la, lb = call(fm, a, "mask=None"), call(fm, b, "mask=None")
        leaks[(routing, inference)] = float((la[:, :CUT] - lb[:, :CUT]).abs().max())
    assert leaks[("topk", "causal")] <= 1e-5  # fp32 noise
    assert leaks[("soft", "causal")] > 1e-3
    assert leaks[("topk", "sequence")] > 1e-3
