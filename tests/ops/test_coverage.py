"""Attention coverage (docs/method.md §6, "Objectives"): the dense model's attention beyond
the window, and how much of it soft and top-k routing keep, against float64 oracles written
from the definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops import topk_memberships
from focus_attention.ops.coverage import distant_attention, hard_coverage, soft_coverage

from .helpers import HYP, brute_mask, gen, padding_mask


def oracle_distant(q, k, window, *, scale=None, softcap=None, kpm=None, sinks=None):
    """Per head: float64 softmax over causal real keys; mean over heads; keep i - j >= window
    and non-sink keys. Query t sits at Nk - Nq + t."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    rep = h // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    i = torch.arange(nk - nq, nk)[:, None]
    j = torch.arange(nk)[None, :]
    visible = (j <= i)[None].expand(b, nq, nk)
    if kpm is not None:
        visible = visible & kpm[:, None, :]
    total = torch.zeros(b, nq, nk, dtype=torch.float64)
    for head in range(h):
        logits = q[:, head].double() @ k[:, head // rep].double().transpose(-1, -2) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        for bi in range(b):
            for t in range(nq):
                row = visible[bi, t]
                if row.any():
                    total[bi, t, row] += torch.softmax(logits[bi, t, row], dim=0)
    total /= h
    distant = (i - j >= window)[None].expand(b, nq, nk)
    if sinks is not None:
        distant = distant & ~sinks[:, None, :]
    return total * distant


def qk(b, h, h_kv, nq, nk, d=8, seed=0, dtype=torch.float32):
    g = gen(seed)
    q = torch.randn(b, h, nq, d, generator=g).to(dtype)
    k = torch.randn(b, h_kv, nk, d, generator=g).to(dtype)
    return q, k


GRID = [
    # b, h, h_kv, nq, nk, window, padded, sinks, softcap
    (1, 2, 2, 17, 17, 4, False, 0, None),
    (2, 4, 2, 23, 23, 5, True, 0, None),
    (2, 4, 1, 9, 30, 3, True, 2, None),
    (1, 3, 3, 31, 31, 1, False, 3, 5.0),
    (2, 2, 1, 40, 40, 64, False, 0, None),
]


@pytest.mark.parametrize("b,h,h_kv,nq,nk,window,padded,sinks,softcap", GRID)
@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_distant_attention_matches_oracle(b, h, h_kv, nq, nk, window, padded, sinks, softcap, chunk):  # fmt: skip
    q, k = qk(b, h, h_kv, nq, nk, seed=nq + nk)
    kpm = padding_mask(gen(3), b, nk, "left") if padded else None
    sink = None
    if sinks:
        sink = torch.zeros(b, nk, dtype=torch.bool)
        sink[:, :sinks] = True
    got = distant_attention(q, k, window, softcap=softcap, key_padding_mask=kpm,
                            always_visible=sink, chunk_size=chunk)  # fmt: skip
    want = oracle_distant(q, k, window, softcap=softcap, kpm=kpm, sinks=sink)
    assert got.dtype == torch.float32 and got.shape == (b, nq, nk)
    torch.testing.assert_close(got.double(), want, **tolerance("rounding"))


def test_distant_attention_rows_select_queries():
    q, k = qk(2, 4, 2, 33, 33, seed=1)
    full = distant_attention(q, k, 4)
    rows = torch.tensor([0, 5, 31, 32])
    torch.testing.assert_close(distant_attention(q, k, 4, rows=rows, chunk_size=3), full[:, rows])
    assert distant_attention(q, k, 4, rows=torch.zeros(0, dtype=torch.long)).shape == (2, 0, 33)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_distant_attention_half_inputs_compute_in_fp32(dtype):
    q, k = qk(1, 2, 1, 25, 25, seed=2, dtype=dtype)
    got = distant_attention(q, k, 3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), oracle_distant(q.float(), k.float(), 3),
                               **tolerance("rounding"))  # fmt: skip


def test_rows_beyond_the_window_sum_to_the_distant_share():
    """Every row of the full probabilities sums to 1, so a row of distant_attention plus its
    local keys' mass is 1, and rows inside the window have nothing distant."""
    q, k = qk(1, 2, 2, 20, 20, seed=4)
    window = 6
    got = distant_attention(q, k, window)
    assert torch.all(got[:, :window] == 0)
    assert torch.all(got[:, window:].sum(-1) < 1)
    assert torch.all(got[:, window:].sum(-1) > 0)


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_hard_coverage_is_the_dense_mass_inside_the_focus_mask(top_k, padded):
    b, nq, nk, groups, window = 2, 26, 26, 4, 5
    q, k = qk(b, 4, 2, nq, nk, seed=top_k)
    kpm = padding_mask(gen(5), b, nk, "right") if padded else None
    qg = topk_memberships(torch.randn(b, nq, groups, generator=gen(7)), top_k)
    kg = qg.clone()
    dist = distant_attention(q, k, window, key_padding_mask=kpm)
    kept, total = hard_coverage(dist, qg, kg)
    mask = brute_mask(qg, kg, window, kpm)
    want_dist = oracle_distant(q, k, window, kpm=kpm)
    assert float(total) == pytest.approx(float(want_dist.sum()), rel=1e-5)
    assert float(kept) == pytest.approx(float((want_dist * mask).sum()), rel=1e-5)


def test_coverage_extremes():
    q, k = qk(1, 2, 2, 30, 30, seed=9)
    dist = distant_attention(q, k, 4)
    every = torch.ones(1, 30, 3, dtype=torch.bool)
    kept, total = hard_coverage(dist, every, every)
    assert float(kept) == pytest.approx(float(total))
    alone = torch.zeros(1, 30, 3, dtype=torch.bool)
    alone[0, ::2, 0] = True
    alone[0, 1::2, 1] = True
    kept, total = hard_coverage(dist, alone, alone)
    want = float((dist[0][::2, ::2]).sum() + dist[0][1::2, 1::2].sum())
    assert float(kept) == pytest.approx(want, rel=1e-6)


def test_soft_coverage_of_one_hot_rows_equals_hard_coverage():
    q, k = qk(2, 2, 1, 21, 21, seed=11)
    dist = distant_attention(q, k, 3)
    groups = topk_memberships(torch.randn(2, 21, 5, generator=gen(12)), 1)
    soft_kept, soft_total = soft_coverage(dist, groups.float(), groups.float())
    hard_kept, hard_total = hard_coverage(dist, groups, groups)
    assert float(soft_kept) == pytest.approx(float(hard_kept), rel=1e-6)
    assert float(soft_total) == float(hard_total)


def test_soft_coverage_gradient():
    q, k = qk(1, 2, 1, 12, 12, seed=13)
    dist = distant_attention(q.double(), k.double(), 3)
    rows = torch.tensor([3, 7, 11])
    probs = torch.softmax(torch.randn(1, 12, 3, generator=gen(14), dtype=torch.float64), -1)
    probs.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda p: soft_coverage(dist[:, rows], p, p, rows)[0], (probs,))


@HYP
@given(
    nq=st.integers(1, 24),
    extra=st.integers(0, 8),
    window=st.integers(1, 12),
    groups=st.integers(1, 5),
    seed=st.integers(0, 10_000),
)
def test_coverage_bounds(nq, extra, window, groups, seed):
    """0 <= kept <= total for soft and hard routing; total is the oracle's distant mass."""
    nk = nq + extra
    q, k = qk(1, 2, 1, nq, nk, seed=seed)
    dist = distant_attention(q, k, window)
    probs = torch.softmax(torch.randn(1, nk, groups, generator=gen(seed + 1)), -1)
    kept, total = soft_coverage(dist, probs[:, nk - nq :], probs)
    assert -1e-6 <= float(kept) <= float(total) + 1e-5
    hk, ht = hard_coverage(dist, probs[:, nk - nq :] > 0.3, probs > 0.3)
    assert -1e-6 <= float(hk) <= float(ht) + 1e-5
    want = float(oracle_distant(q, k, window).sum())
    assert math.isclose(float(total), want, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0}, "window"),
        ({"rows": torch.tensor([40])}, "rows"),
        ({"rows": torch.tensor([1.0])}, "rows"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"scale": -1.0}, "scale"),
        ({"key_padding_mask": torch.ones(1, 5, dtype=torch.bool)}, "key_padding_mask"),
    ],
)
def test_bad_inputs_are_named(kwargs, match):
    q, k = qk(1, 2, 1, 10, 10)
    args = {"window": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        distant_attention(q, k, **args)


def test_coverage_shape_errors():
    q, k = qk(1, 2, 1, 10, 10)
    dist = distant_attention(q, k, 3, rows=torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="rows"):
        soft_coverage(dist, torch.rand(1, 10, 3), torch.rand(1, 10, 3))  # 2 rows, not 10
    with pytest.raises(ValueError, match="key_probs"):
        soft_coverage(dist, torch.rand(1, 10, 3), torch.rand(1, 9, 3), torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="query_groups"):
        hard_coverage(dist, torch.rand(1, 10, 3), torch.rand(1, 10, 3) > 0, torch.tensor([4, 5]))


def test_distant_attention_per_kv_head_is_the_maximum_over_its_query_heads():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
    sinks = torch.zeros(2, 20, dtype=torch.bool)
    sinks[:, :2] = True
    rows = torch.tensor([5, 11, 19])
    got = distant_attention(q, k, 4, always_visible=sinks, rows=rows, per_kv_head=True)
    assert got.shape == (2, 2, 3, 20)
    for h in range(2):
        heads = [distant_attention(q[:, j : j + 1], k[:, h : h + 1], 4, always_visible=sinks, rows=rows)
                 for j in range(3 * h, 3 * h + 3)]  # fmt: skip
        torch.testing.assert_close(got[:, h], torch.stack(heads).amax(0), **tolerance("bitwise"))
