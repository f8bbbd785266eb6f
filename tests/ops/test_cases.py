"""The op-level cases of ``shared/cases/attention-cases.md`` (C03, C04, C06, C08, C09, C10,
C11, C12, C15), each parametrised over its whole kind and adapted to the ops.

Fixture sizes follow the cases file's "tiny-llama" where they apply: 8 query heads, 2 KV
heads, head_dim 16, window 32, K = 4, top_k = 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from focus_attention.ops import (
    dense_attention,
    dominance,
    focus_mask,
    gated_attention,
    group_scores,
    group_shares,
    sinkhorn,
    sparse_attention,
    topk_memberships,
)

from .helpers import (
    BACKENDS,
    Case,
    assert_matches_oracle,
    gen,
    make_case,
    naive_attention,
    sinkhorn_reference,
)

TINY = dict(heads=8, kv_heads=2, dim=16, groups=4, top_k=1, window=32)


def _local_mask(case: Case) -> torch.Tensor:
    """Causal, windowed, padding-aware mask with no group pairs at all."""
    i = torch.arange(case.nk - case.nq, case.nk)[:, None]
    j = torch.arange(case.nk)[None]
    m = ((j <= i) & (i - j < case.window))[None].expand(case.q.shape[0], -1, -1)
    return m if case.kpm is None else m & case.kpm[:, None, :]


def _math_grads(case: Case, cot: torch.Tensor):
    leaves = [t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v)]
    out = sparse_attention(
        *leaves, case.qg, case.kg, case.window, key_padding_mask=case.kpm, backend="math"
    )
    (out.float() * cot).sum().backward()
    return out, [t.grad for t in leaves]


def _oracle_grads(case: Case, cot: torch.Tensor):
    """Autograd through the oracle (dense_attention under focus_mask) in fp32."""
    leaves = [t.detach().float().requires_grad_(True) for t in (case.q, case.k, case.v)]
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)
    out, _ = dense_attention(*leaves, mask)
    (out * cot).sum().backward()
    return [t.grad for t in leaves]


# --------------------------------------------------------------------------------------
# C03: short and odd lengths
# --------------------------------------------------------------------------------------

C03_LENGTHS = [1, 2, 31, 32, 33, 64, 127, 128, 129, 1000, 1025]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("n", C03_LENGTHS)
def test_c03_short_and_odd_lengths_forward(n, batch):
    case = make_case(nk=n, batch=batch, seed=n, **TINY)
    for backend in BACKENDS:  # one oracle, both backends
        out, lse = case.sparse(backend, return_lse=True)
        assert_matches_oracle(case, out, lse)
        if n <= case.window:  # nothing is distant: exactly dense causal attention
            rep = case.q.shape[1] // case.k.shape[1]
            dense = torch.nn.functional.scaled_dot_product_attention(
                case.q.double(),
                case.k.double().repeat_interleave(rep, 1),
                case.v.double().repeat_interleave(rep, 1),
                is_causal=True,
            )
            assert (out.double() - dense).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "n,batch", [(1, 1), (1, 2), (2, 2), (31, 1), (33, 2), (128, 1), (129, 2), (1025, 1)]
)
def test_c03_short_and_odd_lengths_backward(n, batch):
    case = make_case(nk=n, batch=batch, seed=n + 1, **TINY)
    cot = torch.randn(case.q.shape, generator=gen(n))
    out, grads = _math_grads(case, cot)
    assert_matches_oracle(case, out.detach())
    for name, got, want in zip("qkv", grads, _oracle_grads(case, cot), strict=True):
        assert torch.isfinite(got).all(), f"d{name} not finite at n={n}"
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5, f"d{name} off by {err:.3g} at n={n}"


@pytest.mark.parametrize("n", [5, 129, 300])
def test_c03_window_at_least_length_is_dense(n, backend):
    case = make_case(nk=n, batch=2, seed=n, **{**TINY, "window": n, "top_k": 1})
    out = case.sparse(backend)
    dense = torch.nn.functional.scaled_dot_product_attention(
        case.q, case.k.repeat_interleave(4, 1), case.v.repeat_interleave(4, 1), is_causal=True
    )
    assert (out - dense).abs().max() <= 1e-5


# --------------------------------------------------------------------------------------
# C04: window boundary convention
# --------------------------------------------------------------------------------------


def _c04_case(n: int, window: int, nq: int, membership: str, dtype) -> Case:
    q = torch.zeros(1, 2, nq, 4, dtype=dtype)
    k = torch.zeros(1, 1, n, 4, dtype=dtype)
    v = torch.arange(n, dtype=dtype).view(1, 1, n, 1).expand(1, 1, n, 4).contiguous()
    if membership == "none":  # nobody has a group: the local part only
        kg = torch.zeros(1, n, 3, dtype=torch.bool)
    else:  # "distinct": token i alone in group i, it shares a group with itself only
        kg = torch.eye(n, dtype=torch.bool)[None]
    return Case(q, k, v, kg[:, n - nq :].clone(), kg, window)


C04_SHAPES = [(n, m) for n in (1, 16, 300) for m in ("none", "distinct") if m == "none" or n <= 16]


@pytest.mark.parametrize("backend", ["cpu_flash", "math", "auto"])
@pytest.mark.parametrize("mode", ["prefill", "decode", "chunk"])
@pytest.mark.parametrize("window", [1, 2, 4, 7, 16, 40])
@pytest.mark.parametrize("n,membership", C04_SHAPES)
def test_c04_window_boundary(n, membership, window, mode, backend):
    """q = k = 0 makes the weights uniform and v_j = j, so output_i is the mean of
    max(0, i - window + 1) .. i: the window counts the query itself. "distinct" puts each
    token alone in its own group, so only the local part contributes there too."""
    nq = {"prefill": n, "decode": 1, "chunk": max(1, n // 3)}[mode]
    case = _c04_case(n, window, nq, membership, torch.float32)
    out = case.sparse(backend)
    i = torch.arange(n - nq, n, dtype=torch.float64)
    want = (i + (i - window + 1).clamp(min=0)) / 2
    err = (out.double() - want[None, None, :, None]).abs().max().item()
    assert err <= 1e-5 * max(1, n), f"window {window}: output is not the window mean ({err})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [1, 4, 20])
def test_c04_window_boundary_half(dtype, window, backend):
    n = 16  # every j and every mean is exact in bf16 and fp16
    full = _c04_case(n, window, n, "none", dtype).sparse(backend)
    for i in range(n):
        lo = max(0, i - window + 1)
        assert torch.all(full[0, :, i] == (lo + i) / 2)
        dec = _c04_case(i + 1, window, 1, "none", dtype).sparse(backend)
        assert torch.equal(dec[0, :, 0], full[0, :, i])  # decode equals prefill


# --------------------------------------------------------------------------------------
# C06: empty parts merge without NaN
# --------------------------------------------------------------------------------------


def _c06_case(kind: str, nq_mode: str, padding: str | None, dtype=torch.float32) -> Case:
    """Cases where some part of the split is empty; every one equals local-only attention
    except "query-group-empty", which only needs finite output equal to the oracle."""
    if kind == "short":  # (a) length 20 with window 32: no distant key at all
        n, window = 20, 32
        kg = torch.zeros(1, n, 4, dtype=torch.bool)
        kg[0, torch.arange(n), torch.arange(n) % 4] = True
    elif kind == "runs":  # (b) each group is one run shorter than the window
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


C06_KINDS = ["short", "runs", "no-groups", "query-group-empty"]


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("nq_mode", ["prefill", "decode", "chunk"])
@pytest.mark.parametrize("kind", C06_KINDS)
def test_c06_empty_parts_equal_local_attention(kind, nq_mode, padding, backend):
    case = _c06_case(kind, nq_mode, padding)
    out, lse = case.sparse(backend, return_lse=True)
    assert torch.isfinite(out).all()
    assert not torch.isnan(lse).any() and not (lse == math.inf).any()
    assert_matches_oracle(case, out, lse)
    local, local_lse = naive_attention(case.q, case.k, case.v, _local_mask(case))
    assert (out.double() - local).abs().max() <= 1e-6
    assert torch.equal(torch.isinf(lse), torch.isinf(local_lse))


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("kind", C06_KINDS)
def test_c06_bf16_backward_has_no_nan(kind, padding):
    """(c) bf16 through the math backend, forward and backward: outputs, lse and gradients
    free of NaN/inf (lse is finite or -inf, never NaN or +inf)."""
    case = _c06_case(kind, "prefill", padding, torch.bfloat16)
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


def test_c06_fully_padded_rows_lse_is_minus_inf(backend):
    case = make_case(nk=40, nq=40, batch=2, padding="left", lengths=[0, 10], **TINY)
    out, lse = case.sparse(backend, return_lse=True)
    assert (lse[0] == -math.inf).all() and (out[0] == 0).all()
    assert (lse[1, :, :30] == -math.inf).all() and torch.isfinite(lse[1, :, 30:]).all()
    assert_matches_oracle(case, out, lse)


# --------------------------------------------------------------------------------------
# C08: half precision
# --------------------------------------------------------------------------------------


def _c08_case(side: str, dtype) -> Case:
    case = make_case(
        nk=200, batch=2, padding=side, lengths=[3, 200], seed=8, **{**TINY, "top_k": 2}
    )
    return case.to(dtype) if dtype != torch.float32 else case


def _rel(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> float:
    """max |a - b| / max |b| over the selected query rows ([B, N] bool)."""
    sel = rows[:, None, :, None].expand_as(b)
    return ((a.float() - b.float()).abs()[sel].max() / b.float().abs()[sel].max()).item()


@pytest.mark.parametrize("side", ["left", "right"])
def test_c08_half_precision_forward(side, half_dtype, backend):
    ref = _c08_case(side, torch.float32)
    case = _c08_case(side, half_dtype)
    out, lse = case.sparse(backend, return_lse=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_matches_oracle(case, out, lse)
    real = ref.kpm  # queries are the keys here; a query is real iff its token is
    first = real.float().argmax(dim=1)  # first real token of each sequence
    for b in range(2):
        assert torch.isfinite(out[b, :, first[b]]).all()
        assert torch.isfinite(lse[b, :, first[b]]).all()  # it sees itself at least
    assert _rel(out, ref.sparse(backend), real) <= 2e-2


@pytest.mark.parametrize("side", ["left", "right"])
def test_c08_half_precision_backward(side, half_dtype):
    ref = _c08_case(side, torch.float32)
    case = _c08_case(side, half_dtype)
    cot = torch.randn(case.q.shape, generator=gen(80))
    _, grads = _math_grads(case, cot)
    _, ref_grads = _math_grads(ref, cot)
    real = ref.kpm  # prefill: query t and key t are the same token, real or padding
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert torch.isfinite(got).all(), f"d{name} NaN/inf in {half_dtype}"
        sel = real[:, None, :, None].expand_as(want)
        rel = ((got.float() - want).abs()[sel].max() / want.abs()[sel].max()).item()
        assert rel <= 2e-2, f"d{name} {half_dtype} vs fp32 relative error {rel:.3g}"


@pytest.mark.parametrize("side", ["left", "right"])
def test_c08_padding_slots_with_extreme_values_change_nothing(side, half_dtype, backend):
    """Masks are combined with boolean logic: padded keys whose logits would overwhelm any
    large-negative additive mask (and values near the dtype's max) change nothing."""
    case = _c08_case(side, half_dtype)
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
# C09: Sinkhorn stability
# --------------------------------------------------------------------------------------


def _c09_scores(source: str, tau: float, dtype, seed: int) -> torch.Tensor:
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
def test_c09_sinkhorn_stability(source, tau, n_iter, dtype):
    x = _c09_scores(source, tau, dtype, seed=int(tau * 1000) + n_iter)
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
def test_c09_sinkhorn_balances_after_enough_iterations(source, tau, dtype):
    """Each group's mass reaches N/K within 1e-2 (over the real tokens), given enough
    iterations for these very peaked scores (300; 10 suffice for standard-normal scores,
    see test_sinkhorn)."""
    x = _c09_scores(source, tau, dtype, seed=9)
    pad = torch.ones(2, 120, dtype=torch.bool)
    pad[1, :30] = False
    p = sinkhorn(x, 300, padding_mask=pad)
    for b in range(2):
        n_real = int(pad[b].sum())
        mass = p[b].sum(0)
        assert (mass - n_real / 4).abs().max() <= 1e-2, (b, mass.tolist())


def test_c09_scaled_centroid_does_not_change_cosine_scores():
    g = gen(90)
    hidden, proj, cents = torch.randn(1, 30, 32, generator=g), torch.randn(32, 16), None
    cents = torch.randn(4, 16, generator=g)
    scaled = cents.clone()
    scaled[1] *= 1e4
    a = group_scores(hidden, proj, cents, 0.01)
    b = group_scores(hidden, proj, scaled, 0.01)
    assert torch.isfinite(b).all()
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-5)


# --------------------------------------------------------------------------------------
# C10: empty and identical groups
# --------------------------------------------------------------------------------------


def _c10_router(kind: str):
    g = gen(10)
    d_model, d_g, k = 32, 16, 16
    proj = torch.randn(d_model, d_g, generator=g) / d_model**0.5
    base = torch.randn(1, 1, d_model, generator=g)
    hidden = base + 0.05 * torch.randn(2, 60, d_model, generator=g)  # one tight cluster
    direction = torch.nn.functional.normalize((base @ proj)[0, 0], dim=0)
    if kind == "far":  # centroid 0 on the cluster, 15 centroids pointing away from it
        cents = -direction.repeat(k, 1) + 0.1 * torch.randn(k, d_g, generator=g)
        cents[0] = direction
    elif kind == "identical":
        cents = torch.randn(1, d_g, generator=g).repeat(k, 1)
    else:  # "zero": centroids never initialised
        cents = torch.zeros(k, d_g)
    return hidden, proj.requires_grad_(True), cents.requires_grad_(True)


@pytest.mark.parametrize("gate", ["paper", "log"])
@pytest.mark.parametrize("kind", ["far", "identical", "zero"])
def test_c10_training_step_with_empty_or_identical_groups(kind, gate):
    hidden, proj, cents = _c10_router(kind)
    scores = group_scores(hidden, proj, cents, 0.1)
    pad = torch.ones(2, 60, dtype=torch.bool)
    pad[1, :7] = False
    probs = sinkhorn(scores, 10, padding_mask=pad)
    g = gen(11)
    q = torch.randn(2, 4, 60, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 60, 16, generator=g)
    v = torch.randn(2, 2, 60, 16, generator=g)
    out = gated_attention(q, k, v, probs, probs, 8, gate=gate, key_padding_mask=pad)
    assert torch.isfinite(out).all()
    out.pow(2).mean().backward()
    for name, t in (("proj", proj), ("centroids", cents), ("query", q)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), f"{name} grad not finite"
    # the unused centroids (every centroid but 0 in "far") still get finite gradients
    assert torch.isfinite(cents.grad[1:]).all()
    # Sinkhorn still spreads the mass over all 16 groups (that is what it is for)
    shares = group_shares(sinkhorn(scores.detach(), 300))
    assert (shares - 1 / 16).abs().max() <= 1e-2
    if kind in ("identical", "zero"):  # identical rows: the uniform distribution exactly
        want = torch.full_like(probs, 1 / 16).masked_fill(~pad[..., None], 0.0)
        torch.testing.assert_close(probs, want, atol=1e-6, rtol=0)  # padding rows are zero


@pytest.mark.parametrize("kind", ["far", "identical", "zero"])
def test_c10_inference_with_empty_or_identical_groups(kind, backend):
    hidden, proj, cents = _c10_router(kind)
    with torch.no_grad():
        scores = group_scores(hidden, proj, cents, 0.1)
    assert torch.isfinite(scores).all()
    groups = topk_memberships(scores, 1)
    # everything lands in group 0: 15 empty groups; ties go to the lowest index
    assert groups[..., 0].all() and dominance(groups) == 1.0
    g = gen(12)
    case = Case(
        torch.randn(2, 4, 60, 16, generator=g),
        torch.randn(2, 2, 60, 16, generator=g),
        torch.randn(2, 2, 60, 16, generator=g),
        groups,
        groups,
        8,
    )
    out, lse = case.sparse(backend, return_lse=True)
    assert_matches_oracle(case, out, lse)
    # one shared group: dense causal attention
    dense = torch.nn.functional.scaled_dot_product_attention(
        case.q, case.k.repeat_interleave(2, 1), case.v.repeat_interleave(2, 1), is_causal=True
    )
    assert (out - dense).abs().max() <= 1e-5


# --------------------------------------------------------------------------------------
# C11: ties in top-k
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("pair", [(0, 1), (1, 3), (2, 5), (4, 5)])
def test_c11_identical_centroids_pick_lowest_index(pair, top_k):
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
def test_c11_token_equidistant_to_two_centroids(k, tied):
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
def test_c11_bf16_model_routes_like_fp32_model(params_dtype):
    """Routing is computed in fp32: for a bf16 model the scores (and groups) equal those of
    the fp32 model run on the same values, even where scores are ~1e-4 apart."""
    g = gen(111)
    hidden = torch.randn(2, 200, 64, generator=g).to(torch.bfloat16)
    proj = torch.randn(64, 16, generator=g).to(params_dtype)
    cents = torch.randn(8, 16, generator=g).to(params_dtype)
    s16 = group_scores(hidden, proj, cents, 0.1)
    s32 = group_scores(hidden.float(), proj.float(), cents.float(), 0.1)
    assert s16.dtype == torch.float32
    torch.testing.assert_close(s16, s32, atol=1e-5, rtol=1e-6)
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


# --------------------------------------------------------------------------------------
# C12: grouped-query heads
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_c12_zeroed_kv_head_zeroes_only_its_query_heads(kv_heads, mode, backend):
    heads = 8
    rep = heads // kv_heads
    nq = 100 if mode == "prefill" else 1
    for zeroed in range(kv_heads):
        case = make_case(
            nk=100, nq=nq, batch=2, padding="left", seed=zeroed, **{**TINY, "kv_heads": kv_heads}
        )
        case.v[:, zeroed] = 0
        out = case.sparse(backend)
        real_rows = case.mask().any(-1)  # [B, Nq]: queries that see at least one key
        for h in range(heads):
            head = out[:, h][real_rows]
            if h // rep == zeroed:
                assert (head == 0).all(), f"head {h} should be zero (kv head {zeroed})"
            else:
                assert (head.abs().sum(-1) > 0).all(), f"head {h} zeroed by kv head {zeroed}"
        if zeroed == 0:
            assert_matches_oracle(case, out)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_c12_k1_equals_dense(kv_heads, backend):
    case = make_case(nk=200, batch=2, seed=12, **{**TINY, "kv_heads": kv_heads, "groups": 1})
    out = case.sparse(backend)
    rep = 8 // kv_heads
    dense = torch.nn.functional.scaled_dot_product_attention(
        case.q, case.k.repeat_interleave(rep, 1), case.v.repeat_interleave(rep, 1), is_causal=True
    )
    assert (out - dense).abs().max() <= 1e-5


# --------------------------------------------------------------------------------------
# C15: mask/shape reuse
# --------------------------------------------------------------------------------------


def test_c15_lengths_in_sequence_equal_fresh_runs(backend):
    """Run at 1025, then 200 (and then a tour of other lengths): each result equals a fresh
    run of that length and the oracle: nothing is cached across calls."""
    lengths = [1025, 200, 1, 33, 257, 200, 1025, 129]
    cases = {n: make_case(nk=n, seed=n, **TINY) for n in set(lengths)}
    fresh = {}
    for n in sorted(set(lengths)):  # a different order from the tour below
        fresh[n] = cases[n].sparse(backend)
    for n in lengths:
        again = cases[n].sparse(backend)
        assert torch.equal(again, fresh[n]), f"length {n} changed after other lengths"
    for n in (1025, 200):
        assert_matches_oracle(cases[n], fresh[n])


def test_c15_same_shape_new_memberships_not_reused(backend):
    a = make_case(nk=200, seed=1, **TINY)
    b = make_case(nk=200, seed=2, **TINY)
    b.q, b.k, b.v = a.q, a.k, a.v  # same tensors, only the routing differs
    assert not torch.equal(a.kg, b.kg)
    out_a = a.sparse(backend)
    out_b = b.sparse(backend)
    assert_matches_oracle(a, out_a)
    assert_matches_oracle(b, out_b)
    assert (out_a - out_b).abs().max() > 1e-3
