"""Routing scores and hard top-k memberships (docs/method.md §1 and §4), ties included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import tolerance

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
    torch.testing.assert_close(got.double(), want, **tolerance("reordered"))
    if normalize:  # cosine similarities: bounded by 1 / tau
        assert got.abs().max() <= 1 / tau + 1e-4


def test_group_scores_temperature_scales_linearly():
    g = gen(12)
    hidden, proj, cents = torch.randn(1, 6, 8, generator=g), torch.randn(8, 4), torch.randn(3, 4)
    a = group_scores(hidden, proj, cents, 0.1)
    b = group_scores(hidden, proj, cents, 0.05)
    torch.testing.assert_close(b, 2 * a, **tolerance("rounding"))


def test_group_scores_gradients_reach_router_parameters():
    g = gen(13)
    hidden = torch.randn(2, 6, 8, generator=g)
    proj = torch.randn(8, 4, generator=g, requires_grad=True)
    cents = torch.randn(3, 4, generator=g, requires_grad=True)
    (group_scores(hidden, proj, cents, 0.1) * torch.randn(2, 6, 3, generator=g)).sum().backward()
    for p in (proj, cents):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_a_scaled_centroid_does_not_change_cosine_scores():
    g = gen(90)
    hidden, proj, cents = torch.randn(1, 30, 32, generator=g), torch.randn(32, 16), None
    cents = torch.randn(4, 16, generator=g)
    scaled = cents.clone()
    scaled[1] *= 1e4
    a = group_scores(hidden, proj, cents, 0.01)
    b = group_scores(hidden, proj, scaled, 0.01)
    assert torch.isfinite(b).all()
    torch.testing.assert_close(a, b, **tolerance("log"))


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("pair", [(0, 1), (1, 3), (2, 5), (4, 5)])
def test_identical_centroids_tie_to_the_lowest_index(pair, top_k):
    """Two identical centroids tie exactly for every token: the lower index wins, on every
    one of 20 runs."""
    g = gen(sum(pair))
    k = 6
    hidden = torch.randn(1, 50, 24, generator=g)
    proj = torch.randn(24, 8, generator=g)
    cents = torch.randn(k, 8, generator=g)
    lo, hi = pair
    cents[hi] = cents[lo]
    first = None
    for _ in range(20):
        scores = group_scores(hidden, proj, cents, 0.1)
        assert torch.equal(scores[..., lo], scores[..., hi])
        groups = topk_memberships(scores, top_k)
        if first is None:
            first = groups
        assert torch.equal(groups, first)
    # wherever the tied pair straddles the top-k cut, the lower index is the one kept
    straddle = first[..., lo] ^ first[..., hi]
    assert (first[..., lo] | ~straddle).all()
    assert not (first[..., hi] & ~first[..., lo]).any()


@pytest.mark.parametrize("k,tied", [(2, (0, 1)), (4, (1, 3)), (4, (0, 3)), (8, (2, 6))])
def test_a_token_equidistant_to_two_centroids_goes_to_the_lower_index(k, tied):
    """A token exactly equidistant to two centroids (orthonormal centroids, feature on the
    diagonal between them) goes to the lower index, 20 runs out of 20."""
    proj = torch.eye(k)
    cents = torch.eye(k)
    hidden = torch.zeros(1, 1, k)
    hidden[0, 0, list(tied)] = 1.0
    for _ in range(20):
        scores = group_scores(hidden, proj, cents, 0.1)
        assert scores[0, 0, tied[0]] == scores[0, 0, tied[1]]
        groups = topk_memberships(scores, 1)
        assert groups[0, 0].nonzero().flatten().tolist() == [tied[0]]


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_model_routes_like_the_fp32_model(params_dtype):
    """Routing is computed in fp32: for a bf16 model the scores (and groups) equal those of
    the fp32 model run on the same values, even where scores are ~1e-4 apart."""
    g = gen(111)
    hidden = torch.randn(2, 200, 64, generator=g).to(torch.bfloat16)
    proj = torch.randn(64, 16, generator=g).to(params_dtype)
    cents = torch.randn(8, 16, generator=g).to(params_dtype)
    s16 = group_scores(hidden, proj, cents, 0.1)
    s32 = group_scores(hidden.float(), proj.float(), cents.float(), 0.1)
    assert s16.dtype == torch.float32
    torch.testing.assert_close(s16, s32, **tolerance("rounding"))
    for top_k in (1, 2):
        assert torch.equal(topk_memberships(s16, top_k), topk_memberships(s32, top_k))
    # crafted: two groups 1e-4 apart (not resolvable in bf16 arithmetic)
    hidden = torch.ones(1, 1, 2, dtype=torch.bfloat16)
    cents = torch.tensor([[1.0, 0.0], [0.0, 1.0001]])
    scores = group_scores(hidden, torch.eye(2), cents, 1.0, normalize=False)
    assert scores[0, 0, 1] - scores[0, 0, 0] == pytest.approx(1e-4, rel=1e-2)
    assert topk_memberships(scores, 1)[0, 0].tolist() == [False, True]
    in_bf16 = (hidden @ torch.eye(2, dtype=torch.bfloat16)) @ cents.to(torch.bfloat16).t()
    assert in_bf16[0, 0, 0] == in_bf16[0, 0, 1]  # bf16 routing would have tied (and lost)


@pytest.mark.parametrize("k", [8, 33, 64])
def test_top_1_ties_go_to_the_lowest_index_on_wide_rows(k):
    """top_k = 1 over many tokens and wide score rows (the vectorised reductions): of tied
    maxima the lowest index wins, as for top_k > 1."""
    g = gen(k)
    scores = torch.randint(0, 2, (3, 257, k), generator=g).float()
    scores[0, 0] = 1.0  # every group tied
    got = topk_memberships(scores, 1)
    assert torch.equal(got, _brute_topk(scores, 1))
    assert got[0, 0, 0] and got[0, 0].sum() == 1
