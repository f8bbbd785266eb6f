"""Sinkhorn balancing (docs/method.md §2): rows, balance, padding, column bias, gradients,
stability for very peaked scores."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops import group_scores, sinkhorn, topk_memberships

from .helpers import HYP, gen, padding_mask, sinkhorn_reference


def _scores(seed: int, batch: int, n: int, k: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(batch, n, k, generator=gen(seed)) * std


@given(
    batch=st.integers(1, 3),
    n=st.integers(1, 300),
    k=st.integers(1, 16),
    n_iter=st.integers(1, 20),
    std=st.sampled_from([0.1, 1.0, 5.0, 20.0]),
    seed=st.integers(0, 2**31 - 1),
)
@HYP
def test_rows_sum_to_one_and_match_float64_reference(batch, n, k, n_iter, std, seed):
    x = _scores(seed, batch, n, k, std)
    p = sinkhorn(x, n_iter)
    assert p.shape == x.shape and p.dtype == torch.float32
    assert torch.isfinite(p).all() and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(batch, n), **tolerance("oracle"))
    torch.testing.assert_close(p.double(), sinkhorn_reference(x, n_iter), **tolerance("oracle"))


@pytest.mark.parametrize("n,k", [(64, 4), (1000, 8), (37, 16), (256, 2), (5, 5), (3, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_balance_after_ten_iterations(n, k, seed):
    """Contract: each group's mass (its column sum over tokens) is within 1e-2 of N/K after
    10 iterations on random (standard normal) scores. K > N is included: each group then
    still gets N/K of a token's worth of mass."""
    p = sinkhorn(_scores(seed, 2, n, k), 10)
    mass = p.sum(dim=1)
    assert (mass - n / k).abs().max().item() <= 1e-2
    # without balancing the same scores are visibly unbalanced (the check can fail)
    raw = torch.softmax(_scores(seed, 2, n, k) * 3, dim=-1).sum(dim=1)
    if n >= 64:
        assert (raw - n / k).abs().max().item() > 1e-2


@pytest.mark.parametrize("kind", ["left", "right", "random"])
@pytest.mark.parametrize("n_iter", [1, 3, 10])
def test_padding_excluded_and_zero(kind, n_iter):
    """Padding rows are zero, real rows sum to 1, and every real row equals running the op
    on that sequence's real tokens alone (padding is excluded from the column sums)."""
    g = gen(7)
    n, k = 50, 4
    x = torch.randn(3, n, k, generator=g) * 2
    pad = padding_mask(g, 3, n, kind, None if kind == "random" else [50, 17, 1])
    p = sinkhorn(x, n_iter, padding_mask=pad)
    assert torch.isfinite(p).all()
    assert (p[~pad] == 0).all()
    torch.testing.assert_close(p[pad].sum(-1), torch.ones(int(pad.sum())), **tolerance("oracle"))
    for b in range(3):
        alone = sinkhorn(x[b : b + 1, pad[b]], n_iter)
        torch.testing.assert_close(p[b : b + 1, pad[b]], alone, **tolerance("rounding"))
    # padded scores can be anything (even huge) without changing the real rows
    x2 = x.masked_fill(~pad[..., None], 1e4)
    torch.testing.assert_close(sinkhorn(x2, n_iter, padding_mask=pad), p, **tolerance("rounding"))
    torch.testing.assert_close(
        p.double(), sinkhorn_reference(x, n_iter, pad), **tolerance("oracle")
    )


def test_fully_padded_sequence_is_all_zero_and_finite():
    x = torch.randn(2, 6, 3, generator=gen(1))
    pad = torch.tensor([[False] * 6, [True] * 6])
    p = sinkhorn(x, 10, padding_mask=pad)
    assert torch.isfinite(p).all()
    assert (p[0] == 0).all()
    torch.testing.assert_close(p[1].sum(-1), torch.ones(6))
    # gradients stay finite too
    xg = x.clone().requires_grad_(True)
    sinkhorn(xg, 10, padding_mask=pad).pow(2).sum().backward()
    assert torch.isfinite(xg.grad).all()
    assert (xg.grad[0] == 0).all()


@given(
    n=st.integers(1, 200),
    k=st.integers(1, 12),
    n_iter=st.integers(1, 15),
    std=st.sampled_from([0.5, 2.0, 10.0]),
    padded=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@HYP
def test_column_bias_reproduces_probs_and_topk(n, k, n_iter, std, padded, seed):
    g = gen(seed)
    x = torch.randn(2, n, k, generator=g) * std
    pad = padding_mask(g, 2, n, "random") if padded else None
    if pad is not None:
        pad[:, 0] = True  # at least one real token per sequence
    probs, bias = sinkhorn(x, n_iter, padding_mask=pad, return_column_bias=True)
    assert bias.shape == (2, k) and bias.dtype == torch.float32
    assert torch.isfinite(bias).all()
    torch.testing.assert_close(bias.mean(-1), torch.zeros(2), **tolerance("log"))  # centred
    plain = sinkhorn(x, n_iter, padding_mask=pad)
    torch.testing.assert_close(probs, plain, **tolerance("bitwise"))
    rebuilt = torch.softmax(x + bias[:, None, :], dim=-1)
    real = torch.ones(2, n, dtype=torch.bool) if pad is None else pad
    torch.testing.assert_close(rebuilt[real], probs[real], **tolerance("oracle"))
    # hard routing from the biased scores equals hard routing from the probabilities on
    # every real token whose top-k is not a numerical near-tie
    for top_k in sorted({1, (k + 1) // 2, k}):
        a = topk_memberships(x + bias[:, None, :], top_k)
        b = topk_memberships(probs, top_k)
        srt = probs.sort(dim=-1, descending=True).values
        gap = srt[..., top_k - 1] - (srt[..., top_k] if top_k < k else -1.0)
        clear = real & (gap > 1e-5)
        assert torch.equal(a[clear], b[clear])


def _grad_pair(pad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(3)
    x = torch.randn(2, 12, 4, generator=g)
    w = torch.randn(2, 12, 4, generator=g)
    x1 = x.clone().requires_grad_(True)
    (sinkhorn(x1, 6, padding_mask=pad) * w).sum().backward()
    x2 = x.double().requires_grad_(True)
    (sinkhorn_reference(x2, 6, pad) * w.double()).sum().backward()
    return x1.grad, x2.grad


def test_gradients_flow_and_match_float64_reference():
    """Gradients flow through every iteration: fp32 autograd of the op agrees with autograd
    of the float64 reference (which the helpers write independently)."""
    got, want = _grad_pair(None)
    assert torch.isfinite(got).all() and got.abs().sum() > 0
    torch.testing.assert_close(got.double(), want, **tolerance("gradient"))


def test_gradients_with_padding_are_finite_and_match_float64_reference():
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, 9:] = False
    got, want = _grad_pair(pad)
    assert torch.isfinite(want).all()
    assert torch.isfinite(got).all(), "NaN/inf gradient through a padded Sinkhorn"
    assert (got[~pad] == 0).all()
    torch.testing.assert_close(got.double(), want, **tolerance("gradient"))


@pytest.mark.parametrize("padded", [False, True])
def test_gradcheck_float64(padded):
    g = gen(4)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    pad = None
    if padded:
        pad = torch.ones(2, 5, dtype=torch.bool)
        pad[0, :2] = False
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 4, padding_mask=pad), (x,))


def _peaked_scores(source: str, tau: float, dtype, seed: int) -> torch.Tensor:
    """Scores up to +-50 ("uniform50"), cosine scores at a small temperature ("cosine"),
    or plain dot products with one centroid scaled to 1e4 ("big-centroid")."""
    g = gen(seed)
    if source == "uniform50":  # raw scores up to +-50
        x = (torch.rand(2, 120, 4, generator=g) * 2 - 1) * 50
        return x.to(dtype)
    hidden = torch.randn(2, 120, 32, generator=g).to(dtype)
    proj = torch.randn(32, 16, generator=g)
    cents = torch.randn(4, 16, generator=g)
    if source == "cosine":
        return group_scores(hidden, proj, cents, tau)
    cents[1] *= 1e4  # "one centroid scaled to 1e4", plain dot-product scores
    return group_scores(hidden, proj, cents, tau, normalize=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_iter", [3, 10, 20])
@pytest.mark.parametrize("tau", [0.01, 0.03, 0.05])
@pytest.mark.parametrize("source", ["uniform50", "cosine", "big-centroid"])
def test_stable_for_peaked_scores_in_every_dtype(source, tau, n_iter, dtype):
    x = _peaked_scores(source, tau, dtype, seed=int(tau * 1000) + n_iter)
    pad = torch.ones(2, 120, dtype=torch.bool)
    pad[1, :30] = False
    for mask in (None, pad):
        p = sinkhorn(x, n_iter, padding_mask=mask)
        assert p.dtype == torch.float32 and torch.isfinite(p).all()
        real = torch.ones(2, 120, dtype=torch.bool) if mask is None else mask
        assert (p[real].sum(-1) - 1).abs().max() <= 1e-3
        ref = sinkhorn_reference(x, n_iter, mask)
        assert (p.double() - ref).abs().max() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tau", [0.01, 0.05])
@pytest.mark.parametrize("source", ["uniform50", "cosine"])
def test_peaked_scores_balance_after_enough_iterations(source, tau, dtype):
    """Each group's mass reaches N/K within 1e-2 (over the real tokens), given enough
    iterations for these very peaked scores (300; 10 suffice for standard-normal scores,
    see test_sinkhorn)."""
    x = _peaked_scores(source, tau, dtype, seed=9)
    pad = torch.ones(2, 120, dtype=torch.bool)
    pad[1, :30] = False
    p = sinkhorn(x, 300, padding_mask=pad)
    for b in range(2):
        n_real = int(pad[b].sum())
        mass = p[b].sum(0)
        assert (mass - n_real / 4).abs().max() <= 1e-2, (b, mass.tolist())


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_iterations_is_the_softmax_over_groups(padded, dtype):
    """``n_iter=0`` (Sinkhorn off): every real row is ``softmax(scores)`` over groups
    (computed here in float64 as the oracle), padding rows are zero, the column bias is zero,
    and the groups are left unbalanced (unlike one iteration)."""
    g = gen(11)
    x = (torch.randn(2, 40, 6, generator=g) * 3 + torch.arange(6.0) * 0.5).to(dtype)
    pad = padding_mask(g, 2, 40, "right", [40, 23]) if padded else None
    probs, bias = sinkhorn(x, 0, pad, return_column_bias=True)
    oracle = torch.softmax(x.double(), dim=-1)
    if pad is not None:
        oracle = oracle.masked_fill(~pad[..., None], 0.0)
    torch.testing.assert_close(probs.double(), oracle, **tolerance("rounding", dtype))
    assert torch.equal(bias, torch.zeros_like(bias))
    cols = probs.sum(dim=1)  # tokens per group: unbalanced without Sinkhorn
    balanced = sinkhorn(x, 10, pad).sum(dim=1)
    assert (cols.max(-1).values - cols.min(-1).values > 1).all()
    assert (balanced.max(-1).values - balanced.min(-1).values < 1).all()


def test_negative_iterations_raise():
    with pytest.raises(ValueError, match="n_iter"):
        sinkhorn(torch.zeros(1, 3, 2), -1)
