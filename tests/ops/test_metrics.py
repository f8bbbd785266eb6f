"""Routing and sparsity metrics against brute-force counts (docs/method.md §2 and §4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops import dominance, group_shares, pairs_retained

from .helpers import HYP, case_params, gen, make_case, padding_mask


def _count_shares(assign: torch.Tensor, pad: torch.Tensor | None) -> list[float]:
    """Mass of each group over the real tokens, divided by the total mass, by loops."""
    batch, n, k = assign.shape
    mass = [0.0] * k
    for b in range(batch):
        for i in range(n):
            if pad is not None and not bool(pad[b, i]):
                continue
            for c in range(k):
                mass[c] += float(assign[b, i, c])
    total = sum(mass)
    return [m / total for m in mass] if total > 0 else mass


@given(
    batch=st.integers(1, 3),
    n=st.integers(1, 40),
    k=st.integers(1, 8),
    kind=st.sampled_from(["top1", "multi", "soft"]),
    padded=st.sampled_from([None, "left", "random"]),
    seed=st.integers(0, 2**31 - 1),
)
@HYP
def test_group_shares_and_dominance_equal_brute_force(batch, n, k, kind, padded, seed):
    g = gen(seed)
    if kind == "top1":
        assign = torch.nn.functional.one_hot(torch.randint(0, k, (batch, n), generator=g), k).bool()
    elif kind == "multi":
        assign = torch.rand(batch, n, k, generator=g) < 0.4
    else:
        assign = torch.softmax(torch.randn(batch, n, k, generator=g) * 2, dim=-1)
    pad = padding_mask(g, batch, n, padded)
    shares = group_shares(assign, pad)
    want = _count_shares(assign, pad)
    assert shares.dtype == torch.float32 and shares.shape == (k,)
    torch.testing.assert_close(shares, torch.tensor(want), **tolerance("reordered"))
    assert abs(dominance(assign, pad) - max(want)) <= 1e-6
    if kind == "top1":
        # one group per token: the share is the fraction of real tokens in the group
        real = batch * n if pad is None else int(pad.sum())
        if real:
            counts = [0] * k
            for b in range(batch):
                for i in range(n):
                    if pad is None or bool(pad[b, i]):
                        counts[int(assign[b, i].float().argmax())] += 1
            assert abs(dominance(assign, pad) - max(counts) / real) <= 1e-6


def test_dominance_extremes():
    k, n = 4, 40
    balanced = torch.nn.functional.one_hot(torch.arange(n) % k, k).bool()[None]
    assert dominance(balanced) == pytest.approx(1 / k)
    collapsed = torch.zeros(1, n, k, dtype=torch.bool)
    collapsed[..., 2] = True
    assert dominance(collapsed) == pytest.approx(1.0)
    # padding is not counted: a collapsed padding block does not move the balanced tokens
    both = torch.cat([balanced, collapsed], dim=1)
    pad = torch.cat([torch.ones(1, n), torch.zeros(1, n)], dim=1).bool()
    assert dominance(both, pad) == pytest.approx(1 / k)
    assert dominance(both) > 1 / k


def _brute_pairs(qg, kg, window, kpm) -> float:
    batch, nq, k = qg.shape
    nk = kg.shape[1]
    kept = total = 0
    for b in range(batch):
        for t in range(nq):
            i = nk - nq + t
            for j in range(i + 1):
                if kpm is not None and not bool(kpm[b, j]):
                    continue
                total += 1
                share = bool((qg[b, t] & kg[b, j]).any())
                kept += int(i - j < window or share)
    return kept / total if total else 0.0


@given(params=case_params(max_nk=30, long_nk=60), block=st.sampled_from([1, 3, 7, 1024]))
@HYP
def test_pairs_retained_equals_brute_force(params, block):
    case = make_case(**params)
    got = pairs_retained(case.qg, case.kg, case.window, case.kpm, block_size=block)
    assert isinstance(got, float) and 0.0 <= got <= 1.0
    assert got == pytest.approx(_brute_pairs(case.qg, case.kg, case.window, case.kpm), abs=1e-12)


def test_pairs_retained_limits():
    case = make_case(nk=50, groups=4, top_k=1, window=4, seed=3)
    assert pairs_retained(case.kg, case.kg, 50) == 1.0  # window >= N: dense causal
    every = torch.ones(1, 50, 4, dtype=torch.bool)
    assert pairs_retained(every, every, 1) == 1.0  # top_k = K: dense causal
    none = torch.zeros(1, 50, 4, dtype=torch.bool)
    # window 4, no groups: sum over i of min(i + 1, 4) pairs out of N (N + 1) / 2
    assert pairs_retained(none, none, 4) == pytest.approx((1 + 2 + 3 + 4 * 47) / (50 * 51 / 2))
    nothing_real = torch.zeros(1, 50, dtype=torch.bool)
    assert pairs_retained(case.kg, case.kg, 4, nothing_real) == 0.0
    partial = pairs_retained(case.kg, case.kg, 4)
    assert 0.0 < partial < 1.0
