"""Padding is invisible in soft and top-k routing, left and right padding, on every
supported architecture (docs/method.md §4)."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids, left_pad, positions, right_pad
from tolerances import tolerance

TOL = tolerance("oracle")["atol"]
LENGTHS = (5, 300)


def run(fm, x, mask):
    kw = dict(attention_mask=mask, use_cache=False)
    if mask is not None:
        kw["position_ids"] = positions(mask)  # positions restart at each real first token
    with torch.no_grad(), fm.record_routing() as rec:
        out = fm(input_ids=x, **kw).logits
    return out, rec


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("routing", ["topk", "soft", "topk-sequence"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_single_sequences(arch, routing, side):
    inference = "sequence" if routing == "topk-sequence" else "causal"
    _, fm = focus(arch, num_groups=4, top_k=1, window=32, inference_routing=inference)
    routing = routing.split("-")[0]
    fm.set_routing(routing)
    seqs = [ids(1, n, seed=20 + n)[0] for n in LENGTHS]
    x, mask = (left_pad if side == "left" else right_pad)(seqs)
    real = mask.bool()
    batch, rec = run(fm, x, mask)
    singles = [run(fm, s[None], None) for s in seqs]
    for b, (single, single_rec) in enumerate(singles):
        got = batch[b][real[b]]
        assert (got - single[0]).abs().max() <= TOL, b
        # routing of the real tokens is that of the single sequence: padding joined no
        # group and no Sinkhorn column sum
        for r, s in zip(rec, single_rec, strict=True):
            assert torch.equal(r["query_groups"][b][real[b]], s["query_groups"][0])
            if routing == "soft":
                assert (r["probs"][b][real[b]] - s["probs"][0]).abs().max() <= 1e-5
    # padding never enters a group (as query or key) or a window
    for r in rec:
        assert not r["query_groups"][~real].any()
        if r["key_groups"] is not None:
            assert not r["key_groups"][~real].any()
        assert torch.equal(r["key_padding"], real)
        if routing == "soft":
            assert not r["probs"][~real].any()
    # overwriting the pad slots with random ids changes nothing
    noisy = torch.where(real, x, ids(*x.shape, seed=99))
    again, _ = run(fm, noisy, mask)
    assert (again[real] - batch[real]).abs().max() <= TOL


def test_gpt2_left_padding_needs_position_ids():
    """GPT-2 has absolute positions: with position ids that restart at the first real token
    a left-padded row equals its single run; the default positions (counting pads) do not,
    in Focus as in the base model (the base model's behaviour, not Focus's)."""
    ref, fm = focus("gpt2", num_groups=4, top_k=1, window=32)
    seqs = [ids(1, 7, seed=31)[0], ids(1, 60, seed=32)[0]]
    x, mask = left_pad(seqs)
    real = mask.bool()
    with torch.no_grad():
        single = fm(input_ids=seqs[0][None]).logits[0]
        good = fm(input_ids=x, attention_mask=mask, position_ids=positions(mask)).logits
        bad = fm(input_ids=x, attention_mask=mask).logits
        base_bad = ref(input_ids=x, attention_mask=mask).logits
    assert (good[0][real[0]] - single).abs().max() <= TOL
    assert (bad[0][real[0]] - single).abs().max() > 1e-3
    assert (base_bad[0][real[0]] - single).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_sinks_are_the_first_real_tokens(arch):
    """Sink tokens are counted among real tokens: under left padding the first real tokens
    are members of every group as keys, the pads are not."""
    _, fm = focus(arch, num_groups=4, top_k=1, window=8, sink_tokens=3)
    x, mask = left_pad([ids(1, 30, seed=33)[0], ids(1, 12, seed=34)[0]])
    _, rec = run(fm, x, mask)
    for r in rec:
        sinks = r["sinks"]
        assert sinks[0, :3].all() and not sinks[0, 3:].any()
        assert not sinks[1, :18].any() and sinks[1, 18:21].all() and not sinks[1, 21:].any()
        assert r["key_groups"][sinks].all()
