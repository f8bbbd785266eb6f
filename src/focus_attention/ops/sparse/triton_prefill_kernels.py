"""Triton kernels of the group prefill (docs/method.md §5), launched by
:mod:`.triton_prefill`, which imports this module on first launch (Triton decides between
compiling and interpreting when a kernel is defined, see :mod:`.triton_support`).

One program owns one query tile of one (batch element, key-value head): ``QPT`` queries of
the class layout (queries sorted by membership code, then position; each query once) times
the ``REP`` query heads of the key-value head, packed into ``BLOCK_M`` rows that share every
key/value tile. Its online softmax runs over two disjoint key sets:

- **group part**: for each group ``g`` held by a row of the tile, the keys of group ``g``
  (the group-sorted key layout, padding excluded) up to ``window`` positions before the
  tile's last query of group ``g``; a pair is visible when the query holds ``g``, the key is
  at least ``window`` positions older, and the two share no group below ``g`` (a pair that
  shares several groups counts in its lowest shared group only);
- **local part**: the keys ``0 <= i - j < window`` (real keys), in token order, visiting
  only the key tiles that some row's window reaches.

The result is written once per query and head (token-major), with its log-sum-exp. Logits
are scaled into base 2 (``exp2``); a row that sees no key outputs 0 and ``-inf``.

The backward (FlashAttention-2) recomputes probabilities from the saved log-sum-exp:
:func:`group_prefill_bwd_delta` (``rowsum(dO * O)``), :func:`group_prefill_bwd_dq` (the
forward's loops) and :func:`group_prefill_bwd_dkdv` (one key tile of the keys' class layout
over the group-sorted queries and the queries whose window holds its keys).

``EXACT`` runs every dot in fp32 (fp32 inputs, and the interpreter, whose bfloat16 dots are
not usable); otherwise the probabilities are rounded to the input dtype for the tensor-core
dots. Globals read inside kernels are ``tl.constexpr`` (required when compiling).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "group_prefill_bwd_delta",
    "group_prefill_bwd_dkdv",
    "group_prefill_bwd_dq",
    "group_prefill_fwd",
]

#: log2(e) and ln(2): logits in base 2 inside the kernels, natural log-sum-exp outside.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
#: larger than any tile index (the local part's "no further tile").
NO_TILE = tl.constexpr(1 << 30)


@triton.jit
def _tanh(x):
    """tanh in fp32 to a few ulps everywhere (an odd polynomial near 0, where the exp form
    cancels); the interpreter has no libdevice tanh."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    near = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.125, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _rows(base, index, stride, ok, dcols, HEAD_DIM: tl.constexpr, EXACT: tl.constexpr):
    """``[n, BLOCK_D]`` rows ``base + index * stride`` (zeros where not ``ok`` and beyond
    ``HEAD_DIM``), in fp32 when ``EXACT``."""
    ptrs = base + index[:, None].to(tl.int64) * stride + dcols[None, :]
    x = tl.load(ptrs, mask=ok[:, None] & (dcols[None, :] < HEAD_DIM), other=0.0)
    if EXACT:
        x = x.to(tl.float32)
    return x


@triton.jit
def _base2_logits(q, k, scale_log2, cap_scale, cap_log2, HAS_SOFTCAP: tl.constexpr):
    """Logits of ``q [M, D]`` against ``k [N, D]`` in base 2: ``scale * q.k * log2(e)``, or
    Gemma-2's ``c * tanh(scale * q.k / c) * log2(e)`` (``cap_scale = scale / c``,
    ``cap_log2 = c * log2(e)``)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if HAS_SOFTCAP:
        return cap_log2 * _tanh(s * cap_scale)
    return s * scale_log2


@triton.jit
def _online(acc, m_i, l_i, s, visible, v):
    """One online-softmax step over a key tile: ``s [M, N]`` base-2 logits, ``visible``
    the pairs that count, ``v [N, D]``. A row with no visible key so far keeps
    ``m = -inf``, ``l = 0``, ``acc = 0`` (no NaN)."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _to_output(x, out_dtype: tl.constexpr):
    """``x`` (fp32) in the output dtype, rounded to nearest even (bfloat16 by its bits: the
    interpreter truncates a plain bfloat16 cast)."""
    if out_dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(out_dtype)


@triton.jit
def _tile_rows(QROWS, QCODES, route, tile, nq, nk, REP: tl.constexpr, QPT: tl.constexpr,
               BLOCK_M: tl.constexpr):  # fmt: skip
    """The rows of query tile ``tile``: row ``r`` is query slot ``r // REP`` of the class
    layout and query head ``r % REP`` of the key-value head. Returns ``(rows, row_ok,
    query index, group code, position)``."""
    rows = tl.arange(0, BLOCK_M)
    slot = tile * QPT + rows // REP
    row_ok = (rows // REP < QPT) & (slot < nq)
    qi = tl.load(QROWS + route * nq + slot, mask=row_ok, other=0)
    qcode = tl.load(QCODES + route * nq + slot, mask=row_ok, other=0)
    return rows, row_ok, qi, qcode, qi + (nk - nq)


@triton.jit
def _group_segment(g, KROWS, SEGMENTS, COUNTS, LOW, route, row_ok, qcode, qpos, nk, window,
                   num_groups, COUNT_STEP: tl.constexpr):  # fmt: skip
    """Group ``g`` for a query tile: its segment of the key layout, how many of its keys
    to read (0 when no row holds ``g``; else up to ``window`` positions before the last
    row that holds it, rounded up to the count table's step), the rows that hold it and
    each row's groups below ``g``."""
    member = row_ok & (((qcode >> g) & 1) != 0)
    horizon = tl.max(tl.where(member, qpos, -1)) - window  # newest key a row may see
    n_counts = (nk + COUNT_STEP - 1) // COUNT_STEP
    at = (route * n_counts + tl.maximum(horizon, 0) // COUNT_STEP) * num_groups + g
    count = tl.where(horizon >= 0, tl.load(COUNTS + at), 0)
    start = tl.load(SEGMENTS + route * num_groups + g)
    low = qcode & tl.load(LOW + g)
    return KROWS + route * (nk * num_groups + 1) + start, count, member, low


@triton.jit
def _group_keys(seg, key_codes, n0, count, cols, member, qpos, low, window):
    """Key tile ``n0`` of a group's segment ``seg`` (``count`` keys read): the key indices
    ``kj``, which exist (``k_ok``), and the visible pairs: the row holds the group, the key
    is at least ``window`` positions older and shares no lower group with the row."""
    k_ok = n0 + cols < count
    kj = tl.load(seg + n0 + cols, mask=k_ok, other=0)
    kcode = tl.load(key_codes + kj, mask=k_ok, other=0)
    visible = member[:, None] & k_ok[None, :]
    visible &= kj[None, :] <= qpos[:, None] - window
    visible &= (low[:, None] & kcode[None, :]) == 0
    return kj, k_ok, visible


@triton.jit
def _local_span(row_ok, qpos, window, BLOCK_N: tl.constexpr):
    """Per row the first and last key tile of its window (``lo``, ``hi``), and the first and
    last key tile of the tile's local part."""
    lo = tl.maximum(qpos - window + 1, 0) // BLOCK_N
    hi = qpos // BLOCK_N
    return lo, hi, tl.min(tl.where(row_ok, lo, NO_TILE)), tl.max(tl.where(row_ok, hi, -1))


@triton.jit
def _local_keys(cur, cols, row_ok, qpos, window, nk, real, HAS_PADDING: tl.constexpr):
    """Key tile ``cur`` in token order: key indices, which are real keys, and the visible
    pairs ``0 <= i - j < window``."""
    kj = cur * cols.shape[0] + cols
    k_ok = kj < nk
    if HAS_PADDING:
        k_ok &= tl.load(real + kj, mask=k_ok, other=0) != 0
    visible = row_ok[:, None] & k_ok[None, :] & (kj[None, :] <= qpos[:, None])
    visible &= kj[None, :] > qpos[:, None] - window
    return kj, k_ok, visible


@triton.jit
def _next_local(lo, hi, cur, row_ok):
    """The next key tile after ``cur`` that some row's window reaches (``NO_TILE``: none)."""
    nxt = tl.maximum(lo, cur + 1)
    return tl.min(tl.where(row_ok & (nxt <= hi), nxt, NO_TILE))


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, kj, k_ok, visible, dcols,
            scale_log2, cap_scale, cap_log2, HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            EXACT: tl.constexpr):  # fmt: skip
    """Load the key/value rows ``kj`` and take one online-softmax step over them."""
    k = _rows(k_base, kj, stride_kn, k_ok, dcols, HEAD_DIM, EXACT)
    v = _rows(v_base, kj, stride_vn, k_ok, dcols, HEAD_DIM, EXACT)
    s = _base2_logits(q, k, scale_log2, cap_scale, cap_log2, HAS_SOFTCAP)
    return _online(acc, m_i, l_i, s, visible, v)


@triton.jit(
    do_not_specialize=[
        "stride_lb", "nq", "nk", "window", "num_groups",
    ]
)  # fmt: skip
def group_prefill_fwd(
    Q, K, V, OUT, LSE,
    QROWS, QCODES, KROWS, KCODES, SEGMENTS, COUNTS, LOW, REAL,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_on, stride_oh,
    stride_lb, stride_ln,
    nq, nk, window, routing_rows, num_groups,
    scale_log2, cap_scale, cap_log2,
    REP: tl.constexpr, QPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, COUNT_STEP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_PADDING: tl.constexpr, WRITE_LSE: tl.constexpr,
    EXACT: tl.constexpr,
):  # fmt: skip
    """Forward of one query tile (see the module docstring). Grid:
    ``(ceil(Nq / QPT), H_kv, B)``."""
    b = tl.program_id(2).to(tl.int64)
    kvh = tl.program_id(1)
    route = b * routing_rows + kvh % routing_rows  # (batch element, routing row)
    rows, row_ok, qi, qcode, qpos = _tile_rows(QROWS, QCODES, route, tl.program_id(0), nq, nk,
                                               REP, QPT, BLOCK_M)  # fmt: skip
    cols = tl.arange(0, BLOCK_N)
    dcols = tl.arange(0, BLOCK_D)
    head = (kvh * REP + rows % REP).to(tl.int64)
    q = _rows(Q + b * stride_qb + head[:, None] * stride_qh, qi, stride_qn, row_ok, dcols,
              HEAD_DIM, EXACT)  # fmt: skip
    k_base = K + b * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b * stride_vb + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for g in range(0, num_groups):  # group part
        seg, count, member, low = _group_segment(
            g, KROWS, SEGMENTS, COUNTS, LOW, route, row_ok, qcode, qpos, nk, window, num_groups,
            COUNT_STEP)  # fmt: skip
        for n0 in range(0, count, BLOCK_N):
            kj, k_ok, visible = _group_keys(seg, KCODES + route * nk, n0, count, cols, member,
                                            qpos, low, window)  # fmt: skip
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, kj,
                                    k_ok, visible, dcols, scale_log2, cap_scale, cap_log2,
                                    HEAD_DIM, HAS_SOFTCAP, EXACT)  # fmt: skip
    lo, hi, cur, last = _local_span(row_ok, qpos, window, BLOCK_N)  # local part
    while cur <= last:
        kj, k_ok, visible = _local_keys(cur, cols, row_ok, qpos, window, nk, REAL + b * nk,
                                        HAS_PADDING)  # fmt: skip
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, kj,
                                k_ok, visible, dcols, scale_log2, cap_scale, cap_log2,
                                HEAD_DIM, HAS_SOFTCAP, EXACT)  # fmt: skip
        cur = _next_local(lo, hi, cur, row_ok)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = OUT + b * stride_ob + qi[:, None].to(tl.int64) * stride_on
    o_ptrs += head[:, None] * stride_oh + dcols[None, :]
    o_mask = row_ok[:, None] & (dcols[None, :] < HEAD_DIM)
    tl.store(o_ptrs, _to_output(out, OUT.dtype.element_ty), mask=o_mask)
    if WRITE_LSE:
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(LSE + b * stride_lb + qi.to(tl.int64) * stride_ln + head, lse, mask=row_ok)


# --------------------------------------------------------------------------------------
# backward (FlashAttention-2: probabilities recomputed from the saved log-sum-exp)
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows"])
def group_prefill_bwd_delta(
    OUT, DOUT, DLSE, DELTA, n_rows,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """``delta = rowsum(dout * out) - dlse`` in fp32 over contiguous rows ``[B, n_rows, D]``
    (``n_rows = Nq * H``; ``dlse``: the gradient of the log-sum-exp output, when it has
    one). Grid: ``(ceil(n_rows / ROWS), B)``."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < n_rows
    row = tl.program_id(1).to(tl.int64) * n_rows + r
    d = tl.arange(0, BLOCK_D)
    at = row[:, None] * HEAD_DIM + d[None, :]
    mask = ok[:, None] & (d[None, :] < HEAD_DIM)
    o = tl.load(OUT + at, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DOUT + at, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + row, mask=ok, other=0.0)
    tl.store(DELTA + row, delta, mask=ok)


@triton.jit
def _row_stats(LSE, DELTA, qi, head, row_ok, stride_ln):
    """Each row's log-sum-exp in base 2 (0 where it is ``-inf``: no visible key, so every
    probability is masked to 0 anyway) and its ``delta``."""
    at = qi.to(tl.int64) * stride_ln + head
    lse = tl.load(LSE + at, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + at, mask=row_ok, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse * LOG2E), delta


@triton.jit
def _probs_dlogits(q, k, v, do, lse2, delta, visible, scale_log2, cap_scale, cap_log2,
                   HAS_SOFTCAP: tl.constexpr):  # fmt: skip
    """Probabilities ``p [M, N]`` of the visible pairs and the gradient of the loss with
    respect to the scaled logits ``scale * q.k`` (through the softcap when there is one)."""
    s = _base2_logits(q, k, scale_log2, cap_scale, cap_log2, HAS_SOFTCAP)
    p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        t = s / cap_log2  # tanh of the capped logit
        ds = ds * (1.0 - t * t)
    return p, ds


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, kj, k_ok, visible,
             dcols, scale_log2, cap_scale, cap_log2, HEAD_DIM: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    """Add one key tile's share of ``dq / scale``."""
    k = _rows(k_base, kj, stride_kn, k_ok, dcols, HEAD_DIM, EXACT)
    v = _rows(v_base, kj, stride_vn, k_ok, dcols, HEAD_DIM, EXACT)
    _, ds = _probs_dlogits(q, k, v, do, lse2, delta, visible, scale_log2, cap_scale, cap_log2,
                           HAS_SOFTCAP)  # fmt: skip
    return dq + tl.dot(ds.to(k.dtype), k, input_precision="ieee")


@triton.jit(
    do_not_specialize=[
        "stride_lb", "nq", "nk", "window", "num_groups",
    ]
)  # fmt: skip
def group_prefill_bwd_dq(
    Q, K, V, DOUT, LSE, DELTA, DQ,
    QROWS, QCODES, KROWS, KCODES, SEGMENTS, COUNTS, LOW, REAL,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_on, stride_oh,
    stride_lb, stride_ln,
    stride_dqb, stride_dqh, stride_dqn,
    nq, nk, window, routing_rows, num_groups,
    scale, scale_log2, cap_scale, cap_log2,
    REP: tl.constexpr, QPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, COUNT_STEP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_PADDING: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """``dq`` of one query tile over the forward's key tiles (``DQ`` has strides of its
    own, ``stride_dq*``; ``DOUT`` is token-major like the output; ``LSE``/``DELTA``
    ``[B, Nq, H]``). Grid: ``(ceil(Nq / QPT), H_kv, B)``."""
    b = tl.program_id(2).to(tl.int64)
    kvh = tl.program_id(1)
    route = b * routing_rows + kvh % routing_rows
    rows, row_ok, qi, qcode, qpos = _tile_rows(QROWS, QCODES, route, tl.program_id(0), nq, nk,
                                               REP, QPT, BLOCK_M)  # fmt: skip
    cols = tl.arange(0, BLOCK_N)
    dcols = tl.arange(0, BLOCK_D)
    head = (kvh * REP + rows % REP).to(tl.int64)
    q_rows = Q + b * stride_qb + head[:, None] * stride_qh
    q = _rows(q_rows, qi, stride_qn, row_ok, dcols, HEAD_DIM, EXACT)
    do = _rows(DOUT + b * stride_ob + head[:, None] * stride_oh, qi, stride_on, row_ok, dcols,
               HEAD_DIM, EXACT)  # fmt: skip
    lse2, delta = _row_stats(LSE + b * stride_lb, DELTA + b * stride_lb, qi, head, row_ok,
                             stride_ln)  # fmt: skip
    k_base = K + b * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b * stride_vb + kvh.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for g in range(0, num_groups):
        seg, count, member, low = _group_segment(
            g, KROWS, SEGMENTS, COUNTS, LOW, route, row_ok, qcode, qpos, nk, window, num_groups,
            COUNT_STEP)  # fmt: skip
        for n0 in range(0, count, BLOCK_N):
            kj, k_ok, visible = _group_keys(seg, KCODES + route * nk, n0, count, cols, member,
                                            qpos, low, window)  # fmt: skip
            dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, kj, k_ok,
                          visible, dcols, scale_log2, cap_scale, cap_log2, HEAD_DIM,
                          HAS_SOFTCAP, EXACT)  # fmt: skip
    lo, hi, cur, last = _local_span(row_ok, qpos, window, BLOCK_N)
    while cur <= last:
        kj, k_ok, visible = _local_keys(cur, cols, row_ok, qpos, window, nk, REAL + b * nk,
                                        HAS_PADDING)  # fmt: skip
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, kj, k_ok,
                      visible, dcols, scale_log2, cap_scale, cap_log2, HEAD_DIM, HAS_SOFTCAP,
                      EXACT)  # fmt: skip
        cur = _next_local(lo, hi, cur, row_ok)
    mask = row_ok[:, None] & (dcols[None, :] < HEAD_DIM)
    ptrs = DQ + b * stride_dqb + head[:, None] * stride_dqh
    ptrs += qi[:, None].to(tl.int64) * stride_dqn + dcols[None, :]
    tl.store(ptrs, _to_output(dq * scale, DQ.dtype.element_ty), mask=mask)


@triton.jit
def _query_segment(g, QROWS, SEGMENTS, COUNTS, LOW, route, kj, kcode, k_ok, nq, nk, window,
                   num_groups, COUNT_STEP: tl.constexpr):  # fmt: skip
    """Group ``g`` for a key tile: its segment of the group-sorted query layout, the slots
    to read (``start``: no earlier query is ``window`` positions after a key of the tile
    that holds ``g``, up to the count table's step; ``total``: the group's queries), the
    keys that hold ``g`` and each key's groups below ``g``."""
    member = k_ok & (((kcode >> g) & 1) != 0)
    first = tl.min(tl.where(member, kj, nk)) + window - (nk - nq)  # first query that may see
    n_counts = (nq + COUNT_STEP - 1) // COUNT_STEP
    at = route * n_counts * num_groups + g
    total = tl.load(COUNTS + at + (n_counts - 1) * num_groups)
    steps = tl.minimum(tl.maximum(first, 0), nq) // COUNT_STEP  # whole steps before `first`
    start = tl.where(steps > 0, tl.load(COUNTS + at + (tl.maximum(steps, 1) - 1) * num_groups), 0)
    start = tl.where(tl.max(member.to(tl.int32)) > 0, start, total)
    seg = QROWS + route * (nq * num_groups + 1) + tl.load(SEGMENTS + route * num_groups + g)
    return seg, start, total, member, kcode & tl.load(LOW + g)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DOUT, LSE, DELTA, stride_qh, stride_qn, stride_oh, stride_on,
               stride_ln, qi, head, row_ok, visible, dcols, scale_log2, cap_scale, cap_log2,
               HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    """Add one query tile's share of ``dk / scale`` and ``dv`` (``Q``, ``DOUT``, ``LSE``,
    ``DELTA`` at the batch element)."""
    q = _rows(Q + head[:, None] * stride_qh, qi, stride_qn, row_ok, dcols, HEAD_DIM, EXACT)
    do = _rows(DOUT + head[:, None] * stride_oh, qi, stride_on, row_ok, dcols, HEAD_DIM, EXACT)
    lse2, delta = _row_stats(LSE, DELTA, qi, head, row_ok, stride_ln)
    p, ds = _probs_dlogits(q, k, v, do, lse2, delta, visible, scale_log2, cap_scale, cap_log2,
                           HAS_SOFTCAP)  # fmt: skip
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    return dk, dv


@triton.jit
def _key_local_span(kj, k_real, nq, nk, window, QPT: tl.constexpr):
    """Per key the first and last query tile (``QPT`` queries in token order) of the queries
    whose window holds it (``has``: some query does), and the tile range of the key tile."""
    t_lo = tl.maximum(kj - (nk - nq), 0)
    t_hi = tl.minimum(kj + window - 1 - (nk - nq), nq - 1)
    has = k_real & (t_lo <= t_hi)
    lo = t_lo // QPT
    hi = t_hi // QPT
    return lo, hi, has, tl.min(tl.where(has, lo, NO_TILE)), tl.max(tl.where(has, hi, -1))


@triton.jit
def _group_queries(seg, query_codes, m0, total, rows, member, kj, low, nq, nk, window,
                   REP: tl.constexpr, QPT: tl.constexpr):  # fmt: skip
    """Query tile at slot ``m0`` of a group's query segment (``QPT`` queries times ``REP``
    heads): query indices, which rows exist, and the visible pairs with the key tile."""
    slot = m0 + rows // REP
    row_ok = (rows // REP < QPT) & (slot < total)
    qi = tl.load(seg + slot, mask=row_ok, other=0)
    qcode = tl.load(query_codes + qi, mask=row_ok, other=0)
    visible = row_ok[:, None] & member[None, :]
    visible &= kj[None, :] <= qi[:, None] + (nk - nq) - window
    visible &= (qcode[:, None] & low[None, :]) == 0
    return qi, row_ok, visible


@triton.jit
def _local_queries(cur, rows, has, kj, nq, nk, window, REP: tl.constexpr, QPT: tl.constexpr):
    """Query tile ``cur`` in token order: query indices, which rows exist, and the pairs
    ``0 <= i - j < window`` with the key tile's keys that some query sees (``has``)."""
    qi = cur * QPT + rows // REP
    row_ok = (rows // REP < QPT) & (qi < nq)
    qpos = qi + (nk - nq)
    visible = row_ok[:, None] & has[None, :] & (kj[None, :] <= qpos[:, None])
    visible &= kj[None, :] > qpos[:, None] - window
    return qi, row_ok, visible


@triton.jit
def _key_tile(KROWS, KCODES, real, route, nk, BLOCK_N: tl.constexpr, HAS_PADDING: tl.constexpr):
    """The keys of this program's tile of the keys' class layout: indices, group codes,
    which exist and which are real."""
    slot = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = slot < nk
    kj = tl.load(KROWS + route * nk + slot, mask=k_ok, other=0)
    kcode = tl.load(KCODES + route * nk + slot, mask=k_ok, other=0)
    k_real = k_ok
    if HAS_PADDING:
        k_real &= tl.load(real + kj, mask=k_ok, other=0) != 0
    return kj, kcode, k_ok, k_real


@triton.jit(
    do_not_specialize=[
        "stride_lb", "nq", "nk", "window", "num_groups",
    ]
)  # fmt: skip
def group_prefill_bwd_dkdv(
    Q, K, V, DOUT, LSE, DELTA, DK, DV,
    KROWS, KCODES, QROWS, QCODES, SEGMENTS, COUNTS, LOW, REAL,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_on, stride_oh,
    stride_lb, stride_ln,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    nq, nk, window, routing_rows, num_groups,
    scale, scale_log2, cap_scale, cap_log2,
    REP: tl.constexpr, QPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, COUNT_STEP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_PADDING: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """``dk`` and ``dv`` of one key tile of the keys' class layout (``KROWS``/``KCODES``),
    over the query tiles of the group-sorted query layout (``QROWS``, ``SEGMENTS``,
    ``COUNTS``; ``QCODES`` per query) and the queries whose window holds its keys, summed
    over the ``REP`` query heads (``DK``/``DV`` have strides of their own). Grid:
    ``(ceil(Nk / BLOCK_N), H_kv, B)``."""
    b = tl.program_id(2).to(tl.int64)
    kvh = tl.program_id(1)
    route = b * routing_rows + kvh % routing_rows
    rows = tl.arange(0, BLOCK_M)
    dcols = tl.arange(0, BLOCK_D)
    kj, kcode, k_ok, k_real = _key_tile(KROWS, KCODES, REAL + b * nk, route, nk, BLOCK_N,
                                        HAS_PADDING)  # fmt: skip
    k_at = K + b * stride_kb + kvh.to(tl.int64) * stride_kh
    v_at = V + b * stride_vb + kvh.to(tl.int64) * stride_vh
    k = _rows(k_at, kj, stride_kn, k_ok, dcols, HEAD_DIM, EXACT)
    v = _rows(v_at, kj, stride_vn, k_ok, dcols, HEAD_DIM, EXACT)
    head = (kvh * REP + rows % REP).to(tl.int64)
    q_b, o_b = Q + b * stride_qb, DOUT + b * stride_ob
    l_b, d_b = LSE + b * stride_lb, DELTA + b * stride_lb
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, num_groups):
        seg, start, total, member, low = _query_segment(
            g, QROWS, SEGMENTS, COUNTS, LOW, route, kj, kcode, k_ok, nq, nk, window, num_groups,
            COUNT_STEP)  # fmt: skip
        for m0 in range(start, total, QPT):
            qi, row_ok, visible = _group_queries(
                seg, QCODES + route * nq, m0, total, rows, member, kj, low, nq, nk, window, REP,
                QPT)  # fmt: skip
            dk, dv = _dkdv_step(dk, dv, k, v, q_b, o_b, l_b, d_b, stride_qh, stride_qn,
                                stride_oh, stride_on, stride_ln, qi, head, row_ok, visible,
                                dcols, scale_log2, cap_scale, cap_log2, HEAD_DIM, HAS_SOFTCAP,
                                EXACT)  # fmt: skip
    lo, hi, has, cur, last = _key_local_span(kj, k_real, nq, nk, window, QPT)
    while cur <= last:
        qi, row_ok, visible = _local_queries(cur, rows, has, kj, nq, nk, window, REP, QPT)
        dk, dv = _dkdv_step(dk, dv, k, v, q_b, o_b, l_b, d_b, stride_qh, stride_qn, stride_oh,
                            stride_on, stride_ln, qi, head, row_ok, visible, dcols, scale_log2,
                            cap_scale, cap_log2, HEAD_DIM, HAS_SOFTCAP, EXACT)  # fmt: skip
        cur = _next_local(lo, hi, cur, has)
    mask = k_ok[:, None] & (dcols[None, :] < HEAD_DIM)
    at = kj[:, None].to(tl.int64) * stride_dkn + dcols[None, :]
    tl.store(DK + b * stride_dkb + kvh.to(tl.int64) * stride_dkh + at,
             _to_output(dk * scale, DK.dtype.element_ty), mask=mask)  # fmt: skip
    at = kj[:, None].to(tl.int64) * stride_dvn + dcols[None, :]
    tl.store(DV + b * stride_dvb + kvh.to(tl.int64) * stride_dvh + at,
             _to_output(dv, DV.dtype.element_ty), mask=mask)  # fmt: skip
