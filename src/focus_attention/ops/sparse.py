"""Exact sparse attention for hard top-k routing (spec section 5).

The Focus mask is split into disjoint parts; each part runs as standard attention and the
parts are merged by log-sum-exp (an empty part has log-sum-exp ``-inf`` and weight 0):

- **group part** (pairs that share at least one group): queries are partitioned by their
  exact membership set S; class S attends causally to the real keys of every group in S,
  gathered as one sorted union list (a key sharing several groups appears once, so every
  pair is counted once). With ``top_k = 1`` each class is one group whose query and key
  lists coincide: plain ``is_causal`` attention. With more than ``MAX_CLASSES`` classes,
  each pair is instead assigned to the lowest group the two tokens share (masked).
- **local part** (pairs inside the window that share no group): a narrow band, in batched
  blocks over strided views, with a boolean mask.

A causal problem between a sorted query list and a sorted key list (a "staircase") runs in
query blocks x key chunks: the keys before a block's first query are unmasked, only the
strip up to its last query is masked, and on a coinciding (prefill) list the diagonal block
is ``is_causal``. Memory is linear in N for fixed block sizes; no ``Nq x Nk`` or
per-group quadratic tensor is built.

Backends: ``cpu_fused`` is this package's C++ kernel (``csrc/focus_cpu.cpp``, built on
first use): the same two parts, each tile gathered into fp32 buffers and run
flash-attention style with MKL's sgemm, with no intermediate results in Python; it is the
fastest CPU path. ``cpu_flash`` runs the parts as calls of PyTorch's CPU flash-attention
kernel (native GQA, log-sum-exp output). Both are inference only. The ``math`` backend is
blocked, differentiable and runs on any device and dtype.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from . import _extension
from ._checks import check_device, check_int, check_positive, fail
from .gates import _check_qkv
from .masks import check_groups, effective_window

Backend = Literal["auto", "cpu_fused", "cpu_flash", "math"]
BACKENDS = ("auto", "cpu_fused", "cpu_flash", "math")

#: most queries per attention call of a staircase; product decision, tuned on CPU (from
#: 768 queries on, PyTorch's CPU flash kernel works in 256-row tiles: 1024 was ~10% faster
#: than 512 at 32K tokens, for ~2 MiB more workspace).
QUERY_BLOCK = 1024
#: keys per masked strip of a staircase whose query and key lists differ (512 was ~10%
#: faster than 256 at top_k = 2: fewer, taller query blocks).
STRIP = 512
#: keys gathered at a time (bounds the workspace: KEY_CHUNK * H_kv * D * 2 elements).
KEY_CHUNK = 2048
#: queries per block of the local band; product decision, tuned on CPU.
BAND_BLOCK = 32
#: initial running log-sum-exp of the in-place merge (a finite stand-in for -inf).
_EMPTY = -1e30
#: most membership classes handled one staircase each (else per-group with masks).
MAX_CLASSES = 64
#: mask elements per batched band call (bounds its memory); product decision.
BAND_ELEMENTS = 1 << 16
#: queries per block inside the math backend's quadratic step.
MATH_BLOCK = 512
#: ``cpu_fused``: query rows (query heads sharing a key head x queries) per group tile, keys
#: per block, queries per local tile; product decision, tuned on CPU at 16-32K tokens in
#: interleaved runs (384 x 128 was as fast as 384 x 256/512 and keeps each thread's tile
#: buffers near 0.4 MiB, so the op's peak memory stays at dense SDPA's).
FUSED_ROWS = 384
FUSED_KEYS = 128
#: most groups ``cpu_fused`` takes (its membership codes are at most 64-bit integers).
FUSED_MAX_GROUPS = 64
#: input dtypes of the CPU backends (``cpu_fused`` computes them in float32).
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FUSED_BAND = 32


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # boolean logic decides visibility; this only converts it to the kernel's format
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def _attend_cpu_flash(q, k, v, mask, causal, scale):
    """One PyTorch CPU flash-attention call (native GQA). ``q [(nb,) H, n, D]``,
    ``k/v [(nb,) H_kv, m, D]``, bool ``mask`` broadcastable to ``[(nb,) 1, n, m]`` or None.
    Returns ``(out like q, lse [(nb,) H, n] float32)``."""
    batched = q.ndim == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    attn_mask = None if mask is None else _float_mask(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale
    )[:2]
    if not batched:
        out, lse = out[0], lse[0]
    lse = lse.float()
    if mask is not None:  # the kernel reports lse 0 and a finite row when nothing is visible
        empty = ~mask.any(dim=-1)
        if bool(empty.any()):
            lse = lse.masked_fill(empty, -math.inf)
            out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def _attend_math(q, k, v, mask, causal, scale, softcap):
    """Differentiable attention, same operands as :func:`_attend_cpu_flash` but with
    ``H_kv == H``; ``O(MATH_BLOCK * m)`` memory per head."""
    n, m = q.shape[-2], k.shape[-2]
    ct = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for gradcheck
    outs, lses = [], []
    for start in range(0, n, MATH_BLOCK):
        stop = min(n, start + MATH_BLOCK)
        hi = min(m, stop) if causal else m
        qb, kb = q[..., start:stop, :].to(ct), k[..., :hi, :].to(ct)
        logits = (qb @ kb.transpose(-1, -2)) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        vis = None
        if causal:
            vis = (
                torch.arange(hi, device=q.device)[None, :]
                <= torch.arange(start, stop, device=q.device)[:, None]
            )
        elif mask is not None:
            vis = mask[..., start:stop, :]
        if vis is not None:
            row_any = vis.any(dim=-1, keepdim=True)
            logits = logits.masked_fill(~vis, -math.inf)
            logits = torch.where(row_any, logits, torch.zeros_like(logits))
        lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - lse[..., None])
        if vis is not None:
            probs = torch.where(row_any, probs, torch.zeros_like(probs))
            lse = torch.where(row_any[..., 0], lse, torch.full_like(lse, -math.inf))
        outs.append((probs @ v[..., :hi, :].to(ct)).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


class _Collect:
    """Partial results ``(query index, out, lse)`` kept for one differentiable merge."""

    def __init__(self, num_heads: int, nq: int, d: int, dtype: torch.dtype, device) -> None:
        self.h, self.nq, self.d, self.dtype, self.device = num_heads, nq, d, dtype, device
        self.idx: list[torch.Tensor] = []
        self.out: list[torch.Tensor] = []
        self.lse: list[torch.Tensor] = []

    def add(self, idx: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, fresh=False) -> None:
        if idx.numel():
            self.idx.append(idx)
            self.out.append(out)
            self.lse.append(lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-sum-exp merge of disjoint parts; a query with no part outputs 0, lse -inf."""
        h, nq, d = self.h, self.nq, self.d
        if not self.idx:
            zeros = torch.zeros(h, nq, d, dtype=self.dtype, device=self.device)
            return zeros, torch.full((h, nq), -math.inf, device=self.device)
        idx = torch.cat(self.idx)
        lse = torch.cat(self.lse, dim=1)  # [H, P] fp32 (fp64 under gradcheck)
        ct = lse.dtype
        out = torch.cat(self.out, dim=1).to(ct)  # [H, P, D]
        index = idx[None].expand(h, -1)
        peak = torch.full((h, nq), -math.inf, device=self.device, dtype=ct)
        peak = peak.scatter_reduce(1, index, lse.detach(), "amax")
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        w = torch.exp(lse - peak.gather(1, index))  # exactly 0 for empty parts (lse -inf)
        den = torch.zeros(h, nq, device=self.device, dtype=ct).index_add(1, idx, w)
        num = torch.zeros(h, nq, d, device=self.device, dtype=ct)
        num = num.index_add(1, idx, w[..., None] * out)
        has = den > 0
        safe = torch.where(has, den, torch.ones_like(den))
        merged = num / safe[..., None]
        total = torch.where(has, peak + torch.log(safe), torch.full_like(peak, -math.inf))
        return merged.to(self.dtype), total


class _Accumulate:
    """In-place online log-sum-exp merge (inference): memory of one fp32 output.

    The running log-sum-exp starts at a finite sentinel (``_EMPTY``) instead of ``-inf`` so
    the merge weights never see ``-inf - -inf``; exp() of any difference to the sentinel
    underflows to exactly 0, and :meth:`finish` turns untouched rows back into ``-inf``.
    """

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> None:
        """Token-major fp32 buffers ``out [Nq, H, D]`` and ``lse [Nq, H]``, overwritten (the
        caller's output when the inputs are fp32, so no second copy is made). Token-major
        rows make the gathers and scatters of :meth:`add` contiguous copies."""
        self.dtype = dtype
        self.out = out.zero_()
        self.lse = lse.fill_(_EMPTY)

    def add(
        self, idx: torch.Tensor | slice, out: torch.Tensor, lse: torch.Tensor, fresh=False
    ) -> None:
        """Merge one part: ``out [H, n, D]``, ``lse [H, n]`` for the queries ``idx``.
        ``fresh``: no earlier part touched these rows, so the part is copied, not merged."""
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)  # [n, H, D], [n, H] views
        rows = isinstance(idx, slice)
        if fresh:  # staircase pieces: ``idx`` is an index tensor
            self.out.index_copy_(0, idx, out.to(self.out.dtype))
            self.lse.index_copy_(0, idx, lse.clamp_min(_EMPTY))  # empty rows keep the sentinel
            return
        old = self.lse[idx] if rows else self.lse.index_select(0, idx)
        new = torch.logaddexp(old, lse)  # finite: old is
        w_old = torch.exp(old - new)[..., None]
        w_new = torch.exp(lse - new)[..., None]  # 0 where the part is empty (lse -inf)
        acc = self.out[idx] if rows else self.out.index_select(0, idx)
        acc.mul_(w_old).addcmul_(out, w_new)
        if rows:
            self.lse[idx] = new
        else:
            self.out.index_copy_(0, idx, acc)
            self.lse.index_copy_(0, idx, new)

    def finish(self) -> None:
        self.lse.masked_fill_(self.lse <= _EMPTY / 2, -math.inf)


class _Runner:
    """Runs the causal sub-problems of one batch element on the chosen backend."""

    def __init__(self, q, k, v, scale, softcap, backend):
        self.q, self.k, self.v = q, k, v  # [H, Nq, D], [H_kv, Nk, D]
        self.scale, self.softcap, self.backend = scale, softcap, backend

    def attend(self, q, k, v, mask, causal):
        """``q [..., H, n, D]``, ``k/v [..., H_kv, m, D]``, bool ``mask [..., n, m]`` or None."""
        if self.backend == "math":
            rep = q.shape[-3] // k.shape[-3]
            if rep > 1:
                k = k.repeat_interleave(rep, dim=-3)
                v = v.repeat_interleave(rep, dim=-3)
            return _attend_math(q, k, v, mask, causal, self.scale, self.softcap)
        return _attend_cpu_flash(q, k, v, mask, causal, self.scale)

    def staircase(self, acc, qidx, qpos, kidx, kpos, q_excl=None, k_excl=None, fresh=False) -> bool:
        """Causal attention (key visible iff its position <= the query's) between a sorted
        query list and a sorted key list, both given as indices and absolute positions.
        With ``q_excl [n, E]`` / ``k_excl [m, E]`` (bool), a pair that shares any of the E
        features is also excluded. ``fresh``: no part touched these queries yet (each
        block's first piece is then copied into the accumulator instead of merged).
        Returns whether any piece was added.

        Queries go in blocks of at most ``QUERY_BLOCK`` whose last visible keys fall in the
        same ``STRIP`` keys; keys are gathered ``KEY_CHUNK`` at a time. Each block sees the
        keys before its first query's horizon unmasked; only the strip between its first
        and last horizon is masked. When the two lists coincide (prefill) blocks are
        aligned on ``QUERY_BLOCK`` and the diagonal block runs as ``is_causal``.
        """
        n, m = qidx.numel(), kidx.numel()
        if n == 0 or m == 0:
            return False
        equal = q_excl is None and n == m and torch.equal(qpos, kpos)
        if q_excl is not None:
            q_excl, k_excl = q_excl.float(), k_excl.float()
        visible = torch.arange(1, n + 1) if equal else torch.searchsorted(kpos, qpos, right=True)
        strip = QUERY_BLOCK if equal else STRIP
        group = (visible - 1).div(strip, rounding_mode="floor")  # -1: sees no key
        edges = torch.searchsorted(group, torch.arange(0, -(-m // strip) + 1)).tolist()
        blocks = []  # (first row, end row, keys all rows see, keys the last row sees)
        for c in range(len(edges) - 1):
            for s in range(edges[c], edges[c + 1], QUERY_BLOCK):
                e = min(edges[c + 1], s + QUERY_BLOCK)
                lo = s if equal else int(visible[s])
                blocks.append((s, e, lo, int(visible[e - 1])))
        touched: set[int] = set()  # blocks (by first row) that have a piece
        for k0 in range(0, m, KEY_CHUNK):
            k1 = min(m, k0 + KEY_CHUNK)
            todo = [blk for blk in blocks if blk[3] > k0]
            if not todo:
                break
            k_c = self.k.index_select(1, kidx[k0:k1])
            v_c = self.v.index_select(1, kidx[k0:k1])
            for s, e, lo, hi in todo:
                q = self.q.index_select(1, qidx[s:e])
                pieces = []
                full = min(k1, lo)
                if full > k0:  # keys every row of the block sees
                    mask = None
                    if q_excl is not None:
                        mask = (q_excl[s:e] @ k_excl[k0:full].t()) == 0
                    a, b = 0, full - k0
                    pieces.append(self.attend(q, k_c[:, a:b], v_c[:, a:b], mask, False))
                s0, s1 = max(k0, lo), min(k1, hi)
                if s1 > s0:  # the strip: causal mask (or is_causal on the diagonal)
                    a, b = s0 - k0, s1 - k0
                    if equal:
                        pieces.append(self.attend(q, k_c[:, a:b], v_c[:, a:b], None, True))
                    else:
                        mask = kpos[None, s0:s1] <= qpos[s:e, None]
                        if q_excl is not None:
                            mask &= (q_excl[s:e] @ k_excl[s0:s1].t()) == 0
                        pieces.append(self.attend(q, k_c[:, a:b], v_c[:, a:b], mask, False))
                for out, lse in pieces:
                    acc.add(qidx[s:e], out, lse, fresh and s not in touched)
                    touched.add(s)
        return bool(touched)

    def band(self, acc, qg, kg, real, offset: int, window: int) -> None:
        """Local pairs (``0 <= i - j < window``) that share no group, as batched blocks of
        ``BAND_BLOCK`` queries against the ``BAND_BLOCK + window - 1`` keys ending at each
        block's last query."""
        h, nq, d = self.q.shape
        h_kv, nk = self.k.shape[0], self.k.shape[1]
        device = qg.device
        bq = BAND_BLOCK
        width = min(bq + window - 1, nk + bq - 1)
        # distance query row r -> key column c is the same in every block
        dist = torch.arange(bq, device=device)[:, None] - torch.arange(width, device=device)
        dist = dist + (width - bq)
        base = (dist >= 0) & (dist < window)  # [bq, width]
        per_call = max(1, BAND_ELEMENTS // (bq * width))  # blocks per call: bounded memory
        nblk = -(-nq // bq)
        qgf, kgf = qg.float(), kg.float()
        cols = torch.arange(width, device=device)
        for b0 in range(0, nblk, per_call):
            b1 = min(nblk, b0 + per_call)
            s, e, nb = b0 * bq, min(nq, b1 * bq), b1 - b0
            t = torch.arange(s, b1 * bq, device=device).view(nb, bq)  # query indices
            tc = t.clamp(max=nq - 1)
            j = (offset + t[:, -1:] - width + 1) + cols  # [nb, width] key positions
            jc = j.clamp(0, nk - 1)
            valid = (j >= 0) & (j < nk)
            if real is not None:
                valid &= real[jc]
            share = torch.bmm(qgf[tc], kgf[jc].transpose(1, 2)) > 0  # [nb, bq, width]
            mask = base & valid[:, None, :] & ~share
            mask &= (t < nq)[:, :, None]
            if not bool(mask.any()):
                continue
            if int(j[0, 0]) >= 0 and int(j[-1, -1]) < nk and e - s == nb * bq:
                # interior blocks: overlapping strided views, no copies
                q = _blocks(self.q, s, nb, bq, bq)
                k = _blocks(self.k, int(j[0, 0]), nb, width, bq)
                v = _blocks(self.v, int(j[0, 0]), nb, width, bq)
            else:
                q = self.q.index_select(1, tc.reshape(-1)).view(h, nb, bq, d).transpose(0, 1)
                k = self.k.index_select(1, jc.reshape(-1)).view(h_kv, nb, width, d).transpose(0, 1)
                v = self.v.index_select(1, jc.reshape(-1)).view(h_kv, nb, width, d).transpose(0, 1)
            out, lse = self.attend(q, k, v, mask[:, None], False)  # [nb, H, bq, D], [nb, H, bq]
            out = out.transpose(0, 1).reshape(h, nb * bq, d)[:, : e - s]
            lse = lse.transpose(0, 1).reshape(h, nb * bq)[:, : e - s]
            rows = slice(s, e) if isinstance(acc, _Accumulate) else t.reshape(-1)[: e - s]
            acc.add(rows, out, lse)


def _blocks(x: torch.Tensor, start: int, nb: int, length: int, step: int) -> torch.Tensor:
    """``[nb, heads, length, D]`` view of ``x [heads, N, D]``: block ``i`` covers tokens
    ``start + i * step ..`` (blocks may overlap; no copy)."""
    sh, sn, sd = x.stride()
    return x.as_strided(
        (nb, x.shape[0], length, x.shape[2]),
        (step * sn, sh, sn, sd),
        x.storage_offset() + start * sn,
    )


def _membership_classes(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct membership rows of bool ``[N, K]``: ``(classes [C, K], inverse [N])``."""
    k = groups.shape[-1]
    if k > 62:  # no int64 code: compare whole rows (slower)
        return torch.unique(groups, dim=0, return_inverse=True)
    weights = torch.pow(2, torch.arange(k, device=groups.device, dtype=torch.int64))
    codes = (groups.to(torch.int64) * weights).sum(dim=-1)
    uniq, inverse = torch.unique(codes, return_inverse=True)
    classes = (uniq[:, None] & weights) != 0
    return classes, inverse


def _groups(acc, run: _Runner, qg, kg, real, offset: int) -> None:
    """All pairs that share a group, each counted once.

    Queries are partitioned by their exact membership set S; class S attends causally to
    the real keys of every group in S (one sorted union list, so a key sharing several
    groups appears once). With ``top_k = 1`` every class is one group and its query list
    equals its key list: one ``is_causal`` call per group. When there are more than
    ``MAX_CLASSES`` classes (large ``C(K, top_k)``), each pair is instead assigned to the
    lowest group the two tokens share: group g attends to its members, excluding (by mask)
    keys that share a lower group with the query.
    """
    kmember = kg if real is None else kg & real[:, None]
    has_group = qg.any(dim=-1)
    classes, inverse = _membership_classes(qg)
    if classes.shape[0] <= MAX_CLASSES:
        for c in range(classes.shape[0]):
            members = classes[c]
            if not bool(members.any()):
                continue  # queries in no group: local attention only
            qidx = torch.nonzero(inverse == c, as_tuple=True)[0]
            qpos = qidx + offset
            kidx = torch.nonzero(kmember[:, members].any(dim=-1), as_tuple=True)[0]
            # keys that are this class's own queries (in prefill usually all of them: one
            # is_causal problem) apart from the other keys (sink tokens, other groups' members)
            own = torch.isin(kidx, qpos)
            # classes partition the queries and run first: their rows are untouched
            fresh = not run.staircase(acc, qidx, qpos, kidx[own], kidx[own], fresh=True)
            run.staircase(acc, qidx, qpos, kidx[~own], kidx[~own], fresh=fresh)
        return
    for g in range(qg.shape[-1]):
        qidx = torch.nonzero(qg[:, g] & has_group, as_tuple=True)[0]
        kidx = torch.nonzero(kmember[:, g], as_tuple=True)[0]
        if g == 0:
            run.staircase(acc, qidx, qidx + offset, kidx, kidx)
        else:
            run.staircase(acc, qidx, qidx + offset, kidx, kidx, qg[qidx, :g], kmember[kidx, :g])


def fused_kernel_available() -> bool:
    """Whether the ``cpu_fused`` backend can run here (builds the kernel on first call, ~1
    minute once per install, torch version and CPU; product decision). Returns False with a
    ``RuntimeWarning`` that says why when it cannot be built or ``FOCUS_NO_EXTENSION=1``."""
    return _extension.load() is not None


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    window: int,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention under the Focus hard-routing mask, without materialising it.

    Query ``t`` sits at absolute position ``Nk - Nq + t`` (bottom-right aligned: prefill,
    decode with ``Nq = 1`` and chunked prefill). Query ``i`` attends key ``j`` iff ``j <= i``,
    key ``j`` is real, and (``i - j < window`` or the two tokens share at least one group).
    The result equals dense softmax attention under :func:`focus_mask` (spec sections 4-5).
    A query with no visible key (possible only for padding) outputs zeros.

    Args:
        query: ``[B, H, Nq, D]`` float32, bfloat16 or float16.
        key, value: ``[B, H_kv, Nk, D]``, same dtype, ``H % H_kv == 0`` (GQA/MQA).
        query_groups: bool ``[B, Nq, K]`` group memberships (any number per token).
        key_groups: bool ``[B, Nk, K]``.
        window: local window in tokens, ``>= 1`` (counts the query itself).
        scale: logit scale, default ``D ** -0.5``.
        key_padding_mask: optional bool ``[B, Nk]``, True = real token.
        softcap: optional Gemma-2 logit soft-capping ``c * tanh(logits / c)`` (math backend).
        backend: ``"cpu_fused"`` (this package's C++ kernel, built on first use; at most 64
            groups; raises if it cannot be built), ``"cpu_flash"`` (calls of PyTorch's CPU
            flash kernel); both inference only: they raise if an input requires grad.
            ``"math"`` (blocked, differentiable, any device and dtype) or ``"auto"``: for
            CPU float32/bfloat16/float16 inputs without grad and without softcap,
            ``cpu_fused`` if it is available and ``K <= 64``, else ``cpu_flash``;
            otherwise ``math``. ``cpu_fused`` computes in float32 (inputs are converted
            row by row), so it refuses float64.
        return_lse: also return the log-sum-exp ``[B, H, Nq]`` float32 (``-inf`` for a query
            with no visible key).

    Returns:
        ``[B, H, Nq, D]`` in the query's dtype (and the log-sum-exp if asked). On the
        CPU backends it is a transposed view of a token-major ``[B, Nq, H, D]``
        buffer (so ``out.transpose(1, 2)``, the layout transformers expects, is contiguous).
        Under ``torch.compile`` the op runs eagerly (a graph break): inductor compiled it
        wrongly (max error ~2 on a 40-token input), so it is excluded from compilation.

    Raises:
        ValueError: wrong ranks or shapes, mismatched batch/length/K/D, ``H % H_kv != 0``,
            non-boolean group masks, ``window < 1``, ``Nq > Nk``, ``scale`` or ``softcap``
            not a finite number > 0, unknown backend, an inference-only backend with inputs
            that require grad, ``cpu_fused`` with more than 64 groups or float64 inputs,
            tensors on different devices, ``D < 1``.
        RuntimeError: ``backend="cpu_fused"`` when the kernel cannot be built or loaded.
    """
    return _sparse_attention(
        query,
        key,
        value,
        query_groups,
        key_groups,
        window,
        scale,
        key_padding_mask,
        softcap,
        backend,
        return_lse,
    )


# Inductor compiled the op wrongly (errors ~2 when several membership classes exist), and
# torch.compile of a disabled *public* function still traces it: the body sits in this
# disabled helper, so any compiled caller graph-breaks here and the op runs eagerly.
@torch.compiler.disable
def _sparse_attention(
    query,
    key,
    value,
    query_groups,
    key_groups,
    window,
    scale,
    key_padding_mask,
    softcap,
    backend,
    return_lse,
):
    _check_qkv(query, key, value)
    bsz, nq, nk, _ = check_groups(query_groups, key_groups, key_padding_mask, window)
    b, h, q_len, d = query.shape
    if b != bsz or q_len != nq:
        fail("query_groups", f"shape {tuple(query_groups.shape)}", f"[B={b}, Nq={q_len}, K]")
    if key.shape[2] != nk:
        fail("key_groups", f"shape {tuple(key_groups.shape)}", f"[B={b}, Nk={key.shape[2]}, K]")
    check_int("window", window, 1)
    window = effective_window(window, nk)
    check_device("query_groups", query_groups, query.device, "query")
    if backend not in BACKENDS:
        fail("backend", repr(backend), f"one of {BACKENDS}")
    scale = check_positive("scale", scale)
    softcap = check_positive("softcap", softcap)
    scale = d**-0.5 if scale is None else scale
    needs_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    if backend in ("cpu_flash", "cpu_fused") and needs_grad:
        fail(
            "backend",
            f"{backend!r} with inputs that require grad",
            "'math' or 'auto' for gradients (the CPU kernels' log-sum-exp is not differentiable)",
        )
    num_groups = query_groups.shape[-1]
    kernel = None  # the loaded cpu_fused module
    if backend == "auto":
        fast = (
            query.device.type == "cpu"
            and query.dtype in CPU_DTYPES
            and not needs_grad
            and softcap is None
        )
        backend = "cpu_flash" if fast else "math"
        if fast and num_groups <= FUSED_MAX_GROUPS:
            kernel = _extension.load()
            backend = "cpu_fused" if kernel is not None else backend
    elif backend in ("cpu_flash", "cpu_fused") and (
        query.device.type != "cpu" or softcap is not None
    ):
        fail("backend", repr(backend), "CPU tensors and softcap=None ('math' otherwise)")
    if backend == "cpu_fused" and kernel is None:
        if num_groups > FUSED_MAX_GROUPS:
            fail(
                "query_groups", f"K={num_groups} groups", f"K <= {FUSED_MAX_GROUPS} for 'cpu_fused'"
            )
        if query.dtype not in CPU_DTYPES:
            fail(
                "query",
                f"dtype {query.dtype}",
                "float32, bfloat16 or float16 for 'cpu_fused', which computes in float32 "
                "('math' for float64)",
            )
        kernel = _extension.load()
        if kernel is None:
            raise RuntimeError(
                f"backend='cpu_fused': the kernel is unavailable ({_extension.unavailable_reason()})"
            )

    offset = nk - nq
    if backend != "math":
        # one copy into [B, H, N, D] rows makes every later gather a contiguous row copy
        # (transformers hands over transposed [B, N, H, D] views)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    outs, lses = [], []
    if backend != "math":  # accumulate in place, token-major, straight into the result
        acc_out = torch.empty(b, nq, h, d, dtype=torch.float32, device=query.device)
        acc_lse = torch.empty(b, nq, h, dtype=torch.float32, device=query.device)
    if backend == "cpu_fused":
        _fused(
            kernel,
            query,
            key,
            value,
            query_groups,
            key_groups,
            key_padding_mask,
            window,
            scale,
            acc_out,
            acc_lse,
        )
        return _finish(acc_out, acc_lse, query.dtype, return_lse)
    for i in range(b):
        real = None if key_padding_mask is None else key_padding_mask[i]
        run = _Runner(query[i], key[i], value[i], scale, softcap, backend)
        if backend == "math":
            acc = _Collect(h, nq, d, query.dtype, query.device)
        else:
            acc = _Accumulate(acc_out[i], acc_lse[i], query.dtype)
        qg, kg = query_groups[i], key_groups[i]
        _groups(acc, run, qg, kg, real, offset)
        run.band(acc, qg, kg, real, offset, window)
        if backend != "math":
            acc.finish()
        else:
            out_i, lse_i = acc.result()
            outs.append(out_i)
            lses.append(lse_i)
    if backend == "math":
        out, lse = torch.stack(outs), torch.stack(lses)
        return (out, lse) if return_lse else out
    return _finish(acc_out, acc_lse, query.dtype, return_lse)


def _finish(acc_out, acc_lse, dtype, return_lse):
    # [B, H, Nq, D] views of the token-major buffers (transformers wants [B, Nq, H, D])
    out, lse = acc_out.transpose(1, 2).to(dtype), acc_lse.transpose(1, 2)
    return (out, lse) if return_lse else out


def _fused(kernel, query, key, value, qg, kg, key_padding_mask, window, scale, out, lse) -> None:
    """Run the loaded ``cpu_fused`` ``kernel`` module into the token-major ``out [B, Nq, H, D]`` and
    ``lse [B, Nq, H]`` float32 buffers."""
    rep = query.shape[1] // key.shape[1]
    real = (
        torch.empty(0, dtype=torch.bool)
        if key_padding_mask is None
        else key_padding_mask.contiguous()
    )
    kernel.focus_forward(
        query,
        key,
        value,
        qg.contiguous(),
        kg.contiguous(),
        real,
        window,
        scale,
        out,
        lse,
        max(1, FUSED_ROWS // rep),
        FUSED_KEYS,
        FUSED_BAND,
    )
