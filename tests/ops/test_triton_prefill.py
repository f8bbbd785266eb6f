"""Exactness of the Triton group prefill (``ops.sparse.triton_prefill.group_prefill``)
against the dense oracle (docs/method.md §4-§5): grouped-query heads, head sizes, top-k,
windows, padding, memberships, chunked prefill, tile edges, dtypes, softcap, per-key-value-
head routing; its argument checks; and a launcher free of host synchronisation. Without a
CUDA device the kernels run under Triton's interpreter (tests/conftest.py), so shapes are
small."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

from focus_attention.ops import dense_attention, focus_mask
from focus_attention.ops.sparse import BackendUnavailable
from focus_attention.ops.sparse.triton_prefill import (
    class_order,
    group_order,
    group_prefill,
    prefill_blocks,
)
from focus_attention.ops.sparse.triton_support import triton_reason

from .helpers import (
    FP32_ATOL,
    FP32_LSE_ATOL,
    HYP,
    Case,
    assert_matches_oracle,
    brute_mask,
    case_params,
    gen,
    low_precision_bound,
    make_case,
    max_err,
    naive_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    triton_reason(DEVICE) is not None, reason=f"Triton kernels: {triton_reason(DEVICE)}"
)


def _on_device(x):
    return None if x is None else x.to(DEVICE)


def run(case: Case, qg=None, kg=None, **kw):
    """``group_prefill`` on ``case`` (one routing row unless ``qg``/``kg`` ``[B, R, N, K]``
    are given): ``(out [B, H, Nq, D], lse [B, H, Nq])`` on the CPU, as the oracle lays them
    out."""
    qg = case.qg[:, None] if qg is None else qg
    kg = case.kg[:, None] if kg is None else kg
    args = [_on_device(x) for x in (case.q, case.k, case.v, qg, kg)]
    out, lse = group_prefill(*args, case.window, key_padding_mask=_on_device(case.kpm), **kw)
    b, h, _, d = case.q.shape
    assert out.is_contiguous() and out.shape == (b, case.nq, h, d)
    lse = None if lse is None else lse.transpose(1, 2).cpu()
    return out.transpose(1, 2).cpu(), lse


def edges(rep: int, dim: int = 16) -> list[int]:
    """Lengths around the query tile (``QPT`` queries) and the key tile: size - 1, size + 1
    and two tiles + 3."""
    tiles = prefill_blocks(dim, rep).forward
    sizes = {tiles.queries_per_tile, tiles.block_n}
    return sorted({n for s in sizes for n in (s - 1, s + 1, 2 * s + 3)})


def _grid() -> list:
    base = dict(batch=2, heads=4, kv_heads=2, nk=48, groups=4, top_k=1, window=6)
    rows: list = []

    def add(name: str, **kw) -> None:
        rows.append(pytest.param({**base, **kw}, id=name))

    for heads, kv_heads in [(2, 2), (6, 2), (4, 1), (8, 2)]:
        add(f"gqa-{heads}-{kv_heads}", heads=heads, kv_heads=kv_heads, nk=40, top_k=2)
    add("mqa-3", heads=3, kv_heads=1, nk=40)
    for dim in (7, 64, 40):
        add(f"dim{dim}", dim=dim, nk=40, batch=1)
    for top_k in (2, 3, 4):  # top_k = 1: the base
        add(f"top{top_k}of4", top_k=top_k, seed=top_k)
    add("K1", groups=1)
    add("K7-top3-window2", groups=7, top_k=3, window=2, nk=60)
    add("K40-top3", groups=40, top_k=3, nk=50, batch=1)
    add("K62-top2", groups=62, top_k=2, used_groups=40, nk=40, batch=1)
    for window in (1, 3, 47, 48, 100):
        add(f"window{window}", window=window, top_k=2, seed=window)
    for pad in ("left", "right", "random"):
        add(f"pad-{pad}", padding=pad, seed=3)
        add(f"pad-{pad}-chunk", padding=pad, nq=21, top_k=2, seed=4)
    add("pad-everything", padding="right", lengths=[0, 5], nk=30)
    add("empty-groups", groups=6, top_k=2, used_groups=2)
    add("random-memberships", membership="random", groups=5, padding="random")
    add("no-memberships", membership="none")
    for kind in ("wider", "narrower", "independent"):
        add(f"query-{kind}", query_membership=kind, top_k=2, seed=5)
        add(f"query-{kind}-chunk", query_membership=kind, nq=17, seed=6)
    for nq in (1, 2, 47):
        add(f"chunk-{nq}of48", nq=nq, top_k=2, seed=nq)
    add("decode-like-top3", nq=1, nk=70, top_k=3, window=2)
    for rep in (1, 2):
        for n in edges(rep):
            add(f"edge-rep{rep}-n{n}", heads=2 * rep, kv_heads=2, nk=n, batch=1, seed=n)
    add("edge-rep3-chunk", heads=3, kv_heads=1, nk=2 * prefill_blocks(16, 1).forward.block_n + 3,
        nq=prefill_blocks(16, 3).forward.queries_per_tile + 1)  # fmt: skip
    return rows


@pytest.mark.parametrize("params", _grid())
def test_grid_fp32_equals_oracle(params):
    case = make_case(**params)
    assert_matches_oracle(case, *run(case))


def with_sinks(case: Case, sinks: int = 2) -> Case:
    """``case`` with its first ``sinks`` keys (and queries there) in every group."""
    case.kg[:, :sinks] = True
    aligned = case.nk - case.nq
    for t in range(sinks):
        if t >= aligned:
            case.qg[:, t - aligned] = True
    return case


@pytest.mark.parametrize("top_k", [1, 2])
def test_sinks_in_every_group(top_k):
    case = with_sinks(make_case(batch=2, heads=4, kv_heads=2, nk=50, groups=5, top_k=top_k))
    assert_matches_oracle(case, *run(case))


HALF_GRID = [
    pytest.param(dict(nk=48, heads=4, kv_heads=2, window=5, top_k=1), id="prefill"),
    pytest.param(dict(nk=48, nq=19, heads=3, kv_heads=1, groups=6, top_k=3), id="chunk"),
    pytest.param(dict(nk=40, batch=2, padding="left", window=8, dim=64), id="pad-left-d64"),
    pytest.param(dict(nk=36, membership="random", query_membership="independent"), id="random"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("params", HALF_GRID)
def test_half_within_twice_dense_error(params, dtype):
    case = make_case(**params, dtype=dtype)
    assert_matches_oracle(case, *run(case))


def per_head_routing(case: Case, seed: int):
    """Memberships ``[B, H_kv, N, K]`` that differ per key-value head (each head's drawn like
    the case's own, from another seed)."""
    kv_heads = case.k.shape[1]
    q_rows, k_rows = [], []
    for h in range(kv_heads):
        kind = "random" if h % 2 else "topk"
        shape = dict(batch=case.q.shape[0], nq=case.nq, nk=case.nk, groups=case.qg.shape[-1])
        other = make_case(**shape, top_k=2, membership=kind, seed=seed + h)
        q_rows.append(other.qg)
        k_rows.append(other.kg)
    return torch.stack(q_rows, dim=1), torch.stack(k_rows, dim=1)


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(dict(heads=4, kv_heads=2, nk=44, padding="random"), id="gqa-pad"),
        pytest.param(dict(heads=3, kv_heads=3, nk=40, nq=23), id="mha-chunk"),
        pytest.param(dict(heads=6, kv_heads=3, nk=36, dtype=torch.bfloat16), id="gqa-bf16"),
    ],
)
def test_routing_per_key_value_head(params):
    case = make_case(batch=2, groups=5, window=4, **params)
    qg, kg = per_head_routing(case, seed=11)
    out, lse = run(case, qg, kg)
    rep = case.q.shape[1] // case.k.shape[1]
    for h in range(case.k.shape[1]):
        heads = slice(h * rep, (h + 1) * rep)
        sub = Case(case.q[:, heads], case.k[:, h : h + 1], case.v[:, h : h + 1], qg[:, h],
                   kg[:, h], case.window, case.kpm)  # fmt: skip
        assert_matches_oracle(sub, out[:, heads], lse[:, heads])
    assert not torch.equal(qg[:, 0], qg[:, 1])  # the heads do route differently


@pytest.mark.parametrize("softcap", [None, 0.7, 30.0])
@pytest.mark.parametrize("scale", [None, 0.05, 1.3])
def test_scale_and_softcap_equal_float64(scale, softcap):
    case = make_case(batch=1, heads=4, kv_heads=2, nk=40, top_k=2, window=5, padding="left")
    out, lse = run(case, scale=scale, softcap=softcap)
    ref, ref_lse = naive_attention(case.q, case.k, case.v, case.mask(), scale, softcap)
    assert max_err(out, ref) <= FP32_ATOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert max_err(lse, ref_lse, finite) <= FP32_LSE_ATOL


def test_without_lse_same_output():
    case = make_case(batch=2, heads=4, kv_heads=2, nk=40, top_k=2, padding="random")
    out, lse = run(case, needs_lse=False)
    assert lse is None
    assert torch.equal(out, run(case)[0])


def test_strided_inputs():
    """Inputs as transformers holds them (``[B, N, H, D]`` buffers seen as ``[B, H, N, D]``)
    and a non-contiguous head size."""
    case = make_case(batch=2, heads=4, kv_heads=2, nk=40, dim=16, top_k=2)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (case.q, case.k, case.v))
    wide = torch.randn(*case.k.shape[:3], 32)
    wide[..., ::2] = case.k
    padding = torch.rand(2, 2 * case.nk) < 0.8
    case.kpm = padding[:, ::2]  # a strided padding mask
    strided = Case(q, wide[..., ::2], v, case.qg, case.kg, case.window, case.kpm)
    assert_matches_oracle(case, *run(strided))


@given(params=case_params(max_nk=40, long_nk=70))
@settings(HYP, max_examples=10)
def test_property_fp32_equals_oracle(params):
    case = make_case(**params)
    assert_matches_oracle(case, *run(case))


@pytest.mark.parametrize(
    "shape", [(0, 2, 5, 5), (2, 0, 5, 5), (2, 2, 0, 5), (2, 2, 0, 0)], ids=["B0", "H0", "Nq0", "N0"]
)
def test_empty_inputs(shape):
    b, h, nq, nk = shape
    q = torch.randn(b, h, nq, 8, device=DEVICE)
    k = v = torch.randn(b, max(h, 1) if h else 0, nk, 8, device=DEVICE)
    qg = torch.zeros(b, 1, nq, 3, dtype=torch.bool, device=DEVICE)
    kg = torch.zeros(b, 1, nk, 3, dtype=torch.bool, device=DEVICE)
    out, lse = group_prefill(q, k, v, qg, kg, 4)
    assert out.shape == (b, nq, h, 8) and (out == 0).all()
    assert lse.shape == (b, nq, h) and (lse == -math.inf).all()


# --------------------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------------------


def _head_masks(case: Case, qg: torch.Tensor | None, kg: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B, H, Nq, Nk]``: the mask of each query head (per key-value head routing
    when ``qg``/``kg`` ``[B, H_kv, N, K]`` are given)."""
    heads, kv_heads = case.q.shape[1], case.k.shape[1]
    if qg is None:
        return case.mask()[:, None].expand(-1, heads, -1, -1)
    per_kv = [brute_mask(qg[:, h], kg[:, h], case.window, case.kpm) for h in range(kv_heads)]
    return torch.stack([per_kv[h // (heads // kv_heads)] for h in range(heads)], dim=1)


def _loss(out, lse, seen, weights):
    """A scalar that reads every output element and every finite log-sum-exp."""
    w_out, w_lse = weights
    loss = (out.double() * w_out.double()).sum()
    if w_lse is not None:
        loss = loss + (torch.where(seen, lse.double(), 0.0) * w_lse.double()).sum()
    return loss


def gradients(case: Case, dtype, *, kernel: bool, qg=None, kg=None, lse=True, **kw):
    """``(dq, dk, dv)`` in float64 on the CPU of a fixed random loss of the outputs (and the
    log-sum-exp with ``lse``) with inputs of ``dtype``: from :func:`group_prefill` when
    ``kernel``, else from the dense oracle."""
    g = gen(7)
    b, h, nq, d = case.q.shape
    w_out = torch.randn(b, nq, h, d, generator=g).to(case.q.dtype)
    w_lse = torch.randn(b, nq, h, generator=g) if lse else None
    masks = _head_masks(case, qg, kg)
    seen = masks.any(dim=-1).transpose(1, 2)  # [B, Nq, H]
    leaves = [x.detach().to(dtype).requires_grad_() for x in (case.q, case.k, case.v)]
    if kernel:
        qg = case.qg[:, None] if qg is None else qg
        kg = case.kg[:, None] if kg is None else kg
        inputs = [_on_device(x.detach()).requires_grad_() for x in leaves]
        out, lse_out = group_prefill(*inputs, _on_device(qg), _on_device(kg), case.window,
                                     key_padding_mask=_on_device(case.kpm), **kw)  # fmt: skip
        _loss(out.cpu(), lse_out.cpu(), seen, (w_out, w_lse)).backward()
        return [x.grad.cpu().double() for x in inputs]
    out, lse_out = dense_attention(*leaves, masks, **kw)
    _loss(out.transpose(1, 2), lse_out.transpose(1, 2), seen, (w_out, w_lse)).backward()
    return [x.grad.double() for x in leaves]


def assert_gradients_match(case: Case, **kw) -> None:
    """fp32: each gradient within ``1e-5 * max(1, max |reference|)`` of the float64 oracle's.
    bfloat16/float16: within :func:`low_precision_bound` of the dense oracle run in that
    dtype (its error against the float64 oracle on the same values)."""
    got = gradients(case, case.q.dtype, kernel=True, **kw)
    ref = gradients(case, torch.float64, kernel=False, **kw)
    low = case.q.dtype != torch.float32
    dense = gradients(case, case.q.dtype, kernel=False, **kw) if low else ref
    for name, a, r, d in zip(("dq", "dk", "dv"), got, ref, dense, strict=True):
        assert torch.isfinite(a).all(), f"{name} not finite"
        err = max_err(a, r)
        if low:
            bound = low_precision_bound(max_err(d, r), r, case.q.dtype)
        else:
            bound = FP32_ATOL * max(1.0, r.abs().max().item())
        assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


def _grad_grid() -> list:
    base = dict(batch=2, heads=4, kv_heads=2, nk=40, groups=4, top_k=1, window=5)
    rows: list = []

    def add(name: str, **kw) -> None:
        rows.append(pytest.param({**base, **kw}, id=name))

    add("top1")
    add("mha-top2", heads=2, kv_heads=2, top_k=2)
    add("gqa3-top3", heads=3, kv_heads=1, top_k=3, window=2)
    add("gqa4-pad-random", heads=8, kv_heads=2, top_k=2, padding="random")
    add("pad-left-empty-rows", padding="left", lengths=[0, 25], top_k=2)
    add("chunk", nq=17, top_k=2, padding="right")
    add("independent-chunk", nq=23, query_membership="independent", membership="random")
    add("query-wider", query_membership="wider", seed=3)
    add("K1-window1", groups=1, window=1)
    add("window-beyond-n", window=50, top_k=2)
    add("K40-top3", groups=40, top_k=3, batch=1)
    blocks = prefill_blocks(16, 2)
    bn = blocks.dkdv.block_n  # keys per dk/dv program
    for n in (bn - 1, bn + 1, 2 * bn + 3):
        add(f"edge-n{n}", nk=n, batch=1, top_k=2, seed=n)
    qpt = blocks.dq.queries_per_tile  # queries per dq tile and per dk/dv query tile
    add(f"edge-chunk-{2 * qpt + 3}", nk=bn + 1, nq=2 * qpt + 3, batch=1, top_k=2)
    qpt = prefill_blocks(16, 3).dq.queries_per_tile
    add("edge-rep3-chunk", heads=3, kv_heads=1, nk=2 * bn + 3, nq=qpt + 1, batch=1)
    return rows


@pytest.mark.parametrize("params", _grad_grid())
def test_gradients_fp32_equal_float64(params):
    assert_gradients_match(make_case(**params))


@pytest.mark.parametrize(("scale", "softcap"), [(None, 0.9), (0.4, 20.0), (1.7, None)])
def test_gradients_scale_and_softcap(scale, softcap):
    case = make_case(batch=1, heads=4, kv_heads=2, nk=36, top_k=2, window=4, padding="left")
    assert_gradients_match(case, scale=scale, softcap=softcap)


def test_gradients_of_the_output_alone():
    case = make_case(batch=2, heads=4, kv_heads=2, nk=36, top_k=2, window=3, padding="random")
    assert_gradients_match(case, lse=False)


def test_gradients_with_sinks_and_per_head_routing():
    case = with_sinks(make_case(batch=2, heads=6, kv_heads=3, nk=36, groups=5, window=4))
    assert_gradients_match(case)
    qg, kg = per_head_routing(case, seed=5)
    assert_gradients_match(case, qg=qg, kg=kg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gradients_half_within_twice_dense_error(dtype):
    case = make_case(batch=2, heads=4, kv_heads=2, nk=40, nq=31, top_k=2, window=5,
                     padding="random", dtype=dtype)  # fmt: skip
    assert_gradients_match(case)


@given(params=case_params(max_nk=32, long_nk=56))
@settings(HYP, max_examples=5)
def test_property_gradients_equal_float64(params):
    assert_gradients_match(make_case(**params))


def test_gradients_for_keys_and_values_only():
    """A query that needs no gradient gets none; the others are those of a full call."""
    case = make_case(batch=2, heads=4, kv_heads=2, nk=30, top_k=2, window=3, padding="random")
    grads = []
    for query_grad in (True, False):
        q = _on_device(case.q.detach().clone()).requires_grad_(query_grad)
        k, v = (_on_device(x.detach().clone()).requires_grad_() for x in (case.k, case.v))
        groups = [_on_device(x[:, None]) for x in (case.qg, case.kg)]
        out, lse = group_prefill(
            q, k, v, *groups, case.window, key_padding_mask=_on_device(case.kpm)
        )
        (out.float().square().sum() + torch.where(lse.isfinite(), lse, 0).sum()).backward()
        grads.append((q.grad, k.grad, v.grad))
    assert grads[1][0] is None and grads[0][0] is not None
    assert torch.equal(grads[0][1], grads[1][1]) and torch.equal(grads[0][2], grads[1][2])


def test_no_gradient_without_requires_grad():
    case = make_case(batch=1, heads=2, kv_heads=1, nk=20)
    out, lse = run(case)
    assert out.grad_fn is None and lse.grad_fn is None


# --------------------------------------------------------------------------------------
# layouts and launcher
# --------------------------------------------------------------------------------------


def test_layouts_sort_by_class_and_by_group():
    case = make_case(batch=2, nk=30, groups=5, membership="random", padding="random", seed=2)
    step = 4
    members = case.kg & case.kpm[..., None]
    classes = class_order(case.qg[:, None])
    groups = group_order(members[:, None], step)
    for b in range(2):
        codes = [sum(1 << g for g in range(5) if case.qg[b, t, g]) for t in range(case.nq)]
        order = sorted(range(case.nq), key=lambda t: (codes[t], t))
        assert classes.rows[b, 0].tolist() == order
        assert classes.codes[b, 0].tolist() == [codes[t] for t in order]
        key_codes = [sum(1 << g for g in range(5) if members[b, j, g]) for j in range(case.nk)]
        assert groups.codes[b, 0].tolist() == key_codes
        start = 0
        for g in range(5):
            keys = [j for j in range(case.nk) if members[b, j, g]]
            assert groups.segments[b, 0, g] == start
            assert groups.rows[b, 0, start : start + len(keys)].tolist() == keys
            below = [sum(1 for j in keys if j < (c + 1) * step) for c in range(-(-30 // step))]
            assert groups.counts[b, 0, :, g].tolist() == below
            start += len(keys)
    assert groups.low_masks.tolist() == [0, 1, 3, 7, 15]


#: aten operations that wait for the device (or whose result shape depends on the data)
SYNC_OPS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "is_nonzero", "equal",
            "item", "allclose", "_assert_async")  # fmt: skip


class _Recorder(TorchDispatchMode):
    """Records each aten operation's name and its output shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple(tuple(x.shape) for x in flat if isinstance(x, torch.Tensor))
        bool_index = func.__name__.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args if isinstance(a, (tuple, list)) for i in a
        )  # fmt: skip
        self.ops.append((str(func), shapes, bool_index))
        return out


def test_launcher_is_free_of_host_synchronisation():
    """The torch-side operations of a call (layout building, allocations, launch) contain no
    synchronising operation and are the same, with the same shapes, for two routings of the
    same shapes."""
    recorded = []
    for seed, membership in ((1, "topk"), (2, "random")):
        case = make_case(batch=2, heads=4, kv_heads=2, nk=40, nq=33, groups=5, top_k=2,
                         membership=membership, padding="random", seed=seed)  # fmt: skip
        run(case)  # first call outside the recorder (lazy imports)
        with _Recorder() as rec:
            run(case)
        recorded.append(rec.ops)
    names = [name for name, _, _ in recorded[0]]
    assert any("sort" in n for n in names) and any("scatter" in n for n in names)
    assert not [n for n in names if any(s in n for s in SYNC_OPS)]
    assert not [op for op in recorded[0] if op[2]], "boolean indexing"
    assert recorded[0] == recorded[1]


def test_backward_is_free_of_host_synchronisation():
    """The same for a backward pass (its layouts, the delta pass, the two kernels)."""
    recorded = []
    for seed, membership in ((1, "topk"), (2, "random")):
        case = make_case(batch=2, heads=4, kv_heads=2, nk=30, nq=21, groups=5, top_k=2,
                         membership=membership, padding="random", seed=seed)  # fmt: skip
        inputs = [_on_device(x.detach().clone()).requires_grad_() for x in (case.q, case.k, case.v)]
        groups = [_on_device(x[:, None]) for x in (case.qg, case.kg)]
        padding = _on_device(case.kpm)
        out, _ = group_prefill(*inputs, *groups, case.window, key_padding_mask=padding)
        loss = out.float().sum()
        with _Recorder() as rec:
            loss.backward()
        recorded.append(rec.ops)
        assert all(x.grad is not None for x in inputs)
    names = [name for name, _, _ in recorded[0]]
    assert not [n for n in names if any(s in n for s in SYNC_OPS)]
    assert not [op for op in recorded[0] if op[2]], "boolean indexing"
    assert recorded[0] == recorded[1]


def test_kernels_import_lazily():
    """Importing the launcher leaves the kernel module unimported (its kernels are defined
    on first launch, after the caller could set ``TRITON_INTERPRET``)."""
    code = (
        "import sys; import focus_attention.ops.sparse.triton_prefill; "
        "print('focus_attention.ops.sparse.triton_prefill_kernels' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False"]


# --------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------


def _args(**change):
    case = make_case(batch=1, heads=4, kv_heads=2, nk=12, nq=10, groups=3)
    args = dict(query=case.q, key=case.k, value=case.v, query_groups=case.qg[:, None],
                key_groups=case.kg[:, None], window=4)  # fmt: skip
    args = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    args.update(change)
    return args


def _bools(*shape):
    return torch.zeros(*shape, dtype=torch.bool)


def _qkv(dim: int, dtype=torch.float32, heads: int = 4) -> dict:
    return dict(
        query=torch.randn(1, heads, 10, dim, dtype=dtype),
        key=torch.randn(1, 2, 12, dim, dtype=dtype),
        value=torch.randn(1, 2, 12, dim, dtype=dtype),
    )


BAD = [
    pytest.param(dict(query_groups=torch.zeros(1, 1, 10, 3)), "query_groups", id="float-groups"),
    pytest.param(dict(query_groups=_bools(1, 10, 3)), "query_groups", id="rank3"),
    pytest.param(dict(key_groups=_bools(1, 3, 12, 3)), "key_groups", id="R3"),
    pytest.param(dict(key_groups=_bools(1, 1, 12, 2)), "key_groups", id="K-mismatch"),
    pytest.param(
        dict(query_groups=_bools(1, 1, 10, 63), key_groups=_bools(1, 1, 12, 63)),
        "K <= 62",
        id="K63",
    ),
    pytest.param(_qkv(300), "D <= 256", id="D300"),
    pytest.param(_qkv(16, torch.float64), "query", id="fp64"),
    pytest.param(_qkv(16, heads=3), "H % H_kv", id="heads"),
    pytest.param(dict(window=0), "window", id="window0"),
    pytest.param(dict(window=2.5), "window", id="window-float"),
    pytest.param(dict(scale=-1.0), "scale", id="scale"),
    pytest.param(dict(softcap=float("inf")), "softcap", id="softcap"),
    pytest.param(dict(key_padding_mask=_bools(1, 11)), "key_padding_mask", id="padding-shape"),
    pytest.param(dict(key_padding_mask=torch.ones(1, 12)), "key_padding_mask", id="padding-dtype"),
]


@pytest.mark.parametrize(("change", "named"), BAD)
def test_bad_arguments_named(change, named):
    change = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in change.items()}
    with pytest.raises(ValueError, match=re.escape(named)):
        group_prefill(**_args(**change))


def test_more_queries_than_keys_refused():
    args = _args()
    args["query"] = torch.randn(1, 4, 13, 16, device=DEVICE)
    args["query_groups"] = torch.zeros(1, 1, 13, 3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        group_prefill(**args)


def test_device_without_triton_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _args()
    if DEVICE.type == "cuda":  # CPU tensors are refused without the interpreter
        args = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET"):
        group_prefill(**args)


def test_mask_helpers_agree():
    """The oracle's mask and the brute-force mask agree on a case with sinks (guards the
    sink construction used above)."""
    case = with_sinks(make_case(nk=20, groups=3, top_k=1))
    assert torch.equal(case.mask(), focus_mask(case.qg, case.kg, case.window))
    assert case.mask()[:, -1, :2].all()


# --------------------------------------------------------------------------------------
# on a GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiles_once_for_every_length():
    """Calls of other lengths, windows and routings reuse the compiled kernel."""
    from focus_attention.ops.sparse import triton_prefill_kernels as kernels

    sizes = []
    for nk, nq, window in ((300, 300, 16), (517, 200, 33), (1000, 1000, 128)):
        case = make_case(batch=1, heads=4, kv_heads=2, nk=nk, nq=nq, top_k=2, window=window)
        case = case.to(torch.bfloat16)
        assert_matches_oracle(case, *run(case))
        cache = kernels.group_prefill_fwd.device_caches[torch.cuda.current_device()][0]
        sizes.append(len(cache))
    assert sizes[0] == sizes[1] == sizes[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_long_prefill_on_gpu(dtype, dim):
    """Compiled kernels (tensor-core dots, rounded probabilities) at a length that spans many
    tiles of every kernel, against the oracle; gradients against float64 at a shorter one."""
    case = make_case(batch=1, heads=8, kv_heads=2, nk=2048, nq=1536, dim=dim, groups=8,
                     top_k=2, window=128, padding="left", lengths=[2000], dtype=dtype)  # fmt: skip
    assert_matches_oracle(case, *run(case))
    short = make_case(batch=1, heads=8, kv_heads=2, nk=300, dim=dim, groups=8, window=32)
    assert_gradients_match(short.to(dtype))
