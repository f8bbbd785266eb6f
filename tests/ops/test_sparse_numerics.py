"""Numerics of ``sparse_attention`` on every backend: empty parts, log-sum-exp gaps between
the parts, large logits, half precision, NaN inputs (docs/method.md §5, "Merge by
log-sum-exp")."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import tolerance

from focus_attention.ops import dense_attention, focus_mask, sparse_attention

from .helpers import (
    Case,
    assert_matches_oracle,
    gen,
    low_precision_bound,
    make_case,
    max_err,
    naive_attention,
)

TINY = dict(heads=8, kv_heads=2, dim=16, groups=4, top_k=1, window=32)

# --------------------------------------------------------------------------------------
# empty parts merge without NaN
# --------------------------------------------------------------------------------------


def _local_mask(case: Case) -> torch.Tensor:
    """Causal, windowed, padding-aware mask with no group pairs at all."""
    i = torch.arange(case.nk - case.nq, case.nk)[:, None]
    j = torch.arange(case.nk)[None]
    m = ((j <= i) & (i - j < case.window))[None].expand(case.q.shape[0], -1, -1)
    return m if case.kpm is None else m & case.kpm[:, None, :]


def _empty_part_case(kind: str, nq_mode: str, padding: str | None, dtype=torch.float32) -> Case:
    """Cases where some part of the split is empty; every one equals local-only attention
    except "query-group-empty", which only needs finite output equal to the oracle."""
    if kind == "short":  # length 20 with window 32: no distant key at all
        n, window = 20, 32
        kg = torch.zeros(1, n, 4, dtype=torch.bool)
        kg[0, torch.arange(n), torch.arange(n) % 4] = True
    elif kind == "runs":  # each group is one run shorter than the window
        n, window = 120, 8
        kg = torch.zeros(1, n, 26, dtype=torch.bool)  # 15 runs: 11 groups stay empty
        kg[0, torch.arange(n), torch.arange(n) // window] = True
    elif kind == "no-groups":  # no token has any group
        n, window = 150, 5
        kg = torch.zeros(1, n, 4, dtype=torch.bool)
    else:  # "query-group-empty": the queries' groups hold no key at all
        n, window = 150, 5
        kg = torch.zeros(1, n, 4, dtype=torch.bool)
        kg[0, :, 0] = True
    nq = {"prefill": n, "decode": 1, "chunk": n // 3}[nq_mode]
    qg = kg[:, n - nq :].clone()
    if kind == "query-group-empty":
        qg = torch.zeros(1, nq, 4, dtype=torch.bool)
        qg[0, :, 3] = True
    g = gen(len(kind) + nq)
    q = torch.randn(1, 4, nq, 16, generator=g)
    k = torch.randn(1, 2, n, 16, generator=g)
    v = torch.randn(1, 2, n, 16, generator=g)
    kpm = None
    if padding == "left":
        kpm = torch.ones(1, n, dtype=torch.bool)
        kpm[0, : n // 4] = False
    return Case(q, k, v, qg, kg, window, kpm).to(dtype)


EMPTY_PART_KINDS = ["short", "runs", "no-groups", "query-group-empty"]


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("nq_mode", ["prefill", "decode", "chunk"])
@pytest.mark.parametrize("kind", EMPTY_PART_KINDS)
def test_empty_parts_equal_local_attention(kind, nq_mode, padding, backend):
    case = _empty_part_case(kind, nq_mode, padding)
    out, lse = case.sparse(backend, return_lse=True)
    assert torch.isfinite(out).all()
    assert not torch.isnan(lse).any() and not (lse == math.inf).any()
    assert_matches_oracle(case, out, lse)
    local, local_lse = naive_attention(case.q, case.k, case.v, _local_mask(case))
    assert (out.double() - local).abs().max() <= 1e-6
    assert torch.equal(torch.isinf(lse), torch.isinf(local_lse))


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("kind", EMPTY_PART_KINDS)
def test_empty_parts_bf16_forward_and_backward_have_no_nan(kind, padding):
    """bf16 through the math backend, forward and backward: outputs, lse and gradients
    free of NaN/inf (lse is finite or -inf, never NaN or +inf)."""
    case = _empty_part_case(kind, "prefill", padding, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v)]
    out, lse = sparse_attention(
        *leaves,
        case.qg,
        case.kg,
        case.window,
        key_padding_mask=case.kpm,
        backend="math",
        return_lse=True,
    )
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert not torch.isnan(lse).any() and not (lse == math.inf).any()
    out.float().pow(2).sum().backward()
    for name, t in zip("qkv", leaves, strict=True):
        assert torch.isfinite(t.grad).all(), f"d{name} has NaN/inf"
    assert_matches_oracle(case, out.detach(), lse)


def test_fully_padded_rows_output_zero_and_lse_minus_inf(backend):
    case = make_case(nk=40, nq=40, batch=2, padding="left", lengths=[0, 10], **TINY)
    out, lse = case.sparse(backend, return_lse=True)
    assert (lse[0] == -math.inf).all() and (out[0] == 0).all()
    assert (lse[1, :, :30] == -math.inf).all() and torch.isfinite(lse[1, :, 30:]).all()
    assert_matches_oracle(case, out, lse)


# --------------------------------------------------------------------------------------
# log-sum-exp gaps between the group part and the local part
# --------------------------------------------------------------------------------------


def _gap_case(dominant: str, top_k: int, nq: int, gap: float, dtype) -> Case:
    """Three tokens, head_dim 1, window 2, every q = 1 (so with scale 1 a logit is the key).

    Tokens 0 and 2 share their groups, token 1 is in others: for query 2 the group part is
    keys {0, 2} and the local part key {1}. One key holds ``gap``: key 0 ("group": the
    group part's log-sum-exp exceeds the local part's by ~gap) or key 1 ("local": the
    reverse). A merge that subtracts the maximum of one part only computes exp(gap), which
    overflows float32 beyond ~88.
    """
    groups = 2 * top_k
    a, b = list(range(top_k)), list(range(top_k, groups))
    kg = torch.zeros(1, 3, groups, dtype=torch.bool)
    kg[0, 0, a] = kg[0, 2, a] = kg[0, 1, b] = True
    k = torch.zeros(1, 1, 3, 1)
    k[0, 0, 0 if dominant == "group" else 1, 0] = gap
    v = torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3, 1)
    q = torch.ones(1, 1, nq, 1)
    return Case(q, k, v, kg[:, 3 - nq :].clone(), kg, 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gap", [100.0, 1000.0])
@pytest.mark.parametrize("nq", [3, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dominant", ["group", "local"])
def test_a_huge_log_sum_exp_gap_between_the_parts_is_merged_exactly(
    dominant, top_k, nq, gap, dtype, backend
):
    case = _gap_case(dominant, top_k, nq, gap, dtype)
    out, lse = case.sparse(backend, scale=1.0, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (out, lse)
    mask = focus_mask(case.qg, case.kg, case.window)
    ref, ref_lse = dense_attention(case.q.float(), case.k.float(), case.v.float(), mask, scale=1.0)
    # the dominant key takes all the weight: its value, and its logit as log-sum-exp
    want = 1.0 if dominant == "group" else 2.0
    assert out[0, 0, -1, 0].item() == pytest.approx(want, abs=1e-6)
    assert max_err(out, ref) <= 1e-6 and max_err(lse, ref_lse) <= 1e-4 * gap


@pytest.mark.parametrize("scale", [5.0, 20.0])
def test_large_logits_are_merged_as_accurately_as_dense_fp32(scale, backend):
    """Logits in the tens to hundreds: every part and the merge stay finite and as accurate
    as fp32 dense attention. fp32 itself cannot resolve such logits to 1e-5, so the bar is
    twice dense fp32's own error against float64, plus 1e-6."""
    case = make_case(nk=200, nq=60, batch=2, heads=4, kv_heads=2, top_k=2, window=6, seed=4)
    out, lse = case.sparse(backend, scale=scale, return_lse=True)
    exact, exact_lse = naive_attention(case.q, case.k, case.v, case.mask(), scale=scale)
    dense, dense_lse = dense_attention(case.q, case.k, case.v, case.mask(), scale=scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = (out.double() - exact).abs().max().item()
    dense_err = (dense.double() - exact).abs().max().item()
    assert err <= 2 * dense_err + 1e-6, (err, dense_err)
    lse_err = (lse.double() - exact_lse).abs().max().item()
    dense_lse_err = (dense_lse.double() - exact_lse).abs().max().item()
    assert lse_err <= 2 * dense_lse_err + 1e-4, (lse_err, dense_lse_err)


# --------------------------------------------------------------------------------------
# half precision with padding
# --------------------------------------------------------------------------------------


def _padded_case(side: str, dtype) -> Case:
    case = make_case(
        nk=200, batch=2, padding=side, lengths=[3, 200], seed=8, **{**TINY, "top_k": 2}
    )
    return case.to(dtype) if dtype != torch.float32 else case


@pytest.mark.parametrize("side", ["left", "right"])
def test_half_precision_with_padding_forward(side, half_dtype, backend):
    """Against the fp32 oracle on the half-precision values (assert_matches_oracle), and
    against the fp32 oracle on the original fp32 values: within twice the error of the
    dense reference run in the half dtype (input rounding included in both)."""
    ref_case = _padded_case(side, torch.float32)
    case = _padded_case(side, half_dtype)
    out, lse = case.sparse(backend, return_lse=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_matches_oracle(case, out, lse)
    real = ref_case.kpm  # queries are the keys here; a query is real iff its token is
    first = real.float().argmax(dim=1)  # first real token of each sequence
    for b in range(2):
        assert torch.isfinite(out[b, :, first[b]]).all()
        assert torch.isfinite(lse[b, :, first[b]]).all()  # it sees itself at least
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)
    exact, _ = dense_attention(ref_case.q, ref_case.k, ref_case.v, mask)
    low, _ = dense_attention(case.q, case.k, case.v, mask)
    bound = low_precision_bound(max_err(low, exact), exact, half_dtype)
    assert max_err(out, exact) <= bound


def _grads(fn, tensors, cot):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    (fn(*leaves).float() * cot).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("side", ["left", "right"])
def test_half_precision_with_padding_gradients(side, half_dtype):
    """math-backend gradients from half-precision inputs, against fp32 oracle gradients on
    the same values: within twice the error of the dense reference's gradients computed in
    the half dtype."""
    case = _padded_case(side, half_dtype)
    cot = torch.randn(case.q.shape, generator=gen(80))
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)

    def sparse(q, k, v):
        return sparse_attention(q, k, v, case.qg, case.kg, case.window, key_padding_mask=case.kpm)

    def dense(q, k, v):
        return dense_attention(q, k, v, mask)[0]

    got = _grads(sparse, (case.q, case.k, case.v), cot)
    low = _grads(dense, (case.q, case.k, case.v), cot)
    exact = _grads(dense, (case.q.float(), case.k.float(), case.v.float()), cot)
    for name, g, lo, ex in zip("qkv", got, low, exact, strict=True):
        assert g.dtype == half_dtype and torch.isfinite(g).all(), f"d{name} NaN/inf"
        bound = low_precision_bound(max_err(lo, ex), ex, half_dtype)
        assert max_err(g, ex) <= bound, f"d{name}: {max_err(g, ex):.3g} > {bound:.3g}"


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_slots_with_extreme_values_change_nothing(side, half_dtype, backend):
    """Masks are combined with boolean logic: padded keys whose logits would overwhelm any
    large-negative additive mask (and values near the dtype's max) change nothing."""
    case = _padded_case(side, half_dtype)
    big = torch.finfo(half_dtype).max / 4
    pad = ~case.kpm[:, None, :, None].expand_as(case.k)
    k2 = case.k.masked_fill(pad, 0.0) + pad * (case.q.mean(dim=(1, 2), keepdim=True) * 50)
    k2 = k2.to(half_dtype)
    v2 = case.v.masked_fill(pad, big)
    other = Case(case.q, k2, v2, case.qg, case.kg, case.window, case.kpm)
    a, b = case.sparse(backend), other.sparse(backend)
    assert torch.isfinite(b).all()
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
# NaN inputs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("where", ["query", "key"])
def test_nan_inputs_are_propagated_not_hidden(backend, where, return_lse):
    """A NaN in a query or a visible key makes the outputs that depend on it NaN, as in
    dense attention (a kernel must not drop it from the softmax). cpu_fused and math make
    exactly those NaN; cpu_flash, and masked when it runs SDPA (no log-sum-exp asked for),
    may also spread a key's NaN to rows of the same stock kernel call that do not see it
    (NaN logits plus a -inf float mask stay NaN), as dense SDPA under a mask does: never
    fewer NaN than the oracle."""
    case = make_case(nk=90, heads=2, kv_heads=1, groups=4, top_k=2, window=6, seed=12)
    if where == "query":
        case.q[0, 0, 40] = math.nan
    else:
        case.k[0, 0, 40] = math.nan
    out = case.sparse(backend, return_lse=True)[0] if return_lse else case.sparse(backend)
    ref, _ = dense_attention(case.q, case.k, case.v, case.mask())
    nan = torch.isnan(ref)
    assert nan.any() and not nan.all()
    got = torch.isnan(out)
    assert not (nan & ~got).any(), "a NaN input vanished from an output that depends on it"
    stock_kernel = backend == "cpu_flash" or (backend == "masked" and not return_lse)
    if not stock_kernel:
        assert torch.equal(got, nan)
    keep = ~got
    torch.testing.assert_close(out[keep], ref[keep].to(out.dtype), **tolerance("oracle"))


@pytest.mark.parametrize("nq", [1, 3, 40])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
def test_masked_takes_sdpa_outputs_of_any_layout(monkeypatch, nq, heads, kv_heads):
    """CUDA's memory-efficient SDPA kernel returns ``[B, H, N, D]`` as a transposed view of
    ``[B, N, H, D]`` memory: the masked backend's SDPA path must give the same result from
    it (simulated here with the CPU kernel's values in that layout)."""
    real = torch.nn.functional.scaled_dot_product_attention

    def transposed_layout(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    case = make_case(nk=90, nq=nq, batch=2, heads=heads, kv_heads=kv_heads, top_k=2,
                     padding="left", seed=nq)  # fmt: skip
    expected = case.sparse("masked")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed_layout)
    got = case.sparse("masked")
    assert torch.equal(got, expected)
    assert_matches_oracle(case, got)
