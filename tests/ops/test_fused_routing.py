"""causal_topk_groups: the fused CPU routing of a decoding step against the two ops it
replaces (group_scores + bias, then topk_memberships), which are its oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_attention.ops import (
    causal_topk_groups,
    causal_topk_groups_many,
    group_scores,
    topk_memberships,
)
from focus_attention.ops import routing as routing_module
from focus_attention.ops.routing import FUSED_ROUTE_TOKENS


def _oracle(hidden, proj, cents, bias, tau, top_k) -> tuple[torch.Tensor, torch.Tensor]:
    scores = group_scores(hidden, proj, cents, tau) + bias
    return topk_memberships(scores, top_k), scores


def _clear_margin(scores: torch.Tensor, top_k: int, margin: float = 1e-3) -> torch.Tensor:
    """bool ``[B, N]``: tokens whose top_k-th and next scores are at least ``margin`` apart
    (elsewhere float32 rounding may pick either group)."""
    k = scores.shape[-1]
    if top_k == k:
        return torch.ones(scores.shape[:2], dtype=torch.bool)
    ordered = scores.sort(dim=-1, descending=True).values
    return (ordered[..., top_k - 1] - ordered[..., top_k]) > margin


def _inputs(b, n, d_model, d_g, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(b, n, d_model, generator=gen)).to(dtype)
    proj = torch.randn(d_model, d_g, generator=gen)
    cents = torch.randn(k, d_g, generator=gen)
    bias = 0.3 * torch.randn(k, generator=gen)
    return hidden, proj, cents, bias


def _spy(monkeypatch) -> list[int]:
    """Record the calls that reach the fused kernel."""
    calls: list[int] = []
    real = routing_module.extension.load

    class Spy:
        def __init__(self, module):
            self.module = module

        def focus_route(self, *args):
            calls.append(args[0].shape[1])
            return self.module.focus_route(*args)

    def load():
        module = real()
        return None if module is None else Spy(module)

    monkeypatch.setattr(routing_module.extension, "load", load)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 1), (2, 5), (1, FUSED_ROUTE_TOKENS)])
@pytest.mark.parametrize("k,top_k", [(1, 1), (4, 1), (8, 1), (8, 2), (16, 3), (64, 2), (8, 8)])
def test_fused_routing_matches_the_ops(kernel_built, monkeypatch, dtype, b, n, k, top_k):
    if not kernel_built:
        pytest.skip("the cpu_fused kernel is not available here")
    calls = _spy(monkeypatch)
    hidden, proj, cents, bias = _inputs(b, n, 40, 16, k, dtype, seed=k * 7 + n)
    expected, scores = _oracle(hidden, proj, cents, bias, 0.1, top_k)
    with torch.inference_mode():
        got = causal_topk_groups(hidden, proj, cents, bias, 0.1, top_k)
    assert calls == [n], "the fused kernel should route a decoding-sized call"
    assert got.dtype == torch.bool and got.shape == (b, n, k)
    assert torch.equal(got.sum(-1), torch.full((b, n), top_k))
    clear = _clear_margin(scores, top_k)
    assert clear.float().mean() > 0.5  # the comparison below is not vacuous
    assert torch.equal(got[clear], expected[clear])


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    n=st.integers(1, FUSED_ROUTE_TOKENS),
    d_model=st.integers(1, 48),
    d_g=st.integers(1, 24),
    k=st.integers(1, 12),
    data=st.data(),
)
def test_fused_routing_matches_the_ops_on_any_shape(kernel_built, b, n, d_model, d_g, k, data):
    if not kernel_built:
        pytest.skip("the cpu_fused kernel is not available here")
    top_k = data.draw(st.integers(1, k))
    tau = data.draw(st.sampled_from([0.05, 0.1, 1.0]))
    seed = data.draw(st.integers(0, 2**16))
    hidden, proj, cents, bias = _inputs(b, n, d_model, d_g, k, torch.float32, seed)
    expected, scores = _oracle(hidden, proj, cents, bias, tau, top_k)
    with torch.no_grad():
        got = causal_topk_groups(hidden, proj, cents, bias, tau, top_k)
    clear = _clear_margin(scores, top_k)
    assert torch.equal(got.sum(-1), torch.full((b, n), top_k))
    assert torch.equal(got[clear], expected[clear])


def test_ties_go_to_the_lowest_group_as_in_topk_memberships(kernel_built):
    """Duplicate centroids tie exactly: both paths take the lowest index."""
    if not kernel_built:
        pytest.skip("the cpu_fused kernel is not available here")
    hidden, proj, cents, _ = _inputs(2, 3, 24, 8, 6, torch.float32, seed=3)
    cents = torch.cat([cents[:3], cents[:3]])  # groups g and g + 3 are the same direction
    bias = torch.zeros(6)
    for top_k in (1, 2, 3):
        expected, _ = _oracle(hidden, proj, cents, bias, 0.1, top_k)
        with torch.no_grad():
            got = causal_topk_groups(hidden, proj, cents, bias, 0.1, top_k)
        assert torch.equal(got, expected)
        if top_k == 1:  # the tied copy is never taken before its original
            assert not got[..., 3:].any()


def test_zero_hidden_state_and_zero_centroid_are_routed_as_the_ops_do(kernel_built):
    """The norms are clamped at 1e-6 in both paths: a zero vector scores 0 (+ bias)."""
    if not kernel_built:
        pytest.skip("the cpu_fused kernel is not available here")
    hidden, proj, cents, bias = _inputs(1, 2, 16, 8, 4, torch.float32, seed=5)
    hidden[0, 0] = 0.0
    cents[1] = 0.0
    expected, _ = _oracle(hidden, proj, cents, bias, 0.1, 1)
    with torch.no_grad():
        assert torch.equal(causal_topk_groups(hidden, proj, cents, bias, 0.1, 1), expected)


@pytest.mark.parametrize("where", ["kernel", "ops"])
def test_nan_scores_are_refused(kernel_built, where):
    hidden, proj, cents, bias = _inputs(1, 2 if where == "kernel" else 40, 16, 8, 4, torch.float32, 1)  # fmt: skip
    hidden[0, 1, 3] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match="NaN"):
        causal_topk_groups(hidden, proj, cents, bias, 0.1, 1)


@pytest.mark.parametrize("many", [False, True], ids=["one", "many"])
def test_nan_check_can_be_skipped_where_the_ops_route(many):
    """``check_nan=False`` (no read back to the host): the ops route a NaN token without an
    error (NaN ranks highest, lowest index first) and every other token as with the check;
    the default raises."""
    hidden, proj, cents, bias = _inputs(1, 40, 16, 8, 4, torch.float32, 1)
    expected, _ = _oracle(hidden, proj, cents, bias, 0.1, 2)
    hidden[0, 1, 3] = float("nan")

    def route(**kw):
        if many:
            return causal_topk_groups_many(hidden, proj, cents, bias, 0.1, (2,), **kw)[0]
        return causal_topk_groups(hidden, proj, cents, bias, 0.1, 2, **kw)

    with torch.no_grad():
        with pytest.raises(ValueError, match="NaN"):
            route()
        groups = route(check_nan=False)
    assert groups.sum(-1).eq(2).all()
    assert torch.equal(groups[0, 1], torch.tensor([True, True, False, False]))
    keep = torch.arange(40) != 1
    assert torch.equal(groups[:, keep], expected[:, keep])


def test_the_ops_run_where_the_kernel_does_not(kernel_built, monkeypatch):
    """Gradients enabled, more tokens than FUSED_ROUTE_TOKENS, a non-float32 router tensor:
    the two ops run, bitwise."""
    calls = _spy(monkeypatch)
    hidden, proj, cents, bias = _inputs(1, FUSED_ROUTE_TOKENS + 1, 16, 8, 4, torch.float32, 2)
    expected, _ = _oracle(hidden, proj, cents, bias, 0.1, 2)
    with torch.no_grad():
        assert torch.equal(causal_topk_groups(hidden, proj, cents, bias, 0.1, 2), expected)
    short = hidden[:, :2]
    assert torch.equal(causal_topk_groups(short, proj, cents, bias, 0.1, 2), expected[:, :2])
    with torch.no_grad():
        got = causal_topk_groups(short, proj.double(), cents, bias, 0.1, 2)
    assert torch.equal(got, expected[:, :2])
    assert calls == []


@pytest.mark.parametrize(
    "change,match",
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": 5}, "top_k"),
        ({"temperature": 0.0}, "temperature"),
        ({"proj": torch.randn(15, 8)}, "proj"),
        ({"centroids": torch.randn(4, 7)}, "centroids"),
        ({"hidden": torch.randn(2, 16)}, "hidden"),
    ],
)
def test_bad_arguments_get_the_ops_errors(change, match):
    hidden, proj, cents, bias = _inputs(1, 2, 16, 8, 4, torch.float32, 4)
    args = {"hidden": hidden, "proj": proj, "centroids": cents, "bias": bias,
            "temperature": 0.1, "top_k": 1}  # fmt: skip
    args.update(change)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        causal_topk_groups(**args)


@pytest.mark.parametrize("n", [1, 3, FUSED_ROUTE_TOKENS + 1, 300])
@pytest.mark.parametrize("top_ks", [(1, 2), (2, 1), (3, 3), (1, 4, 1)])
def test_many_top_ks_equal_one_call_per_top_k(n, top_ks):
    """causal_topk_groups_many is bitwise causal_topk_groups for each entry, fused (a
    decoding step) or not, with or without gradients."""
    hidden, proj, cents, bias = _inputs(2, n, 24, 8, 4, torch.float32, seed=n)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = causal_topk_groups_many(hidden, proj, cents, bias, 0.1, top_ks)
            want = [causal_topk_groups(hidden, proj, cents, bias, 0.1, k) for k in top_ks]
        assert len(got) == len(top_ks)
        for g, w, k in zip(got, want, top_ks, strict=True):
            assert torch.equal(g, w)
            assert torch.equal(g.sum(-1), torch.full((2, n), k))


def test_many_top_ks_score_the_tokens_once(monkeypatch):
    """Outside the fused kernel the scores are computed once for every top_k."""
    calls = []
    real = routing_module.group_scores

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(routing_module, "group_scores", counting)
    hidden, proj, cents, bias = _inputs(1, FUSED_ROUTE_TOKENS + 5, 16, 8, 8, torch.float32, 5)
    q_groups, k_groups = causal_topk_groups_many(hidden, proj, cents, bias, 0.1, (2, 1))
    assert len(calls) == 1
    assert (q_groups & k_groups).sum() == k_groups.sum()  # a key's best group is a query's too


@pytest.mark.parametrize("top_ks,match", [((), "top_ks"), (2, "top_ks"), ((1, 5), "top_k"), ((0,), "top_k")])  # fmt: skip
def test_many_top_ks_bad_arguments(top_ks, match):
    hidden, proj, cents, bias = _inputs(1, 2, 16, 8, 4, torch.float32, 4)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        causal_topk_groups_many(hidden, proj, cents, bias, 0.1, top_ks)
