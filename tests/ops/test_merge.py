"""``merge_partials``: the log-sum-exp merge of two disjoint parts (docs/method.md §5)."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import tolerance

from focus_attention.ops import merge_partials

from .helpers import gen


def _attend(logits: torch.Tensor, values: torch.Tensor):
    """Float64 softmax attention of one key set, ``logits [3, 5, n]``, ``values [3, n, 4]``:
    ``(out, lse)``, 0 and -inf when the set is empty."""
    if logits.shape[-1] == 0:
        shape = logits.shape[:-1]
        zeros = torch.zeros(*shape, values.shape[-1], dtype=torch.float64)
        return zeros, torch.full(shape, -math.inf, dtype=torch.float64)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.softmax(logits, dim=-1) @ values, lse


def _split(n_a: int, n_b: int, shift_a: float = 0.0, shift_b: float = 0.0, seed: int = 0):
    """Logits and values of 3 x 5 queries over two disjoint key sets, and the union."""
    g = gen(seed)
    la = torch.randn(3, 5, n_a, generator=g, dtype=torch.float64) + shift_a
    lb = torch.randn(3, 5, n_b, generator=g, dtype=torch.float64) + shift_b
    va = torch.randn(3, n_a, 4, generator=g, dtype=torch.float64)
    vb = torch.randn(3, n_b, 4, generator=g, dtype=torch.float64)
    part_a, part_b = _attend(la, va), _attend(lb, vb)
    union = _attend(torch.cat([la, lb], -1), torch.cat([va, vb], -2))
    return part_a, part_b, union


@pytest.mark.parametrize("n_a,n_b", [(4, 7), (1, 1), (9, 0), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_merge_equals_attention_over_the_union(n_a, n_b, dtype):
    (oa, la), (ob, lb), (ou, lu) = _split(n_a, n_b)
    out, lse = merge_partials(oa.to(dtype), la.to(dtype), ob.to(dtype), lb.to(dtype))
    assert out.dtype == dtype and lse.dtype == dtype
    torch.testing.assert_close(out.double(), ou, **tolerance("rounding", dtype))
    torch.testing.assert_close(lse.double(), lu, **tolerance("rounding", dtype))


@pytest.mark.parametrize("gap", [90.0, 300.0, 1e4, -90.0, -300.0, -1e4])
def test_a_huge_gap_in_either_direction_stays_exact_in_float32(gap):
    """The maximum of both parts is subtracted: a gap beyond ~88 (exp overflow in float32)
    in favour of either part changes nothing."""
    (oa, la), (ob, lb), (ou, lu) = _split(5, 6, shift_a=gap)
    out, lse = merge_partials(oa.float(), la.float(), ob.float(), lb.float())
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ou, **tolerance("rounding"))
    lse_size = max(1.0, abs(gap))  # the log-sum-exp is about the gap: its rounding scales with it
    torch.testing.assert_close(lse.double(), lu, **tolerance("rounding", scale=lse_size))


def test_an_empty_part_contributes_nothing_whatever_its_finite_output():
    g = gen(1)
    out_a, lse_a = torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, generator=g)
    garbage = torch.full((2, 6, 3), 3e38)
    empty = torch.full((2, 6), -math.inf)
    for args in ((out_a, lse_a, garbage, empty), (garbage, empty, out_a, lse_a)):
        out, lse = merge_partials(*args)
        assert torch.equal(out, out_a) and torch.equal(lse, lse_a)


def test_two_empty_parts_give_zero_and_minus_inf_with_finite_gradients():
    out_a = torch.randn(2, 3, 4, requires_grad=True)
    lse_a = torch.full((2, 3), -math.inf, requires_grad=True)
    out_b = torch.randn(2, 3, 4, requires_grad=True)
    lse_b = torch.full((2, 3), -math.inf, requires_grad=True)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert (out == 0).all() and (lse == -math.inf).all()
    (out.sum() + lse.clamp(min=-1).sum()).backward()
    for t in (out_a, lse_a, out_b, lse_b):
        assert torch.isfinite(t.grad).all()


def test_nan_in_a_non_empty_part_propagates():
    out_a = torch.tensor([[math.nan, 1.0]])
    lse_a = torch.tensor([0.5])
    out, lse = merge_partials(out_a, lse_a, torch.ones(1, 2), torch.tensor([0.0]))
    assert torch.isnan(out[0, 0]) and not torch.isnan(out[0, 1])
    out, lse = merge_partials(torch.ones(1, 2), torch.tensor([math.nan]), torch.ones(1, 2), lse_a)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_gradients_pass_gradcheck():
    g = gen(2)
    args = [
        torch.randn(3, 4, 2, generator=g, dtype=torch.float64).requires_grad_(),
        torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_(),
        torch.randn(3, 4, 2, generator=g, dtype=torch.float64).requires_grad_(),
        (torch.randn(3, 4, generator=g, dtype=torch.float64) + 50).requires_grad_(),
    ]
    assert torch.autograd.gradcheck(merge_partials, args)


def test_half_precision_outputs_are_merged_in_float32():
    g = gen(3)
    out_a, out_b = (torch.randn(5, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    lse_a, lse_b = torch.randn(5, generator=g), torch.randn(5, generator=g)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    w = torch.softmax(torch.stack([lse_a, lse_b]), dim=0)
    want = w[0, :, None] * out_a.float() + w[1, :, None] * out_b.float()
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    "args,name",
    [
        ((torch.ones(2, 3), torch.ones(2), torch.ones(2, 4), torch.ones(2)), "out_a"),
        ((torch.ones(2, 3), torch.ones(3), torch.ones(2, 3), torch.ones(2)), "out_a"),
        ((torch.ones(2, 3), torch.ones(2), torch.ones(2, 3), torch.ones(5)), "out_b"),
        ((torch.ones(2, 3), torch.ones(2).half(), torch.ones(2, 3), torch.ones(2)), "lse_a"),
    ],
)
def test_mismatched_parts_are_refused(args, name):
    with pytest.raises(ValueError, match=name):
        merge_partials(*args)
