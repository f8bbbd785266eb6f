"""Routing scores and hard top-k memberships (spec sections 1 and 4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from focus_attention.ops import group_scores, topk_memberships

from .helpers import HYP, gen


def _brute_topk(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per token: the ``top_k`` groups with the highest score, ties to the lowest index."""
    out = torch.zeros(scores.shape, dtype=torch.bool)
    for b in range(scores.shape[0]):
        for i in range(scores.shape[1]):
            row = scores[b, i].tolist()
            for c in sorted(range(len(row)), key=lambda c: (-row[c], c))[:top_k]:
                out[b, i, c] = True
    return out


@given(
    batch=st.integers(1, 2),
    n=st.integers(1, 12),
    k=st.integers(1, 9),
    data=st.data(),
    tie_heavy=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@HYP
def test_topk_memberships_equals_brute_force(batch, n, k, data, tie_heavy, seed):
    top_k = data.draw(st.integers(1, k))
    g = gen(seed)
    if tie_heavy:  # few distinct values: many exact ties
        scores = torch.randint(0, 3, (batch, n, k), generator=g).float()
    else:
        scores = torch.randn(batch, n, k, generator=g)
    got = topk_memberships(scores, top_k)
    assert got.dtype == torch.bool and got.shape == scores.shape
    assert (got.sum(-1) == top_k).all()
    assert torch.equal(got, _brute_topk(scores, top_k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_topk_memberships_any_float_dtype(dtype):
    scores = torch.tensor([[[0.5, 2.0, 2.0, -1.0], [0.0, 0.0, 0.0, 0.0]]], dtype=dtype)
    got = topk_memberships(scores, 2)
    want = torch.tensor([[[False, True, True, False], [True, True, False, False]]])
    assert torch.equal(got, want)


def test_topk_all_groups_and_single_group():
    scores = torch.randn(2, 7, 5, generator=gen(0))
    assert topk_memberships(scores, 5).all()
    one = topk_memberships(scores, 1)
    assert torch.equal(one, torch.nn.functional.one_hot(scores.argmax(-1), 5).bool())
    assert topk_memberships(scores[..., :1], 1).all()  # K = 1


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_group_scores_formula(normalize, dtype):
    g = gen(11)
    hidden = torch.randn(2, 9, 24, generator=g).to(dtype)
    proj = torch.randn(24, 16, generator=g)
    cents = torch.randn(5, 16, generator=g)
    tau = 0.1
    got = group_scores(hidden, proj, cents, tau, normalize=normalize)
    assert got.dtype == torch.float32 and got.shape == (2, 9, 5)
    feats = hidden.double() @ proj.double()
    c = cents.double()
    if normalize:
        feats, c = _normalize(feats), _normalize(c)
    want = feats @ c.t() / tau
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    if normalize:  # cosine similarities: bounded by 1 / tau
        assert got.abs().max() <= 1 / tau + 1e-4


def test_group_scores_temperature_scales_linearly():
    g = gen(12)
    hidden, proj, cents = torch.randn(1, 6, 8, generator=g), torch.randn(8, 4), torch.randn(3, 4)
    a = group_scores(hidden, proj, cents, 0.1)
    b = group_scores(hidden, proj, cents, 0.05)
    torch.testing.assert_close(b, 2 * a, atol=1e-5, rtol=1e-6)


def test_group_scores_gradients_reach_router_parameters():
    g = gen(13)
    hidden = torch.randn(2, 6, 8, generator=g)
    proj = torch.randn(8, 4, generator=g, requires_grad=True)
    cents = torch.randn(3, 4, generator=g, requires_grad=True)
    (group_scores(hidden, proj, cents, 0.1) * torch.randn(2, 6, 3, generator=g)).sum().backward()
    for p in (proj, cents):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
