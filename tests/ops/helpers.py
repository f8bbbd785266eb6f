"""Shared builders and independent oracles for the op-level exactness tests.

Everything here is written from the op's documented contract and ``docs/method.md`` §1-§5,
not from the implementation: the brute-force mask, the float64 attention and the Sinkhorn
reference are deliberately naive so that a bug in the ops cannot hide in a shared helper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops import backend_names, dense_attention, focus_mask, sparse_attention

#: backends the shared exactness grids leave out: ``flex`` runs them in test_flex.py (on CPU
#: FlexAttention runs eagerly, without gradients, and needs its own block-mask checks)
OWN_GRIDS = ("flex",)
#: the explicit sparse backends every exactness test runs on: the registry's, in ``"auto"``'s
#: order, less :data:`OWN_GRIDS`.
BACKENDS = tuple(name for name in backend_names() if name not in OWN_GRIDS)
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: tolerance for fp32 outputs (max abs error against the exact result; tests/tolerances.py).
FP32_ATOL = tolerance("oracle")["atol"]
#: tolerance for an fp32 log-sum-exp.
FP32_LSE_ATOL = tolerance("log")["atol"]
#: every block constant of the sparse backends shrunk, so that short inputs cross many
#: query blocks, key chunks, strips and band calls (the production sizes are only crossed
#: by inputs of thousands of tokens).
TINY_BLOCKS = dict(
    QUERY_BLOCK=8,
    STRIP=4,
    KEY_CHUNK=16,
    BAND_BLOCK=4,
    BAND_ELEMENTS=64,
    MATH_BLOCK=8,
    FUSED_ROWS=6,
    FUSED_KEYS=5,
    FUSED_BAND=3,
    FUSED_SEGMENT_KEYS=7,
    MASKED_BLOCK=8,
)

#: hypothesis settings: reproducible in CI (derandomize), no per-example deadline (the CPUs
#: are shared), a moderate number of examples to keep tests/ops under ~3 minutes.
HYP = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: the same, fewer examples, for the costlier properties (each example runs several calls).
HYP_SMALL = settings(HYP, max_examples=25)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def block_modules() -> list:
    """The modules of the sparse backends that hold block-size constants."""
    from focus_attention.ops.sparse import cpu_fused, decomposition, masked, math

    return [decomposition, math, cpu_fused, masked]


def block_lengths() -> list[int]:
    """Sequence lengths around every block size the sparse backends expose (and the
    documented 256), so the grids keep hitting block edges if the constants are retuned."""
    sizes = {64, 256}
    for module in block_modules():
        for name in dir(module):
            value = getattr(module, name)
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if name.isupper() and is_int and 8 <= value <= 1024:
                sizes.add(value)
    lengths = set()
    for b in sizes:
        lengths.update({b - 1, b + 1, 2 * b + 3})
    return sorted(n for n in lengths if n <= 1100)


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------


@dataclass
class Case:
    """One sparse-attention problem: tensors plus the window."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    window: int
    kpm: torch.Tensor | None = None
    _ref: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def to(self, dtype: torch.dtype) -> Case:
        return replace(self, q=self.q.to(dtype), k=self.k.to(dtype), v=self.v.to(dtype))

    def cuda(self) -> Case:
        """The same problem on the current CUDA device (for the device's result only: the
        oracle helpers take the CPU case)."""
        kpm = None if self.kpm is None else self.kpm.cuda()
        return replace(self, q=self.q.cuda(), k=self.k.cuda(), v=self.v.cuda(),
                       qg=self.qg.cuda(), kg=self.kg.cuda(), kpm=kpm)  # fmt: skip

    @property
    def nq(self) -> int:
        return self.q.shape[2]

    @property
    def nk(self) -> int:
        return self.k.shape[2]

    def sparse(self, backend: str = "auto", **kw):
        return sparse_attention(
            self.q,
            self.k,
            self.v,
            self.qg,
            self.kg,
            self.window,
            key_padding_mask=self.kpm,
            backend=backend,
            **kw,
        )

    def mask(self) -> torch.Tensor:
        return brute_mask(self.qg, self.kg, self.window, self.kpm)


def make_head_case(*, kv_heads: int = 2, seed: int = 0, **params) -> Case:
    """:func:`make_case` with memberships per key-value head, ``qg [B, Nq, H_kv, K]`` and
    ``kg [B, Nk, H_kv, K]``: head ``h``'s are those :func:`make_case` draws with seed
    ``seed + 1 + h`` (the same kinds; the tensors and padding of ``seed``)."""
    base = make_case(kv_heads=kv_heads, seed=seed, **params)
    draws = [make_case(kv_heads=kv_heads, seed=seed + 1 + h, **params) for h in range(kv_heads)]
    qg = torch.stack([c.qg for c in draws], dim=2)
    return replace(base, qg=qg, kg=torch.stack([c.kg for c in draws], dim=2))


def per_query_head(x: torch.Tensor, heads: int, per_head: bool) -> torch.Tensor:
    """Masks or rows ``[B, ...]`` shared by every head (``per_head`` False) or ``[B, H_kv,
    ...]`` per key-value head as ``[B, 1, ...]`` or ``[B, H, ...]``: the form a query head
    reads (query head ``h`` reads key-value head ``h // (H / H_kv)``)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if per_head else x[:, None]


def topk_groups(
    g: torch.Generator, batch: int, n: int, groups: int, top_k: int, used: int | None = None
) -> torch.Tensor:
    """Each token joins exactly ``top_k`` distinct groups drawn uniformly among the first
    ``used`` groups (``used < groups`` leaves the remaining groups empty)."""
    used = groups if used is None else used
    top_k = min(top_k, used)
    order = torch.rand(batch, n, used, generator=g).argsort(dim=-1)[..., :top_k]
    out = torch.zeros(batch, n, groups, dtype=torch.bool)
    out[..., :used] = torch.zeros(batch, n, used, dtype=torch.bool).scatter_(-1, order, True)
    return out


def padding_mask(
    g: torch.Generator, batch: int, n: int, kind: str | None, lengths: list[int] | None = None
) -> torch.Tensor | None:
    """``[B, n]`` bool, True = real. ``kind``: None, "left", "right" or "random"."""
    if kind is None:
        return None
    if kind == "random":
        m = torch.rand(batch, n, generator=g) < 0.75
        return m
    if lengths is None:
        lengths = [int(torch.randint(0, n + 1, (1,), generator=g)) for _ in range(batch)]
        lengths[0] = n  # one full row keeps most cases non-trivial
    m = torch.zeros(batch, n, dtype=torch.bool)
    for b, length in enumerate(lengths):
        if kind == "left":
            m[b, n - length :] = True
        else:
            m[b, :length] = True
    return m


def make_case(
    *,
    batch: int = 1,
    heads: int = 2,
    kv_heads: int | None = None,
    nq: int | None = None,
    nk: int = 64,
    dim: int = 16,
    groups: int = 4,
    top_k: int = 1,
    window: int = 8,
    padding: str | None = None,
    lengths: list[int] | None = None,
    membership: str = "topk",
    query_membership: str = "aligned",
    used_groups: int | None = None,
    sinks: int = 0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Random inputs for one problem.

    membership: "topk" (exactly ``top_k`` groups per token), "random" (each token in each
    group with probability 0.3, so some tokens have no group and some groups are empty) or
    "none" (no token in any group: local attention only).
    query_membership: "aligned" (the queries are the last ``nq`` keys and carry their
    memberships, as in a model), "independent" (memberships differ between the lists), or
    asymmetric top-k as a model routes it (``query_top_k`` differs from ``top_k``): "wider"
    (each query keeps its key groups and joins one more), "widest" (three more: with
    ``top_k=1``, the query-key layout of keys in one group and queries in four) or
    "narrower" (each query keeps one of its key groups).
    sinks: the first ``sinks`` keys join every group after the queries' memberships are
    drawn (as a model's caches store sink tokens).
    """
    g = gen(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    nq = nk if nq is None else nq
    q = torch.randn(batch, heads, nq, dim, generator=g)
    k = torch.randn(batch, kv_heads, nk, dim, generator=g)
    v = torch.randn(batch, kv_heads, nk, dim, generator=g)

    def draw(n: int) -> torch.Tensor:
        if membership == "topk":
            return topk_groups(g, batch, n, groups, top_k, used_groups)
        if membership == "random":
            m = torch.rand(batch, n, groups, generator=g) < 0.3
            if used_groups is not None:
                m[..., used_groups:] = False
            return m
        if membership == "none":
            return torch.zeros(batch, n, groups, dtype=torch.bool)
        raise AssertionError(membership)

    kg = draw(nk)
    qg = _query_memberships(g, kg[:, nk - nq :], query_membership, draw)
    kg[:, :sinks] = True
    kpm = padding_mask(g, batch, nk, padding, lengths)
    case = Case(q, k, v, qg, kg, window, kpm)
    return case.to(dtype) if dtype != torch.float32 else case


def _query_memberships(g: torch.Generator, aligned: torch.Tensor, kind: str, draw) -> torch.Tensor:  # fmt: skip
    """The queries' memberships ``[B, nq, K]`` from the keys' at their positions (see
    :func:`make_case`)."""
    if kind == "aligned":
        return aligned.clone()
    if kind == "independent":
        return draw(aligned.shape[1])
    # a random score per group, the key groups ranked first: the query keeps its best
    rank = torch.rand(aligned.shape, generator=g) + 2.0 * aligned
    order = rank.argsort(dim=-1, descending=True)
    keep = aligned.sum(-1, keepdim=True) + {"wider": 1, "widest": 3}.get(kind, 0)
    if kind == "narrower":
        keep = keep.clamp(max=1)
    taken = torch.arange(aligned.shape[-1]).expand_as(aligned) < keep
    return torch.zeros_like(aligned).scatter_(-1, order, taken)


# --------------------------------------------------------------------------------------
# independent oracles
# --------------------------------------------------------------------------------------


def brute_mask(
    qg: torch.Tensor, kg: torch.Tensor, window: int, kpm: torch.Tensor | None = None
) -> torch.Tensor:
    """The mask of docs/method.md §4 written out literally: query t sits at ``Nk - Nq + t``; key j is
    visible iff ``j <= i``, j is real, and ``i - j < window`` or they share a group.
    Memberships per key-value head ``[B, N, H_kv, K]`` give ``[B, H_kv, Nq, Nk]``, head by
    head."""
    if qg.dim() == 4:
        heads = range(qg.shape[2])
        return torch.stack([brute_mask(qg[:, :, h], kg[:, :, h], window, kpm) for h in heads], 1)
    batch, nq, _ = qg.shape
    nk = kg.shape[1]
    i = torch.arange(nk - nq, nk)[:, None]
    j = torch.arange(nk)[None, :]
    share = (qg[:, :, None, :] & kg[:, None, :, :]).any(dim=-1)
    mask = (j <= i) & ((i - j < window) | share)
    if kpm is not None:
        mask = mask & kpm[:, None, :]
    return mask


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 masked softmax attention, GQA by head index arithmetic; a row with no
    visible key gives zeros and lse -inf. ``mask`` ``[B, Nq, Nk]`` or per key-value head
    ``[B, H_kv, Nq, Nk]``. Returns ``(out float64, lse float64)``."""
    masks = mask
    batch, heads, nq, dim = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros(batch, heads, nq, dim, dtype=torch.float64)
    lse = torch.full((batch, heads, nq), -math.inf, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // rep].double(), v[:, h // rep].double()
        mask = masks[:, h // rep] if masks.dim() == 4 else masks
        logits = q[:, h].double() @ kh.transpose(-1, -2) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~mask, -math.inf)
        row = mask.any(dim=-1)
        safe = torch.where(row[..., None], logits, torch.zeros_like(logits))
        l_h = torch.logsumexp(safe, dim=-1)
        p = torch.exp(safe - l_h[..., None]) * mask
        out[:, h] = p @ vh
        lse[:, h] = torch.where(row, l_h, torch.full_like(l_h, -math.inf))
    return out, lse


def oracle(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle, ``dense_attention(..., focus_mask(...))``, in fp32 on the case's
    (possibly half-precision) values: the "fp32 reference". Cached on the case (tests
    mutate a case only before its first oracle call)."""
    if case._ref is None:
        mask = focus_mask(case.qg, case.kg, case.window, case.kpm)
        case._ref = dense_attention(case.q.float(), case.k.float(), case.v.float(), mask)
    return case._ref


def sdpa_in_dtype(case: Case, mask: torch.Tensor) -> torch.Tensor:
    """Dense attention computed in the case's own dtype by PyTorch SDPA with a boolean
    mask (the production dense path); rows with no visible key are set to zero as the
    op's contract requires (SDPA leaves them undefined)."""
    rep = case.q.shape[1] // case.k.shape[1]
    k = case.k.repeat_interleave(rep, dim=1)
    v = case.v.repeat_interleave(rep, dim=1)
    mask = per_query_head(mask, case.q.shape[1], case.qg.dim() == 4)
    out = torch.nn.functional.scaled_dot_product_attention(case.q, k, v, attn_mask=mask)
    return torch.where(mask.any(-1)[..., None], out, torch.zeros_like(out))


def max_err(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """``max |a - b|`` in float64 (over the True elements of ``where``; 0 when empty)."""
    diff = (a.double() - b.double()).abs()
    if where is not None:
        diff = diff[where]
    return diff.max().item() if diff.numel() else 0.0


def low_precision_bound(reference_err: float, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The error a result computed from ``dtype`` inputs may have against an fp32
    reference, as flash-attention's tests allow: twice ``reference_err``, the error of the
    same computation done in ``dtype`` by a reference implementation. Floored at half an ulp
    of ``dtype`` at the largest reference value (one rounding of the output), so a
    reference error of exactly 0 (e.g. one visible key) does not make the check flaky."""
    floor = 0.5 * torch.finfo(dtype).eps * (ref.abs().max().item() if ref.numel() else 0.0)
    return 2 * max(reference_err, floor)


def dense_lse_in_dtype(case: Case, mask: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp of the dense reference run in the case's dtype (logits in that dtype)."""
    return dense_attention(case.q, case.k, case.v, mask)[1]


def assert_matches_oracle(case: Case, out: torch.Tensor, lse: torch.Tensor | None = None):
    """The accuracy rule of the sparse op.

    fp32: max abs error <= ``FP32_ATOL`` against the oracle (dense_attention under
    focus_mask), log-sum-exp within ``FP32_LSE_ATOL``. bf16/fp16: against the fp32 oracle run
    on the same half-precision values, the error is within :func:`low_precision_bound` of
    dense SDPA (boolean mask) run in that dtype, and the log-sum-exp within it of the dense
    reference's log-sum-exp computed from logits in that dtype (at least ``FP32_LSE_ATOL``).
    Rows with no visible key are exactly 0 with log-sum-exp ``-inf``.
    """
    ref, ref_lse = oracle(case)
    assert out.shape == case.q.shape
    assert out.dtype == case.q.dtype
    assert torch.isfinite(out).all(), "non-finite output"
    err = max_err(out, ref)
    mask = focus_mask(case.qg, case.kg, case.window, case.kpm)
    low = case.q.dtype != torch.float32
    if not low:
        assert err <= FP32_ATOL, f"fp32 max abs error {err:.3g} > {FP32_ATOL}"
    else:
        dense_err = max_err(sdpa_in_dtype(case, mask), ref)
        bound = low_precision_bound(dense_err, ref, case.q.dtype)
        assert err <= bound, f"{case.q.dtype} error {err:.3g} > {bound:.3g} (dense {dense_err:.3g})"
    per_head = case.qg.dim() == 4
    empty = per_query_head(~case.mask().any(dim=-1), case.q.shape[1], per_head)  # [B, H or 1, Nq]
    assert (out[empty.expand_as(out[..., 0])] == 0).all(), "empty row not zero"
    if lse is None:
        return
    assert lse.shape == case.q.shape[:3]
    assert lse.dtype == torch.float32
    assert not torch.isnan(lse).any(), "NaN lse"
    assert not (lse == math.inf).any(), "+inf lse"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse -inf pattern"
    fin = torch.isfinite(ref_lse)
    tol = FP32_LSE_ATOL
    if low:
        tol = max(tol, 2 * max_err(dense_lse_in_dtype(case, mask), ref_lse, fin))
    lerr = max_err(lse, ref_lse, fin)
    assert lerr <= tol, f"lse error {lerr:.3g} > {tol:.3g}"


def sinkhorn_reference(
    log_scores: torch.Tensor, n_iter: int, padding: torch.Tensor | None = None
) -> torch.Tensor:
    """Float64 log-domain Sinkhorn exactly as docs/method.md §2 describes it. Padding enters
    only the column sums as -inf (masked_fill), so its gradients stay finite."""
    x = log_scores.double()
    for _ in range(n_iter):
        xm = x if padding is None else x.masked_fill(~padding[..., None], -math.inf)
        col = torch.logsumexp(xm, dim=1, keepdim=True)
        x = x - torch.where(torch.isfinite(col), col, torch.zeros_like(col))
        x = x - torch.logsumexp(x, dim=2, keepdim=True)
    p = x.exp()
    if padding is not None:
        p = p.masked_fill(~padding[..., None], 0.0)
    return p


# --------------------------------------------------------------------------------------
# hypothesis strategies
# --------------------------------------------------------------------------------------


@st.composite
def case_params(draw, max_nk: int = 96, long_nk: int = 300) -> dict:
    """Keyword arguments for :func:`make_case` covering the op's whole input space:
    GQA/MQA, prefill/decode/chunked, K and top_k, windows from 1 to beyond N, padding,
    membership kinds, lengths across block edges (occasionally)."""
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    if draw(st.integers(0, 3)) == 0:
        nk = draw(st.integers(max_nk, long_nk))
    else:
        nk = draw(st.integers(1, max_nk))
    mode = draw(st.sampled_from(["prefill", "decode", "chunk"]))
    nq = {"prefill": nk, "decode": 1, "chunk": draw(st.integers(1, nk))}[mode]
    groups = draw(st.one_of(st.integers(1, 6), st.integers(7, 10)))
    top_k = draw(st.integers(1, groups))
    window = draw(st.sampled_from([1, 2, 3, 8, 32, nk - 1, nk, nk + 4, (nk + 1) // 2]))
    window = max(1, window)
    return dict(
        batch=draw(st.integers(1, 2)),
        heads=heads,
        kv_heads=kv_heads,
        nq=nq,
        nk=nk,
        dim=draw(st.sampled_from([1, 3, 8, 16, 32])),
        groups=groups,
        top_k=top_k,
        window=window,
        padding=draw(st.sampled_from([None, None, "left", "right", "random"])),
        membership=draw(st.sampled_from(["topk", "random", "topk", "none", "topk"])),
        query_membership=draw(st.sampled_from(["aligned", "aligned", "independent"])),
        used_groups=draw(st.one_of(st.none(), st.integers(1, groups))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
