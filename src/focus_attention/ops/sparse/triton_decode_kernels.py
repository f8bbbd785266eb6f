"""The Triton kernels of :func:`~.triton_decode.bucket_decode` (docs/method.md §5, "Decoding").

Imported on the first launch only (by :mod:`.triton_decode`, which builds the launches:
:func:`~.triton_decode.decode_launches`): Triton decides between compiling and interpreting
(``TRITON_INTERPRET=1``) when a kernel is defined.

:func:`decode_partials` runs one program per (row, key-value head, query, block of its query
heads) and split. A program loads the query rows of the key-value head's ``rep`` query heads
(one ``tl.dot`` operand, padded to 16 rows), then reads its share of the keys: the window
(positions ``max(0, pos - window + 1) .. pos``) and, for each group of the query, the bucket
entries older than the window (``j <= pos - window``). A key shared with the query through
several groups is taken in the lowest shared group only, so every visible key is counted
once. Online softmax in float32. :func:`decode_merge` merges the splits' partial
``(out, lse)`` by log-sum-exp. Lengths, window, capacity and strides are runtime arguments
that Triton does not specialise on, so a kernel compiles once per dtype, ``head_dim``, query
heads per block and flags, whatever the cache length. Offsets that grow with the batch, the
cache or the query count are computed in int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["decode_merge", "decode_partials"]


@triton.jit
def _tanh(x):
    """``tanh(x)`` from ``exp`` (no overflow: ``exp(-2|x|) <= 1``)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """``a @ b`` with float32 sums. ``DOT``: 0, the inputs' dtype (half inputs: exact
    products on tensor cores); 1, float32 inputs without TF32 rounding; 2, half inputs
    converted to float32 first, the same products (a half times a half is exact in float32)
    for Triton's interpreter, whose bfloat16 ``tl.dot`` multiplies the raw bits (Triton 3.7)."""
    if DOT == 1:
        c = tl.dot(a, b, input_precision="ieee")
    elif DOT == 2:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _weighted_values(p, v, DOT: tl.constexpr):
    """``p @ v`` for float32 weights ``p``. Half values: the weights split into two terms of
    the values' dtype, ``p = hi + lo`` to about ``2**-16`` relative, two tensor-core products
    (a single rounding of ``p`` would cost ``2**-9`` for bfloat16)."""
    if DOT == 1:
        c = _dot(p, v, DOT)
    else:
        hi = p.to(v.dtype)
        c = _dot(hi, v, DOT) + _dot((p - hi.to(tl.float32)).to(v.dtype), v, DOT)
    return c


@triton.jit
def _attend(q, k_rows, v_rows, keys, ok, m_i, l_i, acc, d_off, d_ok, stride_kn, stride_kd,
            stride_vn, stride_vd, scale, softcap, SOFTCAP: tl.constexpr,
            DOT: tl.constexpr):  # fmt: skip
    """One block of keys at positions ``keys`` (``ok``: visible) folded into the online
    softmax state ``(m_i, l_i, acc)`` of the query rows ``q``."""
    kv_mask = ok[:, None] & d_ok[None, :]
    keys = keys.to(tl.int64)
    k = tl.load(k_rows + keys[:, None] * stride_kn + d_off[None, :] * stride_kd, mask=kv_mask,
                other=0.0)  # fmt: skip
    s = _dot(q, tl.trans(k), DOT) * scale
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_rows + keys[:, None] * stride_vn + d_off[None, :] * stride_vd, mask=kv_mask,
                other=0.0)  # fmt: skip
    acc = acc * alpha[:, None] + _weighted_values(p, v, DOT)
    return m_new, l_i, acc


@triton.jit
def _older_entries(entries, count, newest, span, stride_ie, BLOCK_N: tl.constexpr):
    """How many of a bucket's ``count`` increasing entries are ``<= newest``: the entries
    above it are among the last ``span``, so only those are read."""
    start = tl.maximum(count - span, 0)
    above = 0
    for e0 in range(start, count, BLOCK_N):
        e = e0 + tl.arange(0, BLOCK_N)
        ok = e < count
        pos = tl.load(entries + e.to(tl.int64) * stride_ie, mask=ok, other=0)
        above += tl.sum((ok & (pos > newest)).to(tl.int32), axis=0)
    return count - above


@triton.jit
def _window_part(q, k_rows, v_rows, pad_row, pos, window, split, num_splits, m_i, l_i, acc,
                 d_off, d_ok, stride_kn, stride_kd, stride_vn, stride_vd, stride_pn, scale,
                 softcap, BLOCK_N: tl.constexpr, HAS_PAD: tl.constexpr, SOFTCAP: tl.constexpr,
                 DOT: tl.constexpr):  # fmt: skip
    """This split's share of the window: keys ``max(0, pos - window + 1) .. pos``."""
    low = tl.maximum(pos - window + 1, 0)
    share = tl.cdiv(tl.maximum(pos + 1 - low, 0), num_splits)
    start = low + split * share
    stop = tl.minimum(start + share, pos + 1)
    for n0 in range(start, stop, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        ok = keys < stop
        if HAS_PAD:
            real = tl.load(pad_row + keys.to(tl.int64) * stride_pn, mask=ok, other=0)
            ok = ok & (real != 0)
        m_i, l_i, acc = _attend(q, k_rows, v_rows, keys, ok, m_i, l_i, acc, d_off, d_ok,
                                stride_kn, stride_kd, stride_vn, stride_vd, scale, softcap,
                                SOFTCAP, DOT)  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _group_part(q, k_rows, v_rows, pad_row, entries, count, code_row, qcode, group, newest,
                span, split, num_splits, m_i, l_i, acc, d_off, d_ok, stride_kn, stride_kd,
                stride_vn, stride_vd, stride_pn, stride_ie, stride_sn, scale, softcap,
                BLOCK_N: tl.constexpr, HAS_PAD: tl.constexpr, SOFTCAP: tl.constexpr,
                DOT: tl.constexpr):  # fmt: skip
    """This split's share of the bucket of ``group`` older than the window (entries at
    positions ``<= newest``), less the keys that share a lower group with the query."""
    older = _older_entries(entries, count, newest, span, stride_ie, BLOCK_N)
    share = tl.cdiv(older, num_splits)
    start = split * share
    stop = tl.minimum(start + share, older)
    lower = qcode & ((tl.full((), 1, tl.int64) << group) - 1)
    for e0 in range(start, stop, BLOCK_N):
        e = e0 + tl.arange(0, BLOCK_N)
        ok = e < stop
        keys = tl.load(entries + e.to(tl.int64) * stride_ie, mask=ok, other=0)
        # a key is read in its lowest group shared with the query (no load for one group)
        code = tl.load(code_row + keys.to(tl.int64) * stride_sn, mask=ok & (lower != 0),
                       other=0)  # fmt: skip
        ok = ok & ((code & lower) == 0)
        if HAS_PAD:
            real = tl.load(pad_row + keys.to(tl.int64) * stride_pn, mask=ok, other=0)
            ok = ok & (real != 0)
        m_i, l_i, acc = _attend(q, k_rows, v_rows, keys, ok, m_i, l_i, acc, d_off, d_ok,
                                stride_kn, stride_kd, stride_vn, stride_vd, scale, softcap,
                                SOFTCAP, DOT)  # fmt: skip
    return m_i, l_i, acc


#: integer arguments that vary between calls of one model (they depend on the cache's
#: capacity or the call's split count): not specialised on, so no recompilation
_VARYING = [
    "capacity", "window", "num_splits", "stride_kb", "stride_kh", "stride_vb", "stride_vh",
    "stride_sb", "stride_sr", "stride_ib", "stride_ir", "stride_ig", "stride_pb", "stride_ot",
    "stride_oh", "stride_ob", "stride_lb", "stride_lt", "stride_lh",
]  # fmt: skip


@triton.jit(do_not_specialize=_VARYING)
def decode_partials(
    Q, K, V, QCODE, CODES, INDEX, COUNT, LENGTHS, PAD, OUT, LSE,
    num_queries, kv_heads, rep, head_blocks, capacity, window, num_groups, num_splits,
    scale, softcap,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_cb, stride_cr, stride_ct,
    stride_sb, stride_sr, stride_sn, stride_ib, stride_ir, stride_ig, stride_ie,
    stride_nb, stride_nr, stride_ng, stride_pb, stride_pn,
    stride_ob, stride_ot, stride_oh, stride_os, stride_od,
    stride_lb, stride_lt, stride_lh, stride_ls,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PER_HEAD: tl.constexpr, HAS_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """One program per (row, key-value head, query, block of query heads) along the grid's
    x axis (in that order, the last fastest) and per split along y."""
    pid = tl.program_id(0)
    per_head = num_queries * head_blocks
    t = (pid % per_head) // head_blocks
    t_at = t.to(tl.int64)  # times strides
    rows = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    b = (pid // per_head // kv_heads).to(tl.int64)
    kv = (pid // per_head % kv_heads).to(tl.int64)
    r = kv if PER_HEAD else 0
    d_off = tl.arange(0, BLOCK_D).to(tl.int64)  # times the last dimension's strides
    d_ok = d_off < HEAD_DIM
    row_ok = rows < rep
    heads = kv * rep + rows
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + t_at * stride_qt
                + d_off[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)  # fmt: skip
    length = tl.minimum(tl.maximum(tl.load(LENGTHS + b).to(tl.int32), 0), capacity)
    pos = length - num_queries + t
    qcode = tl.load(QCODE + b * stride_cb + r * stride_cr + t_at * stride_ct)
    k_rows = K + b * stride_kb + kv * stride_kh
    v_rows = V + b * stride_vb + kv * stride_vh
    pad_row = PAD + b * stride_pb
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i, l_i, acc = _window_part(q, k_rows, v_rows, pad_row, pos, window, split, num_splits,
                                 m_i, l_i, acc, d_off, d_ok, stride_kn, stride_kd, stride_vn,
                                 stride_vd, stride_pn, scale, softcap, BLOCK_N, HAS_PAD,
                                 SOFTCAP, DOT)  # fmt: skip
    newest = pos - window  # the newest key older than the window
    span = window + num_queries - 1  # the bucket entries newer than it are among the last span
    for g in range(num_groups):
        if (((qcode >> g) & 1) != 0) & (newest >= 0):
            at = g + tl.zeros((), tl.int64)  # the group as an int64 offset
            entries = INDEX + b * stride_ib + r * stride_ir + at * stride_ig
            count = tl.load(COUNT + b * stride_nb + r * stride_nr + at * stride_ng)
            m_i, l_i, acc = _group_part(q, k_rows, v_rows, pad_row, entries, count,
                                        CODES + b * stride_sb + r * stride_sr, qcode, g,
                                        newest, span, split, num_splits, m_i, l_i, acc, d_off,
                                        d_ok, stride_kn, stride_kd, stride_vn, stride_vd,
                                        stride_pn, stride_ie, stride_sn, scale, softcap,
                                        BLOCK_N, HAS_PAD, SOFTCAP, DOT)  # fmt: skip
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    split_at = split.to(tl.int64)
    o_rows = OUT + b * stride_ob + t_at * stride_ot + split_at * stride_os + heads * stride_oh
    tl.store(o_rows[:, None] + d_off[None, :] * stride_od, out,
             mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
    tl.store(LSE + b * stride_lb + t_at * stride_lt + split_at * stride_ls + heads * stride_lh, lse,
             mask=row_ok)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def decode_merge(OP, LP, OUT, LSE, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
    """Merge the splits of one (row, query, head): contiguous partials ``[S, D]`` and
    ``[S]`` into ``out [D]`` (the output's dtype) and ``lse``, ``BLOCK_D`` columns at a
    time (so that a tile of ``BLOCK_S x BLOCK_D`` partials stays in registers)."""
    p = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse_s = tl.load(LP + p * num_splits + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, axis=0)
    norm = tl.where(total > 0.0, total, 1.0)
    rows = OP + (p * num_splits + s[:, None]) * HEAD_DIM
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        part = tl.load(rows + d[None, :], mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        out = tl.sum(w[:, None] * part, axis=0) / norm
        tl.store(OUT + p * HEAD_DIM + d, out, mask=d < HEAD_DIM)
    tl.store(LSE + p, tl.where(total > 0.0, m + tl.log(norm), float("-inf")))
