"""Exactness of ``bucket_decode`` (the Triton decoding kernel, run here under Triton's
interpreter) and ``bucket_decode_reference`` against the dense oracle, row by row on the
first ``L_b`` keys (docs/method.md §4-§5): GQA/MQA, head_dim, top_k, windows, sink keys,
padding, membership kinds, dtypes, rows of different lengths over a cache holding NaN beyond
them, speculative queries, per-key-value-head routing, split counts; argument checks; and
that a call's operation sequence and launch do not depend on routing values (no host
synchronisation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops.sparse import triton_decode
from focus_attention.ops.sparse.buckets import GroupBuckets
from focus_attention.ops.sparse.dispatch import BackendUnavailable
from focus_attention.ops.sparse.triton_decode import bucket_decode, bucket_decode_reference

from .helpers import (
    FP32_ATOL,
    FP32_LSE_ATOL,
    HYP_SMALL,
    Case,
    assert_matches_oracle,
    make_case,
    max_err,
    naive_attention,
)
from .op_record import OpRecorder, assert_same_operations


@dataclass
class Setup:
    """One decoding call (``args``: positional arguments of ``bucket_decode``, ``kwargs``
    its keyword arguments) and the oracle problems it contains: ``(b, kv_head, case)``,
    ``kv_head`` None when one routing serves every key-value head."""

    args: tuple
    kwargs: dict
    cases: list

    def run(self, fn=bucket_decode, **kw):
        return fn(*self.args, **{**self.kwargs, **kw})

    def check(self, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Every row (and routed key-value head) against its oracle: the package's rule
        (``assert_matches_oracle``), or with a ``scale`` or ``softcap`` the float64 naive
        attention within the float32 tolerances (float32 inputs only)."""
        rep = self.args[0].shape[1] // self.args[1].shape[1]
        for b, kv, case in self.cases:
            heads = slice(None) if kv is None else slice(kv * rep, (kv + 1) * rep)
            sub_out = out[b : b + 1, :, heads].transpose(1, 2)
            sub_lse = None if lse is None else lse[b : b + 1, :, heads].transpose(1, 2)
            if "scale" in self.kwargs or "softcap" in self.kwargs:
                _assert_matches_naive(case, sub_out, sub_lse, self.kwargs)
            else:
                assert_matches_oracle(case, sub_out, sub_lse)


def _assert_matches_naive(case: Case, out, lse, kwargs: dict) -> None:
    assert case.q.dtype == torch.float32
    ref, ref_lse = naive_attention(case.q, case.k, case.v, case.mask(), kwargs.get("scale"),
                                   kwargs.get("softcap"))  # fmt: skip
    assert max_err(out, ref) <= FP32_ATOL
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert max_err(lse, ref_lse, torch.isfinite(ref_lse)) <= FP32_LSE_ATOL


def build(
    *,
    lengths=(37, 20),
    capacity: int = 48,
    heads: int = 4,
    kv_heads: int = 2,
    nq: int = 1,
    dim: int = 16,
    groups: int = 4,
    top_k: int = 1,
    window: int = 4,
    per_head: bool = False,
    padding: str | None = None,
    sinks: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **kwargs,
) -> Setup:
    """A cache of ``capacity`` slots whose row ``b`` holds ``lengths[b]`` keys drawn by
    ``make_case`` (NaN in every slot beyond and in every padding slot), the last ``nq`` of
    them the queries; ``per_head``: a routing per key-value head (``R = H_kv``), else one.
    ``padding``: the last quarter (``"right"``), first quarter (``"left"``) or a random
    quarter (``"random"``) of each row's keys are padding. Other keyword arguments
    (``membership``, ``query_membership``, ``used_groups``) go to ``make_case``, except
    ``scale``, ``softcap`` and ``num_splits``, which go to the call."""
    call_kw = {k: kwargs.pop(k) for k in ("scale", "softcap", "num_splits") if k in kwargs}
    rep, routings, batch = heads // kv_heads, kv_heads if per_head else 1, len(lengths)
    nan = torch.full((batch, kv_heads, capacity, dim), math.nan, dtype=dtype)
    key, value = nan.clone(), nan.clone()
    query = torch.empty(batch, heads, nq, dim, dtype=dtype)
    key_groups = torch.zeros(batch, routings, capacity, groups, dtype=torch.bool)
    query_groups = torch.zeros(batch, routings, nq, groups, dtype=torch.bool)
    pad = torch.zeros(batch, capacity, dtype=torch.bool)
    cases = []
    for b, n in enumerate(lengths):
        real = [n - n // 4] if padding in ("left", "right") else None
        first = None
        for r in range(routings):
            sub = dict(heads=rep, kv_heads=1) if per_head else dict(heads=heads, kv_heads=kv_heads)
            case = make_case(**sub, nq=nq, nk=n, dim=dim, groups=groups, top_k=top_k,
                             window=window, padding=padding, lengths=real, dtype=dtype,
                             seed=seed * 1000 + 10 * b + r, **kwargs)  # fmt: skip
            first = first or case
            case.kpm = first.kpm
            case.kg[:, :sinks] = True  # a sink key is in every group
            hs = slice(r * rep, (r + 1) * rep) if per_head else slice(None)
            ks = slice(r, r + 1) if per_head else slice(None)
            query[b, hs], key[b, ks, :n], value[b, ks, :n] = case.q[0], case.k[0], case.v[0]
            key_groups[b, r, :n], query_groups[b, r] = case.kg[0], case.qg[0]
            cases.append((b, r if per_head else None, case))
        if padding is not None:
            pad[b, :n] = first.kpm[0]
            key[b, :, :n][:, ~pad[b, :n]] = math.nan  # a padding slot is never read
            value[b, :, :n][:, ~pad[b, :n]] = math.nan
    buckets = GroupBuckets.from_groups(key_groups)
    lens = torch.tensor(lengths, dtype=torch.int64)
    args = (query, key, value, query_groups, buckets, lens, window)
    kw = dict(key_padding_mask=pad if padding is not None else None, **call_kw)
    return Setup(args, kw, cases)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 keys, so the short test caches cross several blocks per loop."""
    monkeypatch.setattr(triton_decode, "BLOCK_KEYS", 16)


def _grid() -> list:
    rows = []

    def add(name: str, **kw) -> None:
        rows.append(pytest.param(kw, id=name))

    add("base")
    for heads, kv_heads in [(2, 2), (6, 2), (8, 2), (4, 1), (3, 1)]:
        add(f"heads{heads}-kv{kv_heads}", heads=heads, kv_heads=kv_heads)
    for dim in [64, 24, 8, 1]:
        add(f"dim{dim}", dim=dim)
    for top_k in [2, 3, 4]:
        add(f"top{top_k}of4", top_k=top_k, seed=top_k)
    add("K1", groups=1)
    add("K62-top3", groups=62, top_k=3)
    add("K62-random", groups=62, membership="random", used_groups=62)
    for window in [1, 3, 37, 64]:
        add(f"window{window}", window=window, top_k=2)
    add("sinks", sinks=2, window=2)
    add("sinks-top2", sinks=3, top_k=2, window=1, nq=2)
    for pad in ["left", "right", "random"]:
        add(f"pad-{pad}", padding=pad, top_k=2)
    add("pad-left-nq4", padding="left", nq=4, top_k=2)
    add("empty-groups", groups=6, top_k=2, used_groups=2)
    add("no-memberships", membership="none")
    add("random-memberships", membership="random", groups=5)
    add("query-wider", query_membership="wider")
    add("query-narrower", top_k=3, query_membership="narrower")
    add("query-independent", top_k=2, query_membership="independent")
    for nq in [2, 3, 5, 8]:
        add(f"nq{nq}", nq=nq, top_k=2, seed=nq)
    add("per-head", per_head=True, top_k=2)
    add("per-head-nq3-pad", per_head=True, nq=3, padding="left", top_k=2)
    add("per-head-kv3-indep", per_head=True, heads=6, kv_heads=3, query_membership="independent")
    add("three-rows", lengths=(5, 47, 16), top_k=2)
    add("full-and-one", lengths=(48, 1))
    add("long", capacity=160, lengths=(150, 97), window=16, groups=8, top_k=2)
    add("long-splits3", capacity=160, lengths=(150, 97), window=16, groups=8, num_splits=3)
    add("nq8-splits2", nq=8, top_k=2, num_splits=2, padding="random")
    add("scale", scale=0.37, top_k=2)
    add("softcap", softcap=1.5, top_k=2, nq=2, per_head=True)
    return rows


GRID = _grid()


def _inflate(setup: Setup, factor: float = 4.0) -> Setup:
    """Queries scaled up, so soft-capping changes the logits."""
    query = setup.args[0] * factor
    for *_, case in setup.cases:
        case.q = case.q * factor
    return Setup((query, *setup.args[1:]), setup.kwargs, setup.cases)


@pytest.mark.parametrize("params", GRID)
def test_kernel_grid_fp32(params, small_blocks):
    setup = build(**params)
    if "softcap" in params:
        setup = _inflate(setup)
    setup.check(*setup.run())


@pytest.mark.parametrize("params", GRID)
def test_reference_grid_fp32(params):
    setup = build(**params)
    if "softcap" in params:
        setup = _inflate(setup)
    setup.check(*setup.run(bucket_decode_reference))


HALF_GRID = [
    pytest.param(dict(), id="base"),
    pytest.param(dict(nq=4, padding="left", top_k=2), id="nq4-pad-left"),
    pytest.param(dict(per_head=True, nq=3, top_k=2), id="per-head-nq3"),
    pytest.param(dict(dim=64, heads=6, kv_heads=2), id="dim64-rep3"),
    pytest.param(dict(sinks=2, membership="random", groups=5, dim=24), id="sinks-random-dim24"),
    pytest.param(dict(capacity=160, lengths=(150, 97), window=16, num_splits=3), id="long-split"),
]


@pytest.mark.parametrize("params", HALF_GRID)
def test_kernel_half(params, half_dtype, small_blocks):
    setup = build(**params, dtype=half_dtype)
    setup.check(*setup.run())


@pytest.mark.parametrize("params", HALF_GRID)
def test_reference_half(params, half_dtype):
    setup = build(**params, dtype=half_dtype)
    setup.check(*setup.run(bucket_decode_reference))


#: a split count's result against one split's: each split's partial result is rounded once
#: more before the merge, so twice the rounding tolerance
MERGED_SPLITS = 2
SPLIT_CASES = [
    pytest.param(dict(capacity=160, lengths=(150, 23), window=16, groups=8, top_k=2), splits,
                 id=f"long-{splits}")
    for splits in (1, 2, 3, 7, 40)
] + [
    pytest.param(dict(per_head=True, nq=2, top_k=2, padding="left"), splits,
                 id=f"per-head-nq2-pad-{splits}")
    for splits in (2, 5, 24)
]  # fmt: skip


@pytest.mark.parametrize(("params", "splits"), SPLIT_CASES)
def test_split_counts(params, splits, small_blocks):
    """Any split count is exact, more splits than keys included (empty splits merge as
    nothing), and agrees with one split to float32 rounding."""
    setup = build(**params, num_splits=splits)
    out, lse = setup.run()
    setup.check(out, lse)
    one, one_lse = setup.run(num_splits=1)
    torch.testing.assert_close(out, one, **tolerance("rounding", scale=MERGED_SPLITS))
    torch.testing.assert_close(lse, one_lse, **tolerance("rounding", scale=MERGED_SPLITS))


def test_production_block_size(monkeypatch):
    """The block of keys a device runs (head size 16), with a window and buckets longer than
    one block."""
    block_keys, _, _ = triton_decode.decode_tiles(16, interpret=False)
    assert block_keys > 16  # the grid above runs with blocks of 16
    monkeypatch.setattr(triton_decode, "BLOCK_KEYS", block_keys)
    setup = build(capacity=200, lengths=(190, 131), window=70, top_k=2, nq=2, heads=6)
    setup.check(*setup.run())


@pytest.mark.parametrize(
    "params", [dict(heads=20, kv_heads=1), dict(heads=34, kv_heads=2, per_head=True, nq=2)]
)
def test_query_heads_in_several_programs(params, monkeypatch):
    """More query heads per key-value head than one program takes: blocks of them, the
    last one partial."""
    monkeypatch.setattr(triton_decode, "MAX_BLOCK_HEADS", 16)
    setup = build(**params, top_k=2)
    setup.check(*setup.run())


def test_needs_lse_false_returns_the_same_output():
    setup = build(nq=2, top_k=2, padding="right")
    out, lse = setup.run()
    out2, none = setup.run(needs_lse=False)
    assert none is None and lse is not None
    assert torch.equal(out, out2)


def test_rows_shorter_than_the_queries():
    """A query at a negative position (``L_b < Nq``) sees nothing; the row's later queries
    see the keys before them; an empty row gives zeros and ``-inf``."""
    setup = build(lengths=(30, 12), nq=4, top_k=2, groups=3)
    query, key, value, qg, buckets, _, window = setup.args
    lengths = torch.tensor([2, 0])
    buckets.crop_(lengths)
    args = (query, key, value, qg, buckets, lengths, window)
    for fn in (bucket_decode, bucket_decode_reference):
        out, lse = fn(*args)
        assert (out[1] == 0).all() and (lse[1] == -math.inf).all()
        assert (out[0, :2] == 0).all() and (lse[0, :2] == -math.inf).all()
        full = setup.cases[0][2]  # row 0: queries 2, 3 at positions 0, 1 of keys 0, 1
        case = Case(query[:1, :, 2:], key[:1, :, :2], value[:1, :, :2], qg[:1, 0, 2:],
                    full.kg[:, :2], window)  # fmt: skip
        assert_matches_oracle(case, out[:1, 2:].transpose(1, 2), lse[:1, 2:].transpose(1, 2))


def test_zero_size_call():
    query = torch.empty(0, 4, 1, 16)
    key = torch.empty(0, 2, 8, 16)
    buckets = GroupBuckets.empty(0, 1, 4, 8)
    qg = torch.zeros(0, 1, 1, 4, dtype=torch.bool)
    out, lse = bucket_decode(query, key, key, qg, buckets, torch.zeros(0, dtype=torch.int64), 4)
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 1, 4)


def test_appended_buckets_give_the_same_result(small_blocks):
    """Buckets grown as a cache grows them (a prompt chunk, then one token per step, then
    chunks, per-row positions) give bitwise the result of buckets built at once."""
    setup = build(per_head=True, nq=2, top_k=2, lengths=(37, 20), sinks=1)
    query, key, value, qg, built, lengths, window = setup.args
    groups = _key_groups(built)
    grown = GroupBuckets.empty(built.batch, built.rows, built.num_groups, built.capacity)
    grown.append_(torch.arange(7), groups[:, :, :7])
    for p in range(7, 20):
        grown.append_(torch.full((2, 1), p), groups[:, :, p : p + 1])
    for p in range(20, 48, 4):
        grown.append_(torch.arange(p, p + 4)[None].expand(2, 4), groups[:, :, p : p + 4])
    args = (query, key, value, qg, grown, lengths, window)
    for fn in (bucket_decode, bucket_decode_reference):
        assert torch.equal(fn(*args)[0], setup.run(fn)[0])


def _key_groups(buckets: GroupBuckets) -> torch.Tensor:
    """bool ``[B, R, C, K]`` memberships from the buckets' codes."""
    bits = torch.arange(buckets.num_groups, device=buckets.device)
    return (buckets.codes[..., None] >> bits) & 1 == 1


@st.composite
def decode_params(draw) -> dict:
    """Keyword arguments of :func:`build` over the kernel's input space."""
    kv_heads = draw(st.integers(1, 2))
    nq = draw(st.integers(1, 4))
    lengths = tuple(draw(st.integers(nq, 40)) for _ in range(draw(st.integers(1, 2))))
    groups = draw(st.integers(1, 6))
    return dict(
        lengths=lengths,
        capacity=max(lengths) + draw(st.integers(0, 8)),
        heads=kv_heads * draw(st.integers(1, 3)),
        kv_heads=kv_heads,
        nq=nq,
        dim=draw(st.sampled_from([8, 16, 24])),
        groups=groups,
        top_k=draw(st.integers(1, groups)),
        window=draw(st.sampled_from([1, 2, 3, 8, 64])),
        per_head=draw(st.booleans()),
        padding=draw(st.sampled_from([None, "left", "right", "random"])),
        sinks=draw(st.integers(0, 2)),
        membership=draw(st.sampled_from(["topk", "random", "none"])),
        query_membership=draw(st.sampled_from(["aligned", "independent", "wider", "narrower"])),
        num_splits=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(params=decode_params())
@settings(HYP_SMALL, max_examples=12)
def test_property_kernel_and_reference(params):
    setup = build(**params)
    setup.check(*setup.run())
    setup.check(*setup.run(bucket_decode_reference))


def _layout(arg):
    """A launch argument without the values of tensors: shapes and strides."""
    if isinstance(arg, GroupBuckets):
        return tuple(map(_layout, (arg.index, arg.count, arg.codes)))
    if isinstance(arg, torch.Tensor):
        return tuple(arg.shape), arg.stride(), arg.dtype
    return repr(arg)


def _launches(monkeypatch) -> list:
    """Record the launches (kernel, grid, tensor shapes and strides, other values)."""
    calls: list = []
    original = triton_decode.decode_launches

    def wrapper(*args, **kwargs):
        launches = original(*args, **kwargs)
        for launch in launches:
            flat = (*launch.args, *launch.kwargs.values())
            calls.append((launch.kernel, launch.grid, tuple(map(_layout, flat))))
        return launches

    monkeypatch.setattr(triton_decode, "decode_launches", wrapper)
    return calls


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(
    "fn", [bucket_decode, bucket_decode_reference], ids=["kernel", "reference"]
)
def test_operations_do_not_depend_on_values(fn, splits, monkeypatch):
    """Two calls of the same shapes with other routings, lengths, padding and values
    dispatch the same aten operations on the same shapes (the kernel's launches too: same
    grid and arguments), none of which reads the device from the host: the call can be
    captured in a CUDA graph."""
    launches = _launches(monkeypatch)
    records = []
    for seed, lengths, top_k in [(1, (37, 20), 1), (2, (25, 44), 3)]:
        setup = build(seed=seed, lengths=lengths, top_k=top_k, nq=2, per_head=True,
                      padding="random", num_splits=splits, membership="random")  # fmt: skip
        with OpRecorder() as recorder:
            setup.run(fn)
        records.append(recorder)
    assert_same_operations(*records)
    if fn is bucket_decode:
        assert len(launches) == 2 * (1 if splits == 1 else 2)
        half = len(launches) // 2
        assert launches[:half] == launches[half:]


def _setup_args():
    setup = build(nq=2, top_k=2)
    return list(setup.args), dict(setup.kwargs)


def _bad_calls():
    """``(id, change(args, kwargs), message pattern, whether the reference refuses too)``."""
    rows = []

    def add(name, change, match, reference=True):
        rows.append(pytest.param(change, match, reference, id=name))

    def arg(i, value):
        return lambda a, k: a.__setitem__(i, value(a) if callable(value) else value)

    def kw(name, value):
        return lambda a, k: k.__setitem__(name, value)

    add("query-groups-float", arg(3, lambda a: a[3].float()), "query_groups: received dtype")
    add("query-groups-rank", arg(3, lambda a: a[3][:, 0]), "query_groups: received .*rank 3")
    add("query-groups-R", arg(3, lambda a: a[3].expand(2, 3, 2, 4)), r"R=1 or H_kv=2")
    add("query-groups-Nq", arg(3, lambda a: a[3][:, :, :1]), r"Nq=2")
    add("K-63", arg(3, lambda a: torch.zeros(2, 1, 2, 63, dtype=torch.bool)), "K <= 62")
    add("buckets-K", arg(3, lambda a: torch.zeros(2, 1, 2, 5, dtype=torch.bool)), "buckets:")
    add("buckets-type", arg(4, "buckets"), "buckets: received str")
    add("buckets-capacity", arg(4, GroupBuckets.empty(2, 1, 4, 40)), "K, C = 2, 1, 4, 48")
    add("lengths-float", arg(5, torch.tensor([3.0, 4.0])), "key_lengths: received a torch.float")
    add("lengths-shape", arg(5, torch.tensor([3, 4, 5])), r"key_lengths: .*\[B=2\]")
    add("lengths-device", arg(5, torch.zeros(2, dtype=torch.int64, device="meta")), "meta")
    add("window-0", arg(6, 0), "window")
    add("window-float", arg(6, 2.5), "window")
    add("padding-float", kw("key_padding_mask", torch.ones(2, 48)), "key_padding_mask")
    add("padding-shape", kw("key_padding_mask", torch.ones(2, 40, dtype=torch.bool)), r"C=48")
    add("scale", kw("scale", -1.0), "scale")
    add("softcap", kw("softcap", 0.0), "softcap")
    add("splits-0", kw("num_splits", 0), "num_splits")
    add("splits-float", kw("num_splits", 2.0), "num_splits")
    add("splits-129", kw("num_splits", 129), "num_splits", reference=False)
    add("key-dtype", arg(1, lambda a: a[1].double()), "key/value: received dtypes")
    add("heads", arg(0, lambda a: a[0][:, :3]), r"H % H_kv == 0")
    add("float64", lambda a, k: [a.__setitem__(i, a[i].double()) for i in range(3)],
        "float32, bfloat16 or float16", reference=False)  # fmt: skip
    add("head-dim-300", lambda a, k: [a.__setitem__(i, torch.zeros(*a[i].shape[:3], 300))
                                      for i in range(3)], "D <= 256", reference=False)  # fmt: skip
    return rows


@pytest.mark.parametrize(("change", "match", "reference"), _bad_calls())
def test_bad_arguments_are_refused(change, match, reference):
    args, kwargs = _setup_args()
    change(args, kwargs)
    with pytest.raises(ValueError, match=match):
        bucket_decode(*args, **kwargs)
    if reference:
        with pytest.raises(ValueError, match=match):
            bucket_decode_reference(*args, **kwargs)
    else:
        bucket_decode_reference(*args, **kwargs)  # beyond the kernel's limits only


def test_queries_beyond_the_capacity_are_refused():
    setup = build(lengths=(4, 3), capacity=4, nq=1)
    query, key, value, qg, buckets, lengths, window = setup.args
    query = query.expand(2, 4, 5, 16)
    qg = qg.expand(2, 1, 5, 4)
    with pytest.raises(ValueError, match="Nq <= C"):
        bucket_decode(query, key, value, qg, buckets, lengths, window)


def test_backend_unavailable_without_the_interpreter(monkeypatch):
    args, kwargs = _setup_args()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="bucket_decode: the Triton kernel runs on CUDA"):
        bucket_decode(*args, **kwargs)
    bucket_decode_reference(*args, **kwargs)  # the fallback


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_half_weights_keep_float32_accuracy(softcap):
    """float16: the kernel's output is the float32 reference's, rounded once, in all but a
    few elements (rounding ties of two float32 sums): the weights enter the value product
    to about ``2**-16``, not rounded to float16 (that would change about a third of the
    elements); with soft-capping too. bfloat16 is not compared bitwise here: Triton's
    interpreter converts float32 to bfloat16 by truncation, the GPU by rounding to nearest."""
    setup = build(dtype=torch.float16, dim=64, heads=8, lengths=(47, 40), window=8, top_k=2, nq=2)
    if softcap is not None:
        setup = _inflate(setup)
    out, _ = setup.run(softcap=softcap)
    ref, _ = setup.run(bucket_decode_reference, softcap=softcap)
    assert (out != ref).float().mean().item() < 0.01


def test_lengths_are_clamped_to_the_cache():
    """A length beyond the capacity reads no slot past it (as ``C``), a negative one none."""
    setup = build(lengths=(48, 20), top_k=2, nq=2)
    query, key, value, qg, buckets, _, window = setup.args
    for fn in (bucket_decode, bucket_decode_reference):
        out, lse = fn(query, key, value, qg, buckets, torch.tensor([48, 20]), window)
        clamped, clamped_lse = fn(query, key, value, qg, buckets, torch.tensor([60, -3]), window)
        assert torch.equal(out[0], clamped[0]) and torch.equal(lse[0], clamped_lse[0])
        assert (clamped[1] == 0).all() and (clamped_lse[1] == -math.inf).all()


def test_lengths_of_any_layout():
    """Lengths given as a view (a static cache's 0-d length expanded over the batch, stride 0)
    read as the same lengths contiguous."""
    setup = build(lengths=(30, 30), top_k=1, nq=1)
    query, key, value, qg, buckets, _, window = setup.args
    one = torch.tensor(30)
    for fn in (bucket_decode, bucket_decode_reference):
        want = fn(query, key, value, qg, buckets, torch.tensor([30, 30]), window)
        got = fn(query, key, value, qg, buckets, one.expand(2), window)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


# --------------------------------------------------------------------------------------
# on a CUDA device: the compiled kernel, graph capture, compilations
# --------------------------------------------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda(setup: Setup) -> Setup:
    """The call's tensors on the current CUDA device (the oracle cases stay on the CPU)."""

    def move(x):
        if isinstance(x, GroupBuckets):
            return GroupBuckets(x.index.cuda(), x.count.cuda(), x.codes.cuda())
        return x.cuda() if isinstance(x, torch.Tensor) else x

    kwargs = {k: move(v) for k, v in setup.kwargs.items()}
    return Setup(tuple(map(move, setup.args)), kwargs, setup.cases)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("params", GRID)
def test_cuda_grid(params, dtype):
    """The compiled kernel against the oracle (default split count: from the SM count)."""
    if dtype != torch.float32 and ("scale" in params or "softcap" in params):
        pytest.skip("the scale and softcap oracle is float32")
    setup = build(**params, dtype=dtype)
    if "softcap" in params:
        setup = _inflate(setup)
    out, lse = _cuda(setup).run()
    setup.check(out.cpu(), lse.cpu())


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_graph_replays_a_decoding_step(splits):
    """One decoding step (append the new token's groups, then attend) captured in a CUDA
    graph, replayed with the tensors of two other calls of the same shapes copied in:
    each replay equals that call run eagerly."""
    params = dict(per_head=True, top_k=2, padding="left", num_splits=splits, sinks=1)
    first = _cuda(build(seed=1, lengths=(37, 20), **params))
    static = _step_inputs(first)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate before capture
        _step(static, first)
    torch.cuda.current_stream().wait_stream(stream)
    _load(static, _step_inputs(first))
    with torch.cuda.graph(graph):
        result = _step(static, first)
    for seed, lengths in [(2, (25, 44)), (3, (48, 9))]:
        other = _cuda(build(seed=seed, lengths=lengths, **params))
        _load(static, _step_inputs(other))
        graph.replay()
        expected = _step(_step_inputs(other), other)
        torch.testing.assert_close(result[0], expected[0], **tolerance("bitwise"))
        torch.testing.assert_close(result[1], expected[1], **tolerance("bitwise"))
        other.check(result[0].cpu(), result[1].cpu())


def _step_inputs(setup: Setup) -> dict:
    """The state before a call's last token: buckets cropped to ``L - 1``, and the token's
    position and groups."""
    query, key, value, qg, buckets, lengths, _ = setup.args
    before = GroupBuckets(buckets.index.clone(), buckets.count.clone(), buckets.codes.clone())
    before.crop_(lengths - 1)
    rows = torch.arange(len(lengths), device=lengths.device)
    token = _key_groups(buckets)[rows, :, lengths - 1][:, :, None]  # [B, R, 1, K]
    return dict(query=query, key=key, value=value, qg=qg, buckets=before, lengths=lengths,
                positions=(lengths - 1)[:, None], token=token)  # fmt: skip


def _load(static: dict, values: dict) -> None:
    """Copy ``values`` into the static tensors of a captured step."""
    for name, value in values.items():
        if isinstance(value, GroupBuckets):
            for mine, new in zip(static[name].__dict__.values(), value.__dict__.values(),
                                 strict=True):  # fmt: skip
                mine.copy_(new)
        else:
            static[name].copy_(value)


def _step(inputs: dict, setup: Setup):
    inputs["buckets"].append_(inputs["positions"], inputs["token"])
    args = (inputs["query"], inputs["key"], inputs["value"], inputs["qg"], inputs["buckets"],
            inputs["lengths"], setup.args[6])  # fmt: skip
    return bucket_decode(*args, **setup.kwargs)


@pytest.mark.gpu
@CUDA
def test_cuda_compiles_once_for_every_cache_length(monkeypatch):
    """Capacities, lengths and split counts vary between calls of one model: the kernels
    compile once (Triton's cache hook sees each compilation)."""
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook")
    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook",
                        lambda **kw: compiled.append(kw["fn"].name))  # fmt: skip
    for capacity, lengths, splits in [(64, (60, 30), 2), (100, (99, 2), 3), (1000, (700, 999), 5)]:
        setup = _cuda(build(capacity=capacity, lengths=lengths, top_k=2, num_splits=splits))
        setup.check(*(t.cpu() for t in setup.run()))
    assert sorted(compiled) == ["_merge_kernel", "_partials_kernel"], compiled
