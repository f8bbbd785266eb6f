"""The masked-attention primitive of ``ops/reference.py`` (``masked_softmax``,
``masked_attention``, ``attention_probs``) against a float64 reference written head by head,
on grids of GQA ratios (1, 3, 7), mask layouts, soft-capping, rows with no visible key and
dtypes; its gradients; and the callers that must agree with each other to the bit."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import tolerance

from focus_attention.ops import coverage, sparse_attention
from focus_attention.ops.reference import attention_probs, masked_attention, masked_softmax
from focus_attention.ops.sparse.buckets import GroupBuckets
from focus_attention.ops.sparse.triton_decode import bucket_decode_reference

from .helpers import HALF_DTYPES, gen, low_precision_bound, make_case, max_err

HEADS = [(2, 2), (6, 2), (7, 1)]  # GQA ratios 1, 3, 7
MASKS = ["shared", "per-kv-head", "per-query-head", "none"]
SOFTCAP = 2.0
SCALE = 0.4
FP32_OUT = tolerance("oracle")["atol"]
FP32_LSE = tolerance("log")["atol"]


def _inputs(heads: int, kv_heads: int, kind: str, dtype: torch.dtype, seed: int = 0):
    """``q [2, H, 5, 8]``, ``k, v [2, H_kv, 11, 8]`` (logits large enough for soft-capping to
    matter), a mask of layout ``kind`` with some rows empty (a whole row for every head, and
    for per-head layouts a row for one head only), and that mask per query head."""
    g = gen(seed)
    q = (2 * torch.randn(2, heads, 5, 8, generator=g)).to(dtype)
    k = (2 * torch.randn(2, kv_heads, 11, 8, generator=g)).to(dtype)
    v = torch.randn(2, kv_heads, 11, 8, generator=g).to(dtype)
    rows = {"shared": (2,), "per-kv-head": (2, kv_heads), "per-query-head": (2, heads)}
    if kind == "none":
        return q, k, v, None, torch.ones(2, heads, 5, 11, dtype=torch.bool)
    mask = torch.rand(*rows[kind], 5, 11, generator=g) < 0.4
    mask[0, ..., 1, :] = False  # a row every head sees nothing in
    if kind != "shared":
        mask[1, 0, 3, :] = False  # a row one head (group) sees nothing in
    if kind == "shared":
        per_head = mask[:, None].expand(2, heads, 5, 11)
    elif kind == "per-kv-head":
        per_head = mask.repeat_interleave(heads // kv_heads, dim=1)
    else:
        per_head = mask
    return q, k, v, mask, per_head


def _naive(q, k, v, per_head, scale, softcap, logits_dtype=torch.float64):
    """Attention head by head in float64, logits computed in ``logits_dtype`` (and the
    probabilities cast to it before the product with the values, as eager attention);
    rows with no visible key: output 0, log-sum-exp -inf. ``(out, lse, probs)`` float64."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(*q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float64)
    probs = torch.zeros(*q.shape[:3], k.shape[2], dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // (heads // kv_heads)], v[:, h // (heads // kv_heads)]
        logits = (q[:, h].to(logits_dtype) @ kh.to(logits_dtype).transpose(-1, -2)) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.double().masked_fill(~per_head[:, h], -math.inf)
        seen = per_head[:, h].any(dim=-1)
        p = torch.softmax(torch.where(seen[..., None], logits, 0.0), dim=-1) * seen[..., None]
        probs[:, h] = p
        lse[:, h] = torch.where(seen, torch.logsumexp(logits, dim=-1), -math.inf)
        out[:, h] = (p.to(logits_dtype) @ vh.to(logits_dtype)).double()
    return out, lse, probs


def _check(got, exact, bound):
    assert torch.isfinite(got).all(), "NaN or infinity in the output"
    assert max_err(got, exact) <= bound


@pytest.mark.parametrize("eager", [False, True], ids=["fast", "eager"])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("heads,kv_heads", HEADS, ids=["rep1", "rep3", "rep7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_masked_attention_equals_float64_attention(dtype, heads, kv_heads, kind, softcap, eager):
    q, k, v, mask, per_head = _inputs(heads, kv_heads, kind, dtype)
    out, lse = masked_attention(q, k, v, mask, scale=SCALE, softcap=softcap, eager=eager)
    probs, lse2 = masked_softmax(q, k, mask, scale=SCALE, softcap=softcap, eager=eager)
    exact, exact_lse, exact_probs = _naive(q, k, v, per_head, SCALE, softcap)
    assert out.dtype == lse.dtype == probs.dtype == dtype  # float32 or float64 throughout
    assert out.shape == q.shape and lse.shape == q.shape[:3] and probs.shape == per_head.shape
    atol = tolerance("rounding", dtype)["atol"] if dtype == torch.float64 else FP32_OUT
    _check(out, exact, atol)
    _check(probs, exact_probs, atol)
    assert torch.equal(lse, lse2)
    empty = ~per_head.any(dim=-1)
    assert torch.equal(torch.isneginf(lse), empty), "-inf exactly where no key is visible"
    assert (out[empty] == 0).all() and (probs[empty] == 0).all()
    seen = ~empty
    assert max_err(lse, exact_lse, seen) <= (atol if dtype == torch.float64 else FP32_LSE)


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("heads,kv_heads", HEADS, ids=["rep1", "rep3", "rep7"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_precision_inputs(dtype, heads, kv_heads, kind, softcap):
    """Half-precision inputs: the fast arithmetic computes in float32 (within float32's
    tolerance of float64 on the same values); the eager one takes products in the inputs'
    dtype and is within twice the error of the float64 reference whose logits and value
    product are in that dtype."""
    q, k, v, mask, per_head = _inputs(heads, kv_heads, kind, dtype, seed=1)
    exact, exact_lse, _ = _naive(q, k, v, per_head, SCALE, softcap)
    seen = per_head.any(dim=-1)
    out, lse = masked_attention(q, k, v, mask, scale=SCALE, softcap=softcap)
    assert out.dtype == lse.dtype == torch.float32
    _check(out, exact, FP32_OUT)
    assert max_err(lse, exact_lse, seen) <= FP32_LSE
    out, lse = masked_attention(q, k, v, mask, scale=SCALE, softcap=softcap, eager=True)
    low, low_lse, _ = _naive(q, k, v, per_head, SCALE, softcap, logits_dtype=dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _check(out, exact, low_precision_bound(max_err(low, exact), exact, dtype))
    lse_bound = low_precision_bound(max_err(low_lse, exact_lse, seen), exact_lse[seen], dtype)
    assert max_err(lse, exact_lse, seen) <= lse_bound
    assert torch.equal(torch.isneginf(lse), ~seen) and (out[~seen] == 0).all()


@pytest.mark.parametrize("eager", [False, True], ids=["fast", "eager"])
def test_any_leading_dimensions_and_a_broadcast_mask(eager):
    """``[H, Nq, D]`` without a batch, and ``[nb, H, Nq, D]`` blocks with one mask per block
    broadcast over the heads (the decomposition's calls), give the batched result."""
    q, k, v, mask, _ = _inputs(6, 2, "shared", torch.float64)
    out, lse = masked_attention(q, k, v, mask, scale=SCALE, eager=eager)
    for b in range(2):
        one, one_lse = masked_attention(q[b], k[b], v[b], mask[b], scale=SCALE, eager=eager)
        torch.testing.assert_close(one, out[b], **tolerance("rounding", torch.float64))
        torch.testing.assert_close(one_lse, lse[b], **tolerance("rounding", torch.float64))
    blocks, blocks_lse = masked_attention(q, k, v, mask[:, None], scale=SCALE, eager=eager)
    torch.testing.assert_close(blocks, out, **tolerance("rounding", torch.float64))
    torch.testing.assert_close(blocks_lse, lse, **tolerance("rounding", torch.float64))


@pytest.mark.parametrize("eager", [False, True], ids=["fast", "eager"])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
def test_gradients_are_exact_and_finite_on_empty_rows(softcap, eager):
    """float64 gradcheck through the output and the log-sum-exp, rows with no visible key
    included; in float32 their gradients are zero, never NaN."""
    q, k, v, mask, _ = _inputs(6, 2, "per-kv-head", torch.float64)
    q, mask = q[:, :, :4], mask[:, :, :4]  # four query rows, two of them empty somewhere
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fn(q, k, v):
        out, lse = masked_attention(q, k, v, mask, scale=SCALE, softcap=softcap, eager=eager)
        return out, lse.masked_fill(lse.isneginf(), 0.0)  # -inf has no finite difference

    assert torch.autograd.gradcheck(fn, leaves)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    (out.sum() + lse.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    empty = ~mask.any(dim=-1).repeat_interleave(3, dim=1)  # [B, H, Nq]
    assert empty.any() and (leaves[0].grad[empty] == 0).all()


def _eager_maps(query, key, mask, scale, softcap):
    """The attention maps of eager attention written out: float32 logits (float64 for
    float64), masked with -inf, ``torch.softmax``, zero rows where nothing is visible."""
    k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    ct = torch.promote_types(query.dtype, torch.float32)
    logits = (query.to(ct) @ k.to(ct).transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    visible = mask[:, None]
    logits = logits.masked_fill(~visible, -math.inf)
    probs = torch.softmax(logits.masked_fill(~visible.any(-1, keepdim=True), 0.0), dim=-1)
    return probs.masked_fill(~visible, 0.0).to(query.dtype)


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("heads,kv_heads", HEADS, ids=["rep1", "rep3", "rep7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF_DTYPES], ids=str)
def test_attention_probs_are_the_eager_maps_to_the_bit(dtype, heads, kv_heads, softcap):
    q, k, _, mask, per_head = _inputs(heads, kv_heads, "shared", dtype, seed=2)
    got = attention_probs(q, k, mask, SCALE, softcap)
    assert got.dtype == dtype and got.shape == per_head.shape
    assert torch.equal(got, _eager_maps(q, k, mask, SCALE, softcap))


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("nq", [1, 3])
def test_masked_backend_and_bucket_reference_agree_to_the_bit(nq, softcap):
    """Both attend every cached key under the Focus mask by the primitive: on a cache whose
    every slot holds a key, the ``masked`` backend (its float32 path) and the bucket-decoding
    reference give the same bits."""
    case = make_case(batch=2, heads=6, kv_heads=2, nq=nq, nk=40, dim=8, groups=4, top_k=2,
                     window=5, membership="random", seed=nq)  # fmt: skip
    out, lse = sparse_attention(case.q, case.k, case.v, case.qg, case.kg, case.window,
                                backend="masked", softcap=softcap, return_lse=True)  # fmt: skip
    buckets = GroupBuckets.from_groups(case.kg[:, None])
    ref, ref_lse = bucket_decode_reference(case.q, case.k, case.v, case.qg[:, None], buckets,
                                           torch.tensor([40, 40]), case.window, softcap=softcap)  # fmt: skip
    assert torch.equal(out.transpose(1, 2), ref) and torch.equal(lse.transpose(1, 2), ref_lse)


@pytest.mark.parametrize("kv_heads", [3, 1])
def test_distant_attention_is_the_mean_of_the_attention_maps(kv_heads):
    """``coverage.distant_attention`` keeps, of the heads' mean attention map, the distant
    pairs: the maps are :func:`attention_probs`' to the bit."""
    case = make_case(batch=2, heads=3, kv_heads=kv_heads, nk=30, padding="left", seed=4)
    got = coverage.distant_attention(case.q, case.k, 4, key_padding_mask=case.kpm)
    causal = torch.ones(30, 30, dtype=torch.bool).tril()
    maps = attention_probs(case.q, case.k, causal & case.kpm[:, None, :], 16**-0.5)
    distant = torch.ones(30, 30, dtype=torch.bool).tril(-4)
    assert torch.equal(got, maps.mean(dim=1) * distant)
