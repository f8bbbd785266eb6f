"""Exact sparse attention for hard top-k routing (spec section 5).

The Focus mask is split into disjoint parts; each part runs as standard attention and the
parts are merged by log-sum-exp:

- **group parts**: pairs that share a group, each pair assigned to the *lowest* group the two
  tokens share (so a pair sharing several groups counts once, for any ``top_k``). Group ``g``
  gathers its members in position order. Queries whose memberships below ``g`` differ form
  separate sub-classes, each attending to the members of ``g`` that share none of its lower
  groups: every sub-class is then a plain causal problem between two sorted position lists.
- **local part**: pairs inside the window that share no group (a narrow band, masked).

A causal problem between a sorted query list and a sorted key list runs as one ``is_causal``
call when the lists coincide (prefill, the common case), else block by block: the keys that
every query of a block may see go to an unmasked call, only the short diagonal strip is
masked. Memory is linear in N for fixed block sizes; no ``Nq x Nk`` or per-group quadratic
tensor is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from ._checks import check_int, fail
from .gates import _check_qkv
from .masks import check_groups

Backend = Literal["auto", "cpu_flash", "math"]
BACKENDS = ("auto", "cpu_flash", "math")

#: queries per block in blocked (staircase / band) calls; product decision, tuned on CPU.
QUERY_BLOCK = 256
#: queries per block inside the math backend's quadratic step.
MATH_BLOCK = 512


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # boolean logic decides visibility; this only converts it to the kernel's format
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def _attend_cpu_flash(q, k, v, mask, causal, scale):
    """One PyTorch CPU flash-attention call on ``[H, n, D]`` / ``[H, m, D]`` operands."""
    attn_mask = None if mask is None else _float_mask(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, attn_mask=attn_mask, scale=scale
    )[:2]
    out, lse = out[0], lse[0].float()
    if mask is not None:  # the kernel reports lse 0 for a row with no visible key
        empty = ~mask.any(dim=-1)
        if bool(empty.any()):
            lse = lse.masked_fill(empty[None], -math.inf)
            out = out.masked_fill(empty[None, :, None], 0.0)
    return out, lse


def _attend_math(q, k, v, mask, causal, scale, softcap):
    """Differentiable attention on ``[H, n, D]`` operands, ``O(MATH_BLOCK * m)`` memory."""
    n, m = q.shape[1], k.shape[1]
    ct = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for gradcheck
    outs, lses = [], []
    for start in range(0, n, MATH_BLOCK):
        stop = min(n, start + MATH_BLOCK)
        hi = min(m, stop) if causal else m
        logits = (q[:, start:stop].to(ct) @ k[:, :hi].to(ct).transpose(-1, -2)) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if causal:
            vis = torch.arange(hi, device=q.device)[None, :] <= torch.arange(
                start, stop, device=q.device
            )[:, None]
        else:
            vis = mask[start:stop] if mask is not None else None
        if vis is not None:
            row_any = vis.any(dim=-1, keepdim=True)
            logits = logits.masked_fill(~vis, -math.inf)
            logits = torch.where(row_any, logits, torch.zeros_like(logits))
        lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - lse[..., None])
        if vis is not None:
            probs = torch.where(row_any, probs, torch.zeros_like(probs))
            lse = torch.where(row_any[:, 0], lse, torch.full_like(lse, -math.inf))
        outs.append((probs @ v[:, :hi].to(ct)).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


@dataclass
class _Parts:
    """Partial results ``(query index, out, lse)`` of one batch element, merged at the end."""

    num_heads: int
    nq: int
    idx: list[torch.Tensor] = field(default_factory=list)
    out: list[torch.Tensor] = field(default_factory=list)
    lse: list[torch.Tensor] = field(default_factory=list)

    def add(self, idx: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        if idx.numel():
            self.idx.append(idx)
            self.out.append(out)
            self.lse.append(lse)

    def merge(self, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-sum-exp merge of disjoint parts; a query with no part outputs 0, lse -inf."""
        h, nq = self.num_heads, self.nq
        if not self.idx:
            return (
                torch.zeros(h, nq, d, dtype=dtype, device=device),
                torch.full((h, nq), -math.inf, device=device),
            )
        idx = torch.cat(self.idx)
        lse = torch.cat(self.lse, dim=1)  # [H, P] fp32 (fp64 under gradcheck)
        ct = torch.promote_types(lse.dtype, torch.float32)
        out = torch.cat(self.out, dim=1).to(ct)  # [H, P, D]
        index = idx[None].expand(h, -1)
        peak = torch.full((h, nq), -math.inf, device=device, dtype=lse.dtype)
        peak = peak.scatter_reduce(1, index, lse.detach(), "amax")
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        w = torch.exp(lse - peak.gather(1, index))  # exactly 0 for empty parts (lse -inf)
        den = torch.zeros(h, nq, device=device, dtype=w.dtype).index_add(1, idx, w)
        num = torch.zeros(h, nq, d, device=device, dtype=ct).index_add(1, idx, w[..., None] * out)
        has = den > 0
        merged = num / torch.where(has, den, torch.ones_like(den))[..., None]
        total = torch.where(has, peak + torch.log(torch.where(has, den, torch.ones_like(den))), -math.inf)
        return merged.to(dtype), total


class _Runner:
    """Runs causal sub-problems of one batch element on the chosen backend."""

    def __init__(self, q, k, v, scale, softcap, backend):
        self.q, self.k, self.v = q, k, v  # [H, Nq, D], [H_kv, Nk, D]
        self.rep = q.shape[0] // k.shape[0]
        self.scale, self.softcap, self.backend = scale, softcap, backend

    def _kv(self, kidx: torch.Tensor | slice):
        k, v = self.k[:, kidx], self.v[:, kidx]
        if self.rep > 1:
            k = k.repeat_interleave(self.rep, dim=0)
            v = v.repeat_interleave(self.rep, dim=0)
        return k, v

    def attend(self, q, k, v, mask, causal):
        if self.backend == "math":
            return _attend_math(q, k, v, mask, causal, self.scale, self.softcap)
        return _attend_cpu_flash(q, k, v, mask, causal, self.scale)

    def staircase(self, parts: _Parts, qidx, qpos, kidx, kpos) -> None:
        """Causal attention (key visible iff its position <= the query's) between a sorted
        query list and a sorted key list, both given as indices and absolute positions."""
        if qidx.numel() == 0 or kidx.numel() == 0:
            return
        q_all = self.q[:, qidx]
        if qpos.shape == kpos.shape and torch.equal(qpos, kpos):
            k, v = self._kv(kidx)
            parts.add(qidx, *self.attend(q_all, k, v, None, True))
            return
        n = qidx.numel()
        starts = torch.arange(0, n, QUERY_BLOCK, device=qpos.device)
        stops = (starts + QUERY_BLOCK).clamp(max=n)
        lo_all = torch.searchsorted(kpos, qpos[starts], right=True).tolist()
        hi_all = torch.searchsorted(kpos, qpos[stops - 1], right=True).tolist()
        k_all, v_all = self._kv(kidx)
        for s, e, lo, hi in zip(starts.tolist(), stops.tolist(), lo_all, hi_all, strict=True):
            q = q_all[:, s:e]
            if lo > 0:  # keys no later than the block's first query: visible to all of it
                parts.add(qidx[s:e], *self.attend(q, k_all[:, :lo], v_all[:, :lo], None, False))
            if hi > lo:  # the diagonal strip: causal mask
                mask = kpos[None, lo:hi] <= qpos[s:e, None]
                parts.add(
                    qidx[s:e],
                    *self.attend(q, k_all[:, lo:hi], v_all[:, lo:hi], mask, False),
                )

    def band(self, parts: _Parts, qg, kg, real, offset: int, window: int) -> None:
        """Local pairs (``0 <= i - j < window``) that share no group, block by block."""
        nq = self.q.shape[1]
        kgf = kg.float()
        for s in range(0, nq, QUERY_BLOCK):
            e = min(nq, s + QUERY_BLOCK)
            lo, hi = max(0, offset + s - window + 1), offset + e
            qp = torch.arange(offset + s, offset + e, device=qg.device)[:, None]
            kp = torch.arange(lo, hi, device=qg.device)[None, :]
            dist = qp - kp
            share = (qg[s:e].float() @ kgf[lo:hi].t()) > 0
            mask = (dist >= 0) & (dist < window) & ~share
            if real is not None:
                mask &= real[None, lo:hi]
            if not bool(mask.any()):
                continue
            k, v = self._kv(slice(lo, hi))
            parts.add(
                torch.arange(s, e, device=qg.device),
                *self.attend(self.q[:, s:e], k, v, mask, False),
            )


def _groups(parts: _Parts, run: _Runner, qg, kg, real, offset: int) -> None:
    """All pairs that share a group, each assigned to the lowest shared group."""
    num_groups = qg.shape[-1]
    device = qg.device
    for g in range(num_groups):
        qidx = torch.nonzero(qg[:, g], as_tuple=True)[0]
        kmember = kg[:, g] if real is None else kg[:, g] & real
        kidx = torch.nonzero(kmember, as_tuple=True)[0]
        if qidx.numel() == 0 or kidx.numel() == 0:
            continue
        if g == 0:
            classes = [(qidx, None)]
        else:
            lower = qg[qidx, :g]  # [nq_g, g] memberships below g
            if not bool(lower.any()):
                classes = [(qidx, None)]
            else:
                uniq, inverse = torch.unique(lower, dim=0, return_inverse=True)
                classes = [(qidx[inverse == c], uniq[c]) for c in range(uniq.shape[0])]
        for cls_q, cls_lower in classes:
            cls_k = kidx
            if cls_lower is not None and bool(cls_lower.any()):
                # drop keys that share a lower group with this class: counted there already
                keep = ~kg[kidx][:, :g][:, cls_lower].any(dim=-1)
                cls_k = kidx[keep]
            run.staircase(parts, cls_q, cls_q + offset, cls_k, cls_k.to(device))


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
        backend: ``"cpu_flash"`` (PyTorch's CPU flash kernel; inference only), ``"math"``
            (blocked, differentiable, any device and dtype) or ``"auto"``: ``cpu_flash`` for
            CPU float32/bfloat16/float16 inputs without grad and without softcap, else
            ``math``.
        return_lse: also return the log-sum-exp ``[B, H, Nq]`` float32 (``-inf`` for a query
            with no visible key).

    Returns:
        ``[B, H, Nq, D]`` in the query's dtype (and the log-sum-exp if asked).

    Raises:
        ValueError: wrong ranks or shapes, mismatched batch/length/K/D, ``H % H_kv != 0``,
            non-boolean group masks, ``window < 1``, ``Nq > Nk``, unknown backend.
    """
    _check_qkv(query, key, value)
    bsz, nq, nk, _ = check_groups(query_groups, key_groups, key_padding_mask, window)
    b, h, q_len, d = query.shape
    if b != bsz or q_len != nq:
        fail("query_groups", f"shape {tuple(query_groups.shape)}", f"[B={b}, Nq={q_len}, K]")
    if key.shape[2] != nk:
        fail("key_groups", f"shape {tuple(key_groups.shape)}", f"[B={b}, Nk={key.shape[2]}, K]")
    check_int("window", window, 1)
    if backend not in BACKENDS:
        fail("backend", repr(backend), f"one of {BACKENDS}")
    scale = d**-0.5 if scale is None else float(scale)
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
        )
        fast = (
            query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not needs_grad
            and softcap is None
        )
        backend = "cpu_flash" if fast else "math"
    elif backend == "cpu_flash":
        if query.device.type != "cpu" or softcap is not None:
            fail("backend", "'cpu_flash'", "CPU tensors and softcap=None ('math' otherwise)")

    offset = nk - nq
    outs, lses = [], []
    for i in range(b):
        real = None if key_padding_mask is None else key_padding_mask[i]
        run = _Runner(query[i], key[i], value[i], scale, softcap, backend)
        parts = _Parts(h, nq)
        qg, kg = query_groups[i], key_groups[i]
        _groups(parts, run, qg, kg, real, offset)
        run.band(parts, qg, kg, real, offset, window)
        out, lse = parts.merge(d, query.dtype, query.device)
        outs.append(out)
        lses.append(lse)
    out = torch.stack(outs)
    return (out, torch.stack(lses)) if return_lse else out
