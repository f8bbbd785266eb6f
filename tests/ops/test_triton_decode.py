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
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from focus_attention.ops.sparse import triton_decode, triton_decode_kernels
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

#: aten operations that read a device value on the host, or give a shape that depends on one
SYNC_OPS = {
    "_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_scatter", "allclose",
}  # fmt: skip


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
    for _, kv, case in setup.cases:
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
