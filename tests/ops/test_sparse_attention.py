"""Exactness of ``sparse_attention`` against the dense oracle on every backend: grids and
properties over the input space, lengths and windows, grouped-query heads, causality,
gradients, block edges (docs/method.md §4-§5). Numerics are in test_sparse_numerics.py,
backend choice in test_sparse_backends.py."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops import dense_attention, focus_mask, sparse_attention
from focus_attention.ops.sparse import cpu_fused
from focus_attention.ops.sparse.dispatch import BackendUnavailable
from focus_attention.ops.sparse.triton_support import MAX_KERNEL_GROUPS

from .helpers import (
    BACKENDS,
    HYP,
    HYP_SMALL,
    TINY_BLOCKS,
    Case,
    assert_matches_oracle,
    block_lengths,
    block_modules,
    brute_mask,
    case_params,
    gen,
    make_case,
    naive_attention,
)


def _grid() -> list:
    base = dict(batch=2, heads=4, kv_heads=2, groups=4, top_k=1, window=8)
    rows: list = []

    def add(name: str, **kw) -> None:
        rows.append(pytest.param({**base, **kw}, id=name))

    for n in [1, 2, 31, 33, *block_lengths()]:
        add(f"prefill-n{n}", nk=n, seed=n)
    for nk in [1, 5, 257, 300]:
        add(f"decode-nk{nk}", nk=nk, nq=1, seed=nk)
    for nq, nk in [(2, 3), (7, 300), (100, 300), (255, 513), (300, 301)]:
        add(f"chunk-{nq}of{nk}", nq=nq, nk=nk, seed=nq)
    for top_k in [1, 2, 3, 4]:
        add(f"topk{top_k}of4", nk=150, top_k=top_k, seed=top_k)
    add("K1", nk=150, groups=1)
    add("K1-decode", nk=150, nq=1, groups=1)
    add("K8-topk8", nk=100, groups=8, top_k=8)
    for w in [1, 2, 149, 150, 151, 1000]:
        add(f"window{w}", nk=150, window=w, top_k=2, seed=w)
    add("window1-decode", nk=150, nq=1, window=1)
    for pad in ["left", "right", "random"]:
        add(f"pad-{pad}", nk=200, padding=pad)
        add(f"pad-{pad}-decode", nk=200, nq=1, padding=pad)
        add(f"pad-{pad}-chunk", nk=200, nq=37, padding=pad)
    add("pad-all-but-one", nk=40, padding="left", lengths=[1, 0])
    add("pad-everything", nk=40, padding="right", lengths=[0, 0])
    add("random-memberships", nk=150, membership="random", groups=5)
    add("no-memberships", nk=150, membership="none")
    add("empty-groups", nk=150, groups=6, top_k=2, used_groups=2)
    add("one-used-group", nk=150, groups=6, used_groups=1)
    add("independent-queries", nk=150, query_membership="independent", top_k=2)
    add("independent-chunk", nk=150, nq=60, query_membership="independent", top_k=2)
    add("independent-random", nk=120, nq=90, membership="random", query_membership="independent")
    # asymmetric top-k: queries in more (or fewer) groups than keys, as query_top_k routes
    add("query-wider", nk=150, top_k=1, query_membership="wider")
    add("query-wider-decode", nk=300, nq=1, top_k=1, query_membership="wider", seed=3)
    add("query-wider-chunk-pad", nk=200, nq=37, top_k=2, query_membership="wider", padding="left")
    add("query-narrower", nk=150, top_k=2, query_membership="narrower")
    add("query-narrower-decode", nk=300, nq=1, top_k=3, query_membership="narrower", seed=4)
    # many distinct membership sets (C(K, top_k) large): the class-per-membership-set split
    # gives way to a per-group split above some class count; cover both sides of it
    add("many-classes-K10-top3", nk=400, groups=10, top_k=3, window=16)
    add("many-classes-K12-top6-chunk", nk=300, nq=120, groups=12, top_k=6, window=4)
    add("many-classes-random-pad", nk=300, groups=9, membership="random", padding="random")
    add("many-classes-indep", nk=300, nq=200, groups=9, top_k=4, query_membership="independent")
    # keys in one group, queries in four (the query-key layout): the fused kernel runs its
    # group part by single group, each query's groups merged by log-sum-exp
    add("query-widest", nk=300, groups=12, top_k=1, query_membership="widest", window=6)
    add("query-widest-chunk-pad", nk=260, nq=97, groups=12, top_k=1, query_membership="widest",
        padding="random", batch=2)  # fmt: skip
    add("query-widest-empty-groups", nk=200, groups=16, top_k=1, used_groups=5,
        query_membership="widest", heads=6, kv_heads=2)  # fmt: skip
    # ... with sink keys in every group (the caches' layout): by single group, the sinks as
    # one more group that every query with a group sees
    add("query-widest-sinks", nk=300, groups=12, top_k=1, query_membership="widest", sinks=7)
    add("query-widest-sinks-chunk-pad", nk=230, nq=71, groups=12, top_k=1, sinks=40,
        query_membership="widest", padding="random", batch=2, heads=6, kv_heads=2)  # fmt: skip
    add("mqa", nk=130, heads=4, kv_heads=1)
    add("mha", nk=130, heads=3, kv_heads=3)
    add("dim1", nk=70, dim=1)
    add("dim64", nk=70, dim=64)
    add("dim80", nk=70, dim=80)
    add("dim128", nk=70, dim=128)
    return rows


GRID = _grid()


def _result(case: Case, backend: str, return_lse: bool):
    """``(out, lse)`` of ``case`` on ``backend``; ``lse`` None when not asked for (a backend
    may then take another path: ``masked`` runs SDPA)."""
    if return_lse:
        return case.sparse(backend, return_lse=True)
    return case.sparse(backend), None


#: every exactness test runs with and without the log-sum-exp asked for
WITH_LSE = pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "out"])


@WITH_LSE
@pytest.mark.parametrize("params", GRID)
def test_grid_fp32_equals_oracle(params, backend, return_lse):
    case = make_case(**params)
    assert_matches_oracle(case, *_result(case, backend, return_lse))


HALF_GRID = [
    pytest.param(dict(nk=200, heads=4, kv_heads=2, window=16, top_k=1), id="prefill"),
    pytest.param(dict(nk=300, nq=1, heads=4, kv_heads=2, window=16, top_k=2), id="decode"),
    pytest.param(dict(nk=300, nq=45, groups=6, top_k=3, window=5), id="chunk"),
    pytest.param(dict(nk=257, batch=2, padding="left", window=32), id="pad-left"),
    pytest.param(dict(nk=120, batch=2, padding="random", membership="random"), id="pad-random"),
    pytest.param(dict(nk=1), id="n1"),
    pytest.param(dict(nk=200, top_k=1, query_membership="wider"), id="query-wider"),
    pytest.param(dict(nk=200, groups=12, top_k=1, query_membership="widest"), id="query-widest"),
    pytest.param(
        dict(nk=200, groups=12, top_k=1, query_membership="widest", sinks=5),
        id="query-widest-sinks",
    ),
]


@WITH_LSE
@pytest.mark.parametrize("params", HALF_GRID)
def test_grid_half_within_twice_dense_error(params, backend, half_dtype, return_lse):
    case = make_case(**params, dtype=half_dtype)
    assert_matches_oracle(case, *_result(case, backend, return_lse))


@WITH_LSE
@given(params=case_params())
@HYP
def test_property_fp32_equals_oracle(backend, params, return_lse):
    case = make_case(**params)
    assert_matches_oracle(case, *_result(case, backend, return_lse))


@WITH_LSE
@given(params=case_params(max_nk=48, long_nk=160), dtype=st.sampled_from(["bf16", "fp16"]))
@HYP
def test_property_half_within_twice_dense_error(backend, params, dtype, return_lse):
    case = make_case(**params, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
    assert_matches_oracle(case, *_result(case, backend, return_lse))


def test_auto_backend_matches_explicit_backends(fused_kernel):
    case = make_case(nk=200, nq=50, batch=2, heads=4, kv_heads=2, top_k=2, padding="left")
    auto = case.sparse("auto")
    for backend in BACKENDS:
        torch.testing.assert_close(auto, case.sparse(backend), **tolerance("oracle"))
    assert_matches_oracle(case, auto)


def test_scale_argument_is_used(backend):
    case = make_case(nk=90, top_k=2, window=4, seed=3)
    scale = 0.37
    out = sparse_attention(
        case.q, case.k, case.v, case.qg, case.kg, case.window, scale=scale, backend=backend
    )
    ref, _ = naive_attention(case.q, case.k, case.v, case.mask(), scale=scale)
    assert (out.double() - ref).abs().max() <= 1e-5
    # the default scale is D ** -0.5, so an explicit D ** -0.5 must give the same result
    dflt = case.sparse(backend)
    explicit = case.sparse(backend, scale=case.q.shape[-1] ** -0.5)
    torch.testing.assert_close(dflt, explicit, **tolerance("rounding"))


def test_softcap_math_backend_equals_oracle(kernel_built):
    case = make_case(nk=120, nq=40, heads=4, kv_heads=2, top_k=2, padding="right", seed=5)
    case.q = case.q * 4  # large logits so the cap matters
    out = case.sparse("math", softcap=2.0)
    ref, _ = naive_attention(case.q, case.k, case.v, case.mask(), softcap=2.0)
    assert (out.double() - ref).abs().max() <= 1e-5
    uncapped, _ = naive_attention(case.q, case.k, case.v, case.mask())
    assert (uncapped - ref).abs().max() > 1e-2  # the cap changed something
    auto = case.sparse("auto", softcap=2.0)  # auto must route softcap to a capable path
    assert (auto.double() - ref).abs().max() <= 1e-5


def test_oracle_helpers_agree_with_package_oracle():
    """The oracle (dense_attention + focus_mask) and the naive float64 one
    written here agree, so the exactness tests rest on two independent references."""
    case = make_case(nk=80, nq=30, batch=2, heads=4, kv_heads=2, top_k=2, padding="random")
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)
    assert torch.equal(mask, case.mask())
    pkg, pkg_lse = dense_attention(case.q.double(), case.k.double(), case.v.double(), mask)
    mine, mine_lse = naive_attention(case.q, case.k, case.v, mask)
    # dense_attention takes its softmax in fp32 even for float64 inputs: fp32-level agreement
    torch.testing.assert_close(pkg, mine, **tolerance("rounding"))
    torch.testing.assert_close(pkg_lse.double(), mine_lse, **tolerance("oracle"))


def test_dense_attention_float64_is_float64_accurate():
    case = make_case(nk=40, nq=40, top_k=2)
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)
    pkg, _ = dense_attention(case.q.double(), case.k.double(), case.v.double(), mask)
    mine, _ = naive_attention(case.q, case.k, case.v, mask)
    assert (pkg - mine).abs().max().item() <= 1e-12


# --------------------------------------------------------------------------------------
# causality
# --------------------------------------------------------------------------------------


def _perturb_future(case, cut: int, seed: int, memberships: bool):
    """Copy of ``case`` with every key/value at absolute position >= ``cut`` replaced (and
    optionally their memberships, padding and the later queries' memberships)."""
    g = torch.Generator().manual_seed(seed)
    k, v = case.k.clone(), case.v.clone()
    k[:, :, cut:] = torch.randn(k[:, :, cut:].shape, generator=g) * 3
    v[:, :, cut:] = torch.randn(v[:, :, cut:].shape, generator=g) * 3
    qg, kg = case.qg.clone(), case.kg.clone()
    kpm = None if case.kpm is None else case.kpm.clone()
    if memberships:
        kg[:, cut:] = torch.rand(kg[:, cut:].shape, generator=g) < 0.5
        offset = case.nk - case.nq
        first = max(0, cut - offset)
        qg[:, first:] = torch.rand(qg[:, first:].shape, generator=g) < 0.5
        if kpm is not None:
            kpm[:, cut:] = torch.rand(kpm[:, cut:].shape, generator=g) < 0.5
    return type(case)(case.q, k, v, qg, kg, case.window, kpm)


@pytest.mark.parametrize("memberships", [False, True], ids=["kv", "kv+groups+padding"])
@given(params=case_params(max_nk=64, long_nk=160), cut_frac=st.floats(0.0, 1.0))
@HYP_SMALL
def test_future_keys_never_change_earlier_outputs(backend, memberships, params, cut_frac):
    case = make_case(**params)
    offset = case.nk - case.nq
    cut = min(case.nk - 1, int(cut_frac * case.nk))  # first perturbed absolute position
    earlier = cut - offset  # queries at absolute positions < cut are earlier
    if earlier <= 0:
        earlier = 0
    other = _perturb_future(case, cut, params["seed"] + 1, memberships)
    a, b = case.sparse(backend), other.sparse(backend)
    diff = (a[:, :, :earlier] - b[:, :, :earlier]).abs().max().item() if earlier else 0.0
    assert diff <= 1e-6, f"output before position {cut} changed by {diff:.3g}"


def test_causality_check_detects_a_leak():
    """The causality test's comparison would notice a future leak: without the causal
    constraint (window over the future) the same perturbation changes earlier rows."""
    case = make_case(nk=64, window=4, seed=2)
    other = _perturb_future(case, 32, 9, memberships=False)
    full = torch.ones(1, 64, 64, dtype=torch.bool)
    a, _ = dense_attention(case.q, case.k, case.v, full)
    b, _ = dense_attention(other.q, other.k, other.v, full)
    assert (a[:, :, :32] - b[:, :, :32]).abs().max() > 1e-3


# --------------------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------------------

GRAD_CASES = [
    pytest.param(dict(nk=70, heads=4, kv_heads=2, top_k=2, window=6), id="prefill-gqa"),
    pytest.param(dict(nk=70, nq=1, top_k=1, window=6), id="decode"),
    pytest.param(dict(nk=70, nq=23, groups=5, top_k=3, window=3), id="chunk"),
    pytest.param(dict(nk=60, batch=2, padding="left", window=5), id="pad-left"),
    pytest.param(dict(nk=60, batch=2, padding="random", membership="random"), id="pad-random"),
    pytest.param(dict(nk=60, membership="none", window=2), id="local-only"),
    pytest.param(
        dict(nk=60, nq=30, query_membership="independent", membership="random"), id="indep"
    ),
    pytest.param(dict(nk=300, heads=2, kv_heads=1, window=16), id="long-mqa"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("params", GRAD_CASES)
def test_math_backend_gradients_match_oracle(params, dtype):
    case = make_case(**params)
    tensors = [t.to(dtype) for t in (case.q, case.k, case.v)]
    cot = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        out = fn(*leaves)
        assert torch.isfinite(out).all()
        return torch.autograd.grad((out * cot).sum(), leaves)

    got = grads(
        lambda q, k, v: sparse_attention(
            q, k, v, case.qg, case.kg, case.window, key_padding_mask=case.kpm, backend="math"
        )
    )
    want = grads(lambda q, k, v: dense_attention(q, k, v, mask)[0])
    # dense_attention's softmax runs in fp32 even for float64 inputs, so against it the
    # float64 gradients agree to fp32 level; the float64 check is against naive_attention.
    for name, a, b in zip("qkv", got, want, strict=True):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        err = (a - b).abs().max().item()
        assert err <= 1e-4, f"d{name} differs from the oracle by {err:.3g}"
    if dtype == torch.float64:
        exact = grads(lambda q, k, v: naive_attention(q, k, v, mask)[0])
        for name, a, b in zip("qkv", got, exact, strict=True):
            err = (a - b).abs().max().item()
            assert err <= 1e-10, f"d{name} differs from the float64 reference by {err:.3g}"
    if case.kpm is not None:  # padded keys/values get exactly zero gradient
        pad = ~case.kpm[:, None, :, None].expand_as(got[1])
        assert (got[1][pad] == 0).all() and (got[2][pad] == 0).all()


@pytest.mark.parametrize("backend", ["cpu_fused", "cpu_flash"])
def test_cpu_backends_never_return_wrong_gradients(backend):
    case = make_case(nk=60, top_k=2, window=4, seed=6)
    q = case.q.clone().requires_grad_(True)
    try:
        out = sparse_attention(q, case.k, case.v, case.qg, case.kg, case.window, backend=backend)
    except ValueError as err:  # refusing is an acceptable answer
        assert "backend" in str(err)
        return
    if out.grad_fn is None:  # detached output: no silent gradient either
        return
    out.pow(2).sum().backward()
    q2 = case.q.clone().requires_grad_(True)
    ref, _ = dense_attention(q2, case.k, case.v, case.mask())
    ref.pow(2).sum().backward()
    err = (q.grad - q2.grad).abs().max().item()
    assert err <= 1e-4, f"{backend} gradient differs from the oracle by {err:.3g}"


def test_auto_backend_is_differentiable():
    case = make_case(nk=50, top_k=2)
    q = case.q.clone().requires_grad_(True)
    out = sparse_attention(q, case.k, case.v, case.qg, case.kg, case.window)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


# --------------------------------------------------------------------------------------
# long sequence, checked on a random subset of rows only
# --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "math"])
def test_long_sequence_matches_blockwise_oracle(backend, kernel_built):
    n, window = 8192, 64
    g = torch.Generator().manual_seed(8192)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    order = torch.rand(1, n, 8, generator=g).argsort(-1)[..., :1]
    groups = torch.zeros(1, n, 8, dtype=torch.bool).scatter_(-1, order, True)
    out = sparse_attention(q, k, v, groups, groups, window, backend=backend)
    assert out.shape == q.shape and torch.isfinite(out).all()
    rows = torch.randperm(n, generator=g)[:64].tolist() + [0, 1, window, n - 1]
    kd, vd = k.double(), v.double()
    worst = 0.0
    for i in rows:  # one query row at a time: an O(N) oracle per row
        mask = focus_mask(groups[:, i : i + 1], groups[:, : i + 1], window)
        mine = brute_mask(groups[:, i : i + 1], groups[:, : i + 1], window)
        assert torch.equal(mask, mine)
        ref, _ = dense_attention(
            q[:, :, i : i + 1].double(), kd[:, :, : i + 1], vd[:, :, : i + 1], mask
        )
        worst = max(worst, (out[:, :, i : i + 1].double() - ref).abs().max().item())
    assert worst <= 1e-5, f"max abs error {worst:.3g} on sampled rows"
    assert math.isfinite(worst)


@pytest.mark.parametrize("mode", ["prefill", "chunk", "decode"])
def test_non_contiguous_inputs(mode, backend):
    """Model code hands over transposed views ([B, N, H, D] storage) and sliced masks."""
    nk = 150
    nq = {"prefill": nk, "chunk": 40, "decode": 1}[mode]
    case = make_case(nk=nk, nq=nq, batch=2, heads=4, kv_heads=2, top_k=2, padding="left")
    q = case.q.transpose(1, 2).contiguous().transpose(1, 2)
    k = case.k.transpose(1, 2).contiguous().transpose(1, 2)
    v = case.v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous() or nq == 1
    wide = torch.zeros(2, nk, 7, dtype=torch.bool)
    wide[..., 1:5] = case.kg  # the memberships as a strided slice of a wider tensor
    kg = wide[..., 1:5]
    qg = kg[:, nk - nq :] if torch.equal(case.qg, case.kg[:, nk - nq :]) else case.qg
    kpm = torch.stack([case.kpm, case.kpm], dim=-1)[..., 0]
    out = sparse_attention(q, k, v, qg, kg, case.window, key_padding_mask=kpm, backend=backend)
    assert_matches_oracle(case, out)


@pytest.mark.parametrize("mode", ["prefill", "chunk", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_values_as_prefix_views_of_a_cache_buffer(mode, dtype, backend):
    """A KV cache that appends into a preallocated buffer hands over ``buffer[:, :, :Nk]``:
    rows contiguous along Nk, batch and head strides of the whole buffer. The spare rows
    hold NaN, so reading past Nk would show."""
    nk = 150
    nq = {"prefill": nk, "chunk": 40, "decode": 1}[mode]
    case = make_case(nk=nk, nq=nq, batch=2, heads=6, kv_heads=3, top_k=2, padding="left")
    case = case.to(dtype) if dtype != torch.float32 else case
    k_buf, v_buf = (torch.full((2, 3, nk + 37, 16), math.nan, dtype=dtype) for _ in range(2))
    k_buf[:, :, :nk], v_buf[:, :, :nk] = case.k, case.v
    k, v = k_buf[:, :, :nk], v_buf[:, :, :nk]
    assert not k.is_contiguous()
    out = sparse_attention(case.q, k, v, case.qg, case.kg, case.window,
                           key_padding_mask=case.kpm, backend=backend)  # fmt: skip
    torch.testing.assert_close(out, case.sparse(backend), **tolerance("bitwise"))
    if dtype == torch.float32:
        assert_matches_oracle(case, out)


def test_the_fused_kernel_reads_a_cache_buffer_without_copying_it():
    buf = torch.randn(2, 3, 80, 16)
    rows = buf[:, :, :50]
    assert cpu_fused.rows_contiguous(rows) is rows
    transposed = torch.randn(2, 50, 3, 16).transpose(1, 2)  # stride along N is H * D
    copied = cpu_fused.rows_contiguous(transposed)
    assert copied.is_contiguous() and torch.equal(copied, transposed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "math", "gather", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@WITH_LSE
def test_cuda_inputs_equal_oracle(dtype, backend, return_lse):
    """On a GPU the result stays on the device and meets the same accuracy rule."""
    case = make_case(nk=300, nq=120, batch=2, heads=4, kv_heads=2, top_k=2, padding="left")
    case = case.to(dtype)
    out, lse = _result(case.cuda(), backend, return_lse)
    assert out.device.type == "cuda"
    assert_matches_oracle(case, out.cpu(), None if lse is None else lse.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "gather", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@WITH_LSE
def test_cuda_decoding_calls_equal_oracle(dtype, backend, return_lse):
    """Decoding-sized calls (one and three queries against a left-padded cache) on a GPU, on
    the backends meant for them."""
    for nq in (1, 3):
        case = make_case(nk=700, nq=nq, batch=2, heads=4, kv_heads=2, top_k=1, padding="left")
        case = case.to(dtype)
        out, lse = _result(case.cuda(), backend, return_lse)
        assert_matches_oracle(case, out.cpu(), None if lse is None else lse.cpu())


# --------------------------------------------------------------------------------------
# block edges: every block constant shrunk
# --------------------------------------------------------------------------------------


TINY_GRID = [
    p
    for p in GRID
    if p.id.startswith(("prefill-n3", "chunk", "decode-nk257", "topk", "pad-", "many", "indep"))
    or p.id in {"window1-decode", "random-memberships", "empty-groups", "no-memberships"}
]


@pytest.mark.parametrize("params", TINY_GRID)
def test_grid_with_tiny_blocks_equals_oracle(params, backend, tiny_blocks):
    case = make_case(**params)
    out, lse = case.sparse(backend, return_lse=True)
    assert_matches_oracle(case, out, lse)


@pytest.mark.parametrize("max_classes", [1, 3])
def test_few_classes_fallback_with_tiny_blocks(max_classes, backend, tiny_blocks, monkeypatch):
    """The per-group fallback (more classes than MAX_CLASSES) across many blocks/chunks."""
    from focus_attention.ops.sparse import decomposition

    monkeypatch.setattr(decomposition, "MAX_CLASSES", max_classes)
    case = make_case(nk=90, nq=70, groups=5, top_k=2, window=6, padding="random", seed=5)
    out, lse = case.sparse(backend, return_lse=True)
    assert_matches_oracle(case, out, lse)


@given(params=case_params(max_nk=60, long_nk=120))
@HYP_SMALL
def test_property_with_tiny_blocks_equals_oracle(params, backend):
    owners = {name: m for m in block_modules() for name in TINY_BLOCKS if hasattr(m, name)}
    saved = {name: getattr(owners[name], name) for name in TINY_BLOCKS}
    try:
        for name, value in TINY_BLOCKS.items():
            setattr(owners[name], name, value)
        case = make_case(**params)
        out, lse = case.sparse(backend, return_lse=True)
        assert_matches_oracle(case, out, lse)
    finally:
        for name, value in saved.items():
            setattr(owners[name], name, value)


def test_a_huge_window_means_every_causal_pair_is_local(backend):
    """A window beyond Nk (up to 2**63, past int64 arithmetic) equals window = Nk."""
    case = make_case(nk=50, nq=30, groups=4, top_k=1, padding="random", seed=13)
    ref = sparse_attention(
        case.q, case.k, case.v, case.qg, case.kg, 50, key_padding_mask=case.kpm, backend=backend
    )
    for window in (51, 10**6, 2**63 - 1, 2**63, 2**80):
        out = sparse_attention(
            case.q,
            case.k,
            case.v,
            case.qg,
            case.kg,
            window,
            key_padding_mask=case.kpm,
            backend=backend,
        )
        torch.testing.assert_close(out, ref, **tolerance("bitwise"))
    mask = focus_mask(case.qg, case.kg, 2**80, case.kpm)
    assert torch.equal(mask, focus_mask(case.qg, case.kg, 50, case.kpm))


# --------------------------------------------------------------------------------------
# lengths and windows (shapes of a small Llama: 8 query heads, 2 KV heads, head_dim 16,
# window 32, K = 4, top_k = 1)
# --------------------------------------------------------------------------------------

TINY = dict(heads=8, kv_heads=2, dim=16, groups=4, top_k=1, window=32)
ODD_LENGTHS = [1, 2, 31, 32, 33, 64, 127, 128, 129, 1000, 1025]


def _causal_sdpa(case: Case) -> torch.Tensor:
    """Dense causal attention in float64 (GQA expanded): the result when nothing is cut."""
    rep = case.q.shape[1] // case.k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        case.q.double(),
        case.k.double().repeat_interleave(rep, 1),
        case.v.double().repeat_interleave(rep, 1),
        is_causal=True,
    )


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


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("n", ODD_LENGTHS)
def test_short_and_odd_lengths_equal_oracle(n, batch, backend):
    case = make_case(nk=n, batch=batch, seed=n, **TINY)
    out, lse = case.sparse(backend, return_lse=True)
    assert_matches_oracle(case, out, lse)
    if n <= case.window:  # nothing is distant: exactly dense causal attention
        assert (out.double() - _causal_sdpa(case)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "n,batch", [(1, 1), (1, 2), (2, 2), (31, 1), (33, 2), (128, 1), (129, 2), (1025, 1)]
)
def test_short_and_odd_lengths_gradients_equal_oracle(n, batch):
    case = make_case(nk=n, batch=batch, seed=n + 1, **TINY)
    cot = torch.randn(case.q.shape, generator=gen(n))
    out, grads = _math_grads(case, cot)
    assert_matches_oracle(case, out.detach())
    for name, got, want in zip("qkv", grads, _oracle_grads(case, cot), strict=True):
        assert torch.isfinite(got).all(), f"d{name} not finite at n={n}"
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5, f"d{name} off by {err:.3g} at n={n}"


@pytest.mark.parametrize("n", [5, 129, 300])
def test_window_at_least_the_length_is_dense_causal(n, backend):
    case = make_case(nk=n, batch=2, seed=n, **{**TINY, "window": n, "top_k": 1})
    out = case.sparse(backend)
    assert (out.double() - _causal_sdpa(case)).abs().max() <= 1e-5


def _window_case(n: int, window: int, nq: int, membership: str, dtype) -> Case:
    """q = k = 0 makes the weights uniform and v_j = j, so output_i is the mean of the
    visible positions. "none": nobody has a group (the local part only); "distinct": token
    i alone in group i, so it shares a group with itself only."""
    q = torch.zeros(1, 2, nq, 4, dtype=dtype)
    k = torch.zeros(1, 1, n, 4, dtype=dtype)
    v = torch.arange(n, dtype=dtype).view(1, 1, n, 1).expand(1, 1, n, 4).contiguous()
    if membership == "none":
        kg = torch.zeros(1, n, 3, dtype=torch.bool)
    else:
        kg = torch.eye(n, dtype=torch.bool)[None]
    return Case(q, k, v, kg[:, n - nq :].clone(), kg, window)


WINDOW_SHAPES = [
    (n, m) for n in (1, 16, 300) for m in ("none", "distinct") if m == "none" or n <= 16
]


@pytest.mark.parametrize("mode", ["prefill", "decode", "chunk"])
@pytest.mark.parametrize("window", [1, 2, 4, 7, 16, 40])
@pytest.mark.parametrize("n,membership", WINDOW_SHAPES)
def test_window_counts_the_query_itself(n, membership, window, mode, backend):
    """Output i is the mean of positions max(0, i - window + 1) .. i."""
    nq = {"prefill": n, "decode": 1, "chunk": max(1, n // 3)}[mode]
    case = _window_case(n, window, nq, membership, torch.float32)
    out = case.sparse(backend)
    i = torch.arange(n - nq, n, dtype=torch.float64)
    want = (i + (i - window + 1).clamp(min=0)) / 2
    err = (out.double() - want[None, None, :, None]).abs().max().item()
    assert err <= 1e-5 * max(1, n), f"window {window}: output is not the window mean ({err})"


def test_window_counts_the_query_itself_with_auto(kernel_built):
    for mode, window in (("prefill", 4), ("decode", 7), ("chunk", 1)):
        nq = {"prefill": 16, "decode": 1, "chunk": 5}[mode]
        out = _window_case(16, window, nq, "none", torch.float32).sparse("auto")
        i = torch.arange(16 - nq, 16, dtype=torch.float64)
        want = (i + (i - window + 1).clamp(min=0)) / 2
        assert (out.double() - want[None, None, :, None]).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [1, 4, 20])
def test_window_means_are_exact_in_half_precision_and_decode_equals_prefill(dtype, window, backend):
    n = 16  # every j and every mean is exact in bf16 and fp16
    full = _window_case(n, window, n, "none", dtype).sparse(backend)
    for i in range(n):
        lo = max(0, i - window + 1)
        assert torch.all(full[0, :, i] == (lo + i) / 2)
        dec = _window_case(i + 1, window, 1, "none", dtype).sparse(backend)
        assert torch.equal(dec[0, :, 0], full[0, :, i])


# --------------------------------------------------------------------------------------
# groups and heads
# --------------------------------------------------------------------------------------


def test_every_token_in_one_group_equals_dense_causal(backend):
    """Routing that sends every token to group 0 (15 of 16 groups empty) gives dense causal
    attention."""
    groups = torch.zeros(2, 60, 16, dtype=torch.bool)
    groups[..., 0] = True
    g = gen(12)
    q = torch.randn(2, 4, 60, 16, generator=g)
    k, v = torch.randn(2, 2, 60, 16, generator=g), torch.randn(2, 2, 60, 16, generator=g)
    case = Case(q, k, v, groups, groups, 8)
    out, lse = case.sparse(backend, return_lse=True)
    assert_matches_oracle(case, out, lse)
    assert (out.double() - _causal_sdpa(case)).abs().max() <= 1e-5


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_a_single_group_equals_dense_causal(kv_heads, backend):
    case = make_case(nk=200, batch=2, seed=12, **{**TINY, "kv_heads": kv_heads, "groups": 1})
    out = case.sparse(backend)
    assert (out.double() - _causal_sdpa(case)).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_a_zeroed_kv_head_zeroes_only_its_query_heads(kv_heads, mode, backend):
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


# --------------------------------------------------------------------------------------
# nothing is kept between calls
# --------------------------------------------------------------------------------------


def test_calls_of_other_lengths_in_between_change_nothing(backend):
    """Run at 1025, then 200 (and then a tour of other lengths): each result equals a fresh
    run of that length and the oracle."""
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


def test_same_shapes_with_new_memberships_give_new_results(backend):
    a = make_case(nk=200, seed=1, **TINY)
    b = make_case(nk=200, seed=2, **TINY)
    b.q, b.k, b.v = a.q, a.k, a.v  # same tensors, only the routing differs
    assert not torch.equal(a.kg, b.kg)
    out_a = a.sparse(backend)
    out_b = b.sparse(backend)
    assert_matches_oracle(a, out_a)
    assert_matches_oracle(b, out_b)
    assert (out_a - out_b).abs().max() > 1e-3


# --------------------------------------------------------------------------------------
# decoding: the fused kernel splits a step's keys into segments (split-K)
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("nq", [1, 2, 5])
@pytest.mark.parametrize(
    "kw",
    [dict(top_k=1), dict(top_k=2, padding="left"), dict(membership="random", used_groups=3),
     dict(kv_heads=1, top_k=2, padding="random"), dict(membership="none")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_steps_split_into_key_segments_equal_oracle(nq, kw, dtype, fused_kernel, monkeypatch):  # fmt: skip
    """With few query rows per call the fused kernel splits each tile's keys into position
    segments merged by log-sum-exp; with 3-key segments every case splits into many, with
    segments that see no key and classes whose keys sit in one segment only."""
    monkeypatch.setattr(cpu_fused, "FUSED_SEGMENT_KEYS", 3)
    base = dict(batch=1, heads=6, kv_heads=3, groups=4, window=5, nk=77, nq=nq, seed=31)
    case = make_case(**{**base, **kw}, dtype=dtype)
    with _threads(4):  # 4 threads want 16 items: up to 16 segments per tile
        out, lse = case.sparse("cpu_fused", return_lse=True)
    assert_matches_oracle(case, out, lse)


@pytest.mark.parametrize("where", ["query", "early key", "late key"])
def test_segmented_decoding_propagates_nan(where, fused_kernel, monkeypatch):
    monkeypatch.setattr(cpu_fused, "FUSED_SEGMENT_KEYS", 4)
    case = make_case(nk=60, nq=1, heads=2, kv_heads=1, groups=2, top_k=2, window=4, seed=5)
    if where == "query":
        case.q[0, 0, 0] = math.nan
    else:
        case.k[0, 0, 3 if where == "early key" else 50] = math.nan
    with _threads(4):
        out = case.sparse("cpu_fused")
    ref, _ = dense_attention(case.q, case.k, case.v, case.mask())
    assert torch.isnan(ref).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


@pytest.mark.parametrize("where", ["query", "early key", "late key"])
def test_group_part_by_single_group_propagates_nan(where, fused_kernel):
    """Keys in one group, queries in four: the fused kernel's group part runs by single
    group and merges each query's groups by log-sum-exp; a NaN in one group's keys reaches
    exactly the queries that see it, as in dense attention."""
    case = make_case(nk=120, heads=2, kv_heads=1, groups=12, top_k=1, window=4, seed=6,
                     query_membership="widest")  # fmt: skip
    if where == "query":
        case.q[0, 0, 70] = math.nan
    else:
        case.k[0, 0, 5 if where == "early key" else 100] = math.nan
    out = case.sparse("cpu_fused")
    ref, _ = dense_attention(case.q, case.k, case.v, case.mask())
    assert torch.isnan(ref).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


@pytest.mark.parametrize("groups", [12, 33, 64])
def test_group_part_by_single_group_at_every_code_width(groups, fused_kernel):
    """The by-group split at 16- to 64-bit membership codes (a query's slot is the count of
    its groups below the one being run, the top groups included), with padding."""
    case = make_case(nk=150, nq=70, batch=2, heads=4, kv_heads=2, groups=groups, top_k=1,
                     query_membership="widest", padding="left", seed=groups)  # fmt: skip
    case.kg[:, ::5] = False
    case.kg[:, ::5, -1] = True  # the last group is never empty
    case.qg[:, :, -1] = True
    assert_matches_oracle(case, *case.sparse("cpu_fused", return_lse=True))


@pytest.mark.parametrize("groups", [8, 9, 12, 17, 33, 64])
@pytest.mark.parametrize("nq", [1, 40])
def test_every_membership_code_width_equals_oracle(groups, nq, backend):
    """Memberships of 8 to 64 groups: the fused kernel packs them into 8- to 64-bit codes,
    eight groups at a time; the groups past each 8 must count as the first ones do."""
    case = make_case(nk=90, nq=nq, batch=2, heads=4, kv_heads=2, groups=groups, top_k=3,
                     membership="random", padding="left", seed=groups)  # fmt: skip
    case.kg[:, :, -1] |= torch.arange(90) % 3 == 0  # the last group is never empty
    case.qg[:, :, -1] |= True
    if backend == "triton" and groups > MAX_KERNEL_GROUPS:  # one int64 code word: refused
        with pytest.raises(BackendUnavailable, match=f"K <= {MAX_KERNEL_GROUPS} groups"):
            case.sparse(backend)
        return
    out, lse = case.sparse(backend, return_lse=True)
    assert_matches_oracle(case, out, lse)
