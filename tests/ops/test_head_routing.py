"""Memberships per key-value head (``[B, N, H_kv, K]``: a routing per key-value head) on every
backend of ``sparse_attention`` and ``decode_attention``, against the float64 oracle that
builds each head's mask directly (docs/method.md §4-§5): grouped-query sharing, odd lengths,
empty groups, padding, half precision, views, gradients; per-head memberships equal across
heads give the shared call's result; the dispatcher's fold of the heads into the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from tolerances import tolerance

from focus_attention.ops import dense_attention, focus_mask, sparse_attention
from focus_attention.ops.sparse import GroupBuckets, cpu_fused, decode_attention
from focus_attention.ops.sparse.dispatch import SparseInputs, fold_heads, unfold_heads

from .helpers import (
    HYP,
    assert_matches_oracle,
    brute_mask,
    case_params,
    make_case,
    make_head_case,
    naive_attention,
)

#: backends that compute gradients (``triton`` under the interpreter, tiny shapes)
DIFFERENTIABLE = ("math", "gather", "triton")


def _grid() -> list:
    base = dict(batch=2, kv_heads=2, groups=4, top_k=1, window=5)
    rows: list = []

    def add(name: str, **kw) -> None:
        rows.append(pytest.param({**base, **kw}, id=name))

    for rep, n in [(1, 33), (3, 45), (7, 29)]:  # GQA: H / H_kv query heads per key-value head
        add(f"gqa{rep}-n{n}", heads=2 * rep, nk=n, seed=rep)
    add("mqa", heads=3, kv_heads=1, nk=31)
    add("three-kv-heads", heads=6, kv_heads=3, nk=41, top_k=2)
    add("n1", heads=4, nk=1)
    add("decode", heads=6, nk=101, nq=1, top_k=2)
    add("chunk", heads=4, nk=77, nq=13, top_k=2)
    add("pad-left", heads=4, nk=53, padding="left")
    add("pad-random-chunk", heads=6, nk=47, nq=19, padding="random", top_k=2)
    add("pad-everything", heads=4, nk=23, padding="right", lengths=[0, 3])
    add("empty-groups", heads=4, nk=61, groups=6, top_k=2, used_groups=2)
    add("random-memberships", heads=4, nk=59, groups=5, membership="random")
    add("independent-queries", heads=4, nk=57, nq=21, query_membership="independent", top_k=2)
    add("K9-codes", heads=4, nk=43, groups=9, top_k=3)
    return rows


GRID = _grid()
WITH_LSE = pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "out"])


def _result(case, backend: str, return_lse: bool):
    if return_lse:
        return case.sparse(backend, return_lse=True)
    return case.sparse(backend), None


@WITH_LSE
@pytest.mark.parametrize("params", GRID)
def test_per_head_memberships_equal_the_oracle(params, backend, return_lse):
    case = make_head_case(**params)
    assert case.qg.shape[2] == case.k.shape[1]
    assert_matches_oracle(case, *_result(case, backend, return_lse))


@pytest.mark.parametrize("params", GRID[:6])
def test_per_head_memberships_on_flex(params):
    """FlexAttention on the CPU (eager, inference only) folds the heads as well."""
    case = make_head_case(**params)
    assert_matches_oracle(case, *case.sparse("flex", return_lse=True))


HALF_GRID = [
    pytest.param(dict(heads=6, nk=61, window=8), id="gqa3"),
    pytest.param(dict(heads=4, nk=70, nq=1, top_k=2), id="decode"),
    pytest.param(dict(heads=4, batch=2, nk=57, padding="left", groups=6, used_groups=3), id="pad"),
]


@pytest.mark.parametrize("params", HALF_GRID)
def test_per_head_half_precision_within_twice_the_dense_error(params, backend, half_dtype):
    case = make_head_case(**params, dtype=half_dtype)
    assert_matches_oracle(case, *case.sparse(backend, return_lse=True))


@given(params=case_params(max_nk=40, long_nk=90))
@settings(HYP, max_examples=12)
def test_property_per_head_memberships_equal_the_oracle(backend, params):
    case = make_head_case(**params)
    assert_matches_oracle(case, *case.sparse(backend, return_lse=True))


@pytest.mark.parametrize("nq", [1, 2, 5, 40])
@pytest.mark.parametrize(
    "kw",
    [dict(top_k=1), dict(top_k=2, padding="random"), dict(kv_heads=1, heads=3, top_k=2),
     dict(query_membership="independent", top_k=2, padding="left"), dict(groups=9, top_k=3),
     dict(groups=12, top_k=1, query_membership="widest", padding="random"),
     dict(groups=12, top_k=1, query_membership="widest", sinks=9)],
)  # fmt: skip
def test_per_head_plans_of_the_fused_kernel_equal_the_oracle(nq, kw, fused_kernel, tiny_blocks, monkeypatch):  # fmt: skip
    """The fused kernel plans each key-value head's classes itself: with tiny tiles and
    3-key position segments (4 threads want 16 work items), decoding steps and short
    chunks split every head's keys into segments, merged per head; longer chunks cross
    many class tiles, key blocks and local tiles per head; keys in one group (or, sinks, in
    all) and queries in four run the group part by single group, per head."""
    monkeypatch.setattr(cpu_fused, "FUSED_SEGMENT_KEYS", 3)
    base = dict(batch=2, heads=6, kv_heads=3, groups=4, window=5, nk=77, nq=nq, seed=41)
    case = make_head_case(**{**base, **kw})
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out, lse = case.sparse("cpu_fused", return_lse=True)
    finally:
        torch.set_num_threads(before)
    assert_matches_oracle(case, out, lse)


@pytest.mark.parametrize("backend_name", ["auto", "triton", "gather", "masked", "cpu_fused",
                                          "cpu_flash", "flex", "math"])  # fmt: skip
def test_memberships_equal_across_heads_give_the_shared_result(backend_name, fused_kernel):
    """Per-head memberships that are the same on every head are the shared call: the folded
    call runs the same arithmetic per row (the fold only regroups rows), bit for bit."""
    case = make_case(batch=2, heads=6, kv_heads=3, nk=45, nq=17, top_k=2, padding="left")
    shared, shared_lse = case.sparse(backend_name, return_lse=True)
    each = [g[:, :, None].expand(-1, -1, 3, -1) for g in (case.qg, case.kg)]
    out, lse = sparse_attention(case.q, case.k, case.v, *each, case.window,
                                key_padding_mask=case.kpm, backend=backend_name,
                                return_lse=True)  # fmt: skip
    torch.testing.assert_close(out, shared, **tolerance("bitwise"))
    torch.testing.assert_close(lse, shared_lse, **tolerance("bitwise"))


def test_heads_with_other_memberships_give_other_results():
    """The routing of each key-value head is read: changing one head's memberships changes
    that head's query heads only."""
    case = make_head_case(heads=4, nk=60, top_k=1, window=2, seed=5)
    before = case.sparse("math")
    kg = case.kg.clone()
    kg[:, :, 1] = ~kg[:, :, 1]  # head 1: the complement of its memberships
    after = sparse_attention(case.q, case.k, case.v, case.qg, kg, case.window, backend="math")
    torch.testing.assert_close(after[:, :2], before[:, :2], **tolerance("bitwise"))
    assert (after[:, 2:] - before[:, 2:]).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["prefill", "chunk", "decode"])
def test_per_head_views_of_other_layouts(mode, backend):
    """Model code hands over transposed views ([B, N, H, D] storage) and memberships kept as
    ``[B, H_kv, N, K]`` (a transposed view) or sliced from a wider tensor."""
    nk = 50
    nq = {"prefill": nk, "chunk": 20, "decode": 1}[mode]
    case = make_head_case(nk=nk, nq=nq, batch=2, heads=6, kv_heads=2, top_k=2, padding="left")
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (case.q, case.k, case.v))
    assert not k.is_contiguous()
    kg = case.kg.transpose(1, 2).contiguous().transpose(1, 2)  # head-major storage
    wide = torch.zeros(2, nq, 2, 7, dtype=torch.bool)
    wide[..., 2:6] = case.qg
    qg = wide[..., 2:6]
    assert not kg.is_contiguous() and not qg.is_contiguous()
    out, lse = sparse_attention(q, k, v, qg, kg, case.window, key_padding_mask=case.kpm,
                                backend=backend, return_lse=True)  # fmt: skip
    assert_matches_oracle(case, out, lse)


GRAD_CASES = [
    pytest.param(dict(heads=6, nk=40, top_k=2, window=4), id="gqa3"),
    pytest.param(dict(heads=2, nk=37, nq=11, groups=5, top_k=2, window=3), id="chunk-mha"),
    pytest.param(dict(heads=4, batch=2, nk=33, padding="random", membership="random"), id="pad"),
]


@pytest.mark.parametrize("params", GRAD_CASES)
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_per_head_gradients_equal_the_oracle(params, name, interpreted_triton_calls):
    case = make_head_case(**params)
    cot = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(1))
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)

    def grads(fn, dtype=torch.float32):
        leaves = [t.to(dtype).clone().requires_grad_(True) for t in (case.q, case.k, case.v)]
        out = fn(*leaves)
        return torch.autograd.grad((out * cot.to(dtype)).sum(), leaves)

    got = grads(lambda q, k, v: sparse_attention(q, k, v, case.qg, case.kg, case.window,
                                                 key_padding_mask=case.kpm, backend=name))  # fmt: skip
    want = grads(lambda q, k, v: naive_attention(q, k, v, mask)[0], torch.float64)
    for label, a, b in zip("qkv", got, want, strict=True):
        err = (a.double() - b).abs().max().item()
        assert err <= 1e-4, f"d{label} differs from the float64 oracle by {err:.3g}"
    if case.kpm is not None:  # padded keys/values get exactly zero gradient
        pad = ~case.kpm[:, None, :, None].expand_as(got[1])
        assert (got[1][pad] == 0).all() and (got[2][pad] == 0).all()


def test_the_oracles_build_each_heads_mask_directly():
    """The package's oracle (focus_mask of per-head memberships, dense_attention under it)
    and the naive one written here agree, head by head, with the shared mask of each head."""
    case = make_head_case(heads=6, kv_heads=3, nk=40, nq=25, batch=2, top_k=2, padding="random")
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)
    assert mask.shape == (2, 3, 25, 40)
    assert torch.equal(mask, brute_mask(case.qg, case.kg, case.window, case.kpm))
    for h in range(3):
        one = focus_mask(case.qg[:, :, h], case.kg[:, :, h], case.window, case.kpm)
        assert torch.equal(mask[:, h], one)
    pkg, _ = dense_attention(case.q.double(), case.k.double(), case.v.double(), mask)
    mine, _ = naive_attention(case.q, case.k, case.v, mask)
    torch.testing.assert_close(pkg, mine, **tolerance("rounding"))


def test_the_fold_is_a_view_of_contiguous_inputs_and_unfolds_exactly():
    case = make_head_case(batch=2, heads=6, kv_heads=3, nk=20, padding="left")
    inputs = SparseInputs(case.q, case.k, case.v, case.qg, case.kg, case.kpm, 4, 0.25, None,
                          needs_grad=False)  # fmt: skip
    folded = fold_heads(inputs)
    assert folded.query.shape == (6, 2, 20, 16) and folded.key.shape == (6, 1, 20, 16)
    assert folded.query.data_ptr() == case.q.data_ptr()  # views, no copy
    assert folded.key.data_ptr() == case.k.data_ptr()
    assert folded.query_groups.shape == (6, 20, 4)
    assert torch.equal(folded.key_groups[4], case.kg[1, :, 1])  # row b * H_kv + h
    assert torch.equal(folded.key_padding_mask[4], case.kpm[1])
    token_major = case.q.transpose(1, 2).contiguous()  # [B, Nq, H, D]
    rows = token_major.reshape(2, 20, 3, 2, 16).permute(0, 2, 1, 3, 4).reshape(6, 20, 2, 16)
    torch.testing.assert_close(unfold_heads(rows, 2, 3), token_major, **tolerance("bitwise"))


def _bad(case, **change):
    args = dict(qg=case.qg, kg=case.kg)
    args.update(change)
    return lambda: sparse_attention(case.q, case.k, case.v, args["qg"], args["kg"], case.window)


def test_per_head_memberships_of_the_wrong_shape_are_refused_by_name():
    case = make_head_case(heads=6, kv_heads=3, nk=12)
    b, n, h_kv, k = case.kg.shape
    with pytest.raises(ValueError, match=r"query_groups: received shape \(1, 12, 2, 4\).*H_kv=3"):
        _bad(case, qg=case.qg[:, :, :2])()
    with pytest.raises(ValueError, match=r"key_groups: received shape \(1, 12, 2, 4\).*H_kv=3"):
        _bad(case, kg=case.kg[:, :, :2])()
    with pytest.raises(ValueError, match=r"key_groups: received .*rank 3.*expected rank 4"):
        _bad(case, kg=case.kg[:, :, 0])()
    with pytest.raises(ValueError, match=r"query_groups: .*rank 5.*rank 3.*rank 4"):
        _bad(case, qg=case.qg[..., None])()
    with pytest.raises(ValueError, match=r"key_groups: received shape \(1, 12, 3, 3\).*K=4"):
        _bad(case, kg=case.kg[..., :3])()


@pytest.mark.parametrize("name", ["auto", "masked", "triton"])
@pytest.mark.parametrize("nq", [1, 3])
def test_decoding_over_per_head_buckets_equals_the_oracle(name, nq):
    """``decode_attention`` with per-head query memberships over buckets with a routing row
    per key-value head, rows of different lengths in a larger cache, padding."""
    case = make_head_case(batch=2, heads=6, kv_heads=2, nk=40, top_k=2, window=4, seed=7,
                          padding="left", lengths=[40, 31])  # fmt: skip
    lengths = [40, 33]
    capacity = 48
    key, value = (torch.zeros(2, 2, capacity, 16) for _ in range(2))
    key[:, :, :40], value[:, :, :40] = case.k, case.v
    kpm = torch.zeros(2, capacity, dtype=torch.bool)
    kpm[:, :40] = case.kpm
    groups = case.kg.clone()
    groups[1, 33:] = False  # row 1 holds 33 keys
    buckets = GroupBuckets.from_groups(groups.transpose(1, 2), capacity)
    queries = torch.stack([case.q[b, :, n - nq : n] for b, n in enumerate(lengths)])
    qg = torch.stack([case.kg[b, n - nq : n] for b, n in enumerate(lengths)])
    out, lse = decode_attention(queries, key, value, qg, buckets, torch.tensor(lengths), 4,
                                key_padding_mask=kpm, backend=name, return_lse=True)  # fmt: skip
    for b, n in enumerate(lengths):
        mask = focus_mask(qg[b : b + 1], case.kg[b : b + 1, :n], 4, case.kpm[b : b + 1, :n])
        ref, ref_lse = naive_attention(queries[b : b + 1], case.k[b : b + 1, :, :n],
                                       case.v[b : b + 1, :, :n], mask)  # fmt: skip
        assert (out[b : b + 1].double() - ref).abs().max() <= tolerance("oracle")["atol"]
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(lse[b : b + 1]))
        assert (lse[b : b + 1].double() - ref_lse)[fin].abs().max() <= tolerance("log")["atol"]


def test_decoding_refuses_buckets_of_another_routing():
    case = make_head_case(heads=4, kv_heads=2, nk=10)
    shared = GroupBuckets.from_groups(case.kg[:, None, :, 0])  # one routing row
    lengths = torch.tensor([10])
    with pytest.raises(ValueError, match=r"buckets: received B, R, K, C = 1, 1, 4, 10.*1, 2, 4"):
        decode_attention(case.q[:, :, -1:], case.k, case.v, case.qg[:, -1:], shared, lengths, 4)
    with pytest.raises(ValueError, match=r"query_groups: received shape \(1, 1, 1, 4\).*H_kv=2"):
        decode_attention(case.q[:, :, -1:], case.k, case.v, case.qg[:, -1:, :1], shared,
                         lengths, 4)  # fmt: skip


@pytest.mark.parametrize("backend_name", ["auto", "masked", "math"])
def test_the_custom_operator_folds_per_head_memberships(backend_name, kernel_built):
    """The opaque operator that compiled callers trace takes per-head memberships: opcheck
    passes (schema, fake shapes, dispatch) and it returns the eager call's result."""
    case = make_head_case(heads=4, nk=30, top_k=2, padding="random", seed=11)
    args = (case.q, case.k, case.v, case.qg, case.kg, case.kpm, case.window, 0.25, None,
            backend_name, True)  # fmt: skip
    result = torch.library.opcheck(torch.ops.focus_attention.sparse_attention.default, args)
    assert set(result.values()) == {"SUCCESS"}, result
    out, lse = torch.ops.focus_attention.sparse_attention(*args)
    eager = case.sparse(backend_name, scale=0.25, return_lse=True)
    torch.testing.assert_close(out.transpose(1, 2), eager[0], **tolerance("bitwise"))
    torch.testing.assert_close(lse.transpose(1, 2), eager[1], **tolerance("bitwise"))
