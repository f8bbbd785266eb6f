"""The disjoint decomposition of the Focus mask, shared by the Python backends
(docs/method.md §5).

The visible pairs of every query are split into disjoint parts; each part runs as standard
attention (an ``attend`` function of the backend) and the parts are merged by log-sum-exp
(:func:`focus_attention.ops.merge.merge_partials`; an empty part has log-sum-exp ``-inf``):

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

Every piece goes to an accumulator ``acc.add(part, block, rows, out, lse)``: ``part`` names
the part (``"own"`` and ``"other"`` keys of the membership classes, ``"group<g>"`` in the
per-group split, ``"local"``), ``block`` identifies the query rows inside the part (pieces
with equal ``(part, block)`` cover exactly the same rows; different blocks of one part
cover disjoint rows), ``rows`` are the query indices (a tensor or a slice), ``out`` is
``[H, n, D]`` and ``lse`` ``[H, n]``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..masks import CODE_BITS, code_groups, group_codes

__all__ = [
    "BAND_BLOCK",
    "BAND_ELEMENTS",
    "KEY_CHUNK",
    "MAX_CLASSES",
    "QUERY_BLOCK",
    "STRIP",
    "Accumulator",
    "Attend",
    "Decomposition",
    "membership_classes",
]

#: most queries per attention call of a staircase; tuned on CPU (from 768 queries on,
#: PyTorch's CPU flash kernel works in 256-row tiles: 1024 was ~10% faster than 512 at 32K
#: tokens, for ~2 MiB more workspace).
QUERY_BLOCK = 1024
#: keys per masked strip of a staircase whose query and key lists differ (512 was ~10%
#: faster than 256 at top_k = 2: fewer, taller query blocks).
STRIP = 512
#: keys gathered at a time (bounds the workspace: KEY_CHUNK * H_kv * D * 2 elements).
KEY_CHUNK = 2048
#: queries per block of the local band; tuned on CPU.
BAND_BLOCK = 32
#: most membership classes handled one staircase each (else per-group with masks).
MAX_CLASSES = 64
#: mask elements per batched band call (bounds its memory).
BAND_ELEMENTS = 1 << 16

#: ``attend(q [..., H, n, D], k [..., H_kv, m, D], v, mask [..., n, m] bool or None,
#: causal) -> (out [..., H, n, D], lse [..., H, n])``: one standard attention call.
Attend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool],
    "tuple[torch.Tensor, torch.Tensor]",
]


class Accumulator(Protocol):
    """Where the pieces of the decomposition are merged (see the module docstring)."""

    def add(
        self,
        part: str,
        block: Hashable,
        rows: torch.Tensor | slice,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None: ...


@dataclass
class _Stair:
    """One staircase: sorted query and key lists (indices and absolute positions) and the
    optional exclusion features (a pair sharing any feature is not visible)."""

    part: str
    tag: Hashable
    qidx: torch.Tensor
    qpos: torch.Tensor
    kidx: torch.Tensor
    kpos: torch.Tensor
    q_excl: torch.Tensor | None
    k_excl: torch.Tensor | None
    equal: bool


def membership_classes(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct membership rows of bool ``[N, K]``: ``(classes [C, K], inverse [N])``."""
    k = groups.shape[-1]
    if k > CODE_BITS:  # no int64 code: compare whole rows (slower)
        return torch.unique(groups, dim=0, return_inverse=True)
    uniq, inverse = torch.unique(group_codes(groups), return_inverse=True)
    return code_groups(uniq, k), inverse


def _strided_blocks(x: torch.Tensor, start: int, nb: int, length: int, step: int) -> torch.Tensor:
    """``[nb, heads, length, D]`` view of ``x [heads, N, D]``: block ``i`` covers tokens
    ``start + i * step ..`` (blocks may overlap; no copy)."""
    sh, sn, sd = x.stride()
    return x.as_strided(
        (nb, x.shape[0], length, x.shape[2]),
        (step * sn, sh, sn, sd),
        x.storage_offset() + start * sn,
    )


class Decomposition:
    """The group and local parts of one batch element, run by ``attend`` into ``acc``.

    ``q [H, Nq, D]``, ``k``/``v`` ``[H_kv, Nk, D]``; queries are bottom-right aligned
    (query ``t`` at absolute position ``Nk - Nq + t``).
    """

    def __init__(self, q, k, v, attend: Attend, acc: Accumulator) -> None:
        self.q, self.k, self.v = q, k, v
        self.attend, self.acc = attend, acc
        self.offset = k.shape[1] - q.shape[1]

    # ----------------------------------------------------------------------------------
    # group part
    # ----------------------------------------------------------------------------------

    def group_part(self, qg: torch.Tensor, kg: torch.Tensor, real: torch.Tensor | None) -> None:
        """All pairs that share a group (bool ``qg [Nq, K]``, ``kg [Nk, K]``, ``real [Nk]``
        or None), each counted once.

        Queries are partitioned by their exact membership set S; class S attends causally
        to the real keys of every group in S (one sorted union list). When there are more
        than ``MAX_CLASSES`` classes (large ``C(K, top_k)``), each pair is instead assigned
        to the lowest group the two tokens share: group g attends to its members, excluding
        (by mask) keys that share a lower group with the query.
        """
        kmember = kg if real is None else kg & real[:, None]
        classes, inverse = membership_classes(qg)
        if classes.shape[0] > MAX_CLASSES:
            self._per_group(qg, kmember)
            return
        for c in range(classes.shape[0]):
            members = classes[c]
            if not bool(members.any()):
                continue  # queries in no group: local attention only
            qidx = torch.nonzero(inverse == c, as_tuple=True)[0]
            qpos = qidx + self.offset
            kidx = torch.nonzero(kmember[:, members].any(dim=-1), as_tuple=True)[0]
            # keys that are this class's own queries (in prefill usually all of them: one
            # is_causal problem) apart from the other keys (sinks, other groups' members)
            own = torch.isin(kidx, qpos)
            self.staircase("own", c, qidx, qpos, kidx[own], kidx[own])
            self.staircase("other", c, qidx, qpos, kidx[~own], kidx[~own])

    def _per_group(self, qg: torch.Tensor, kmember: torch.Tensor) -> None:
        for g in range(qg.shape[-1]):
            qidx = torch.nonzero(qg[:, g], as_tuple=True)[0]
            kidx = torch.nonzero(kmember[:, g], as_tuple=True)[0]
            excl = (None, None) if g == 0 else (qg[qidx, :g], kmember[kidx, :g])
            self.staircase(f"group{g}", 0, qidx, qidx + self.offset, kidx, kidx, *excl)

    def staircase(self, part, tag, qidx, qpos, kidx, kpos, q_excl=None, k_excl=None) -> None:
        """Causal attention (key visible iff its position <= the query's) between a sorted
        query list and a sorted key list, both given as indices and absolute positions.
        With ``q_excl [n, E]`` / ``k_excl [m, E]`` (bool), a pair that shares any of the E
        features is also excluded. Pieces go to ``acc`` under ``part``, block
        ``(tag, first row)``.

        Queries go in blocks of at most ``QUERY_BLOCK`` whose last visible keys fall in the
        same ``STRIP`` keys; keys are gathered ``KEY_CHUNK`` at a time. Each block sees the
        keys before its first query's horizon unmasked; only the strip between its first
        and last horizon is masked. When the two lists coincide (prefill) blocks are
        aligned on ``QUERY_BLOCK`` and the diagonal block runs as ``is_causal``.
        """
        n, m = qidx.numel(), kidx.numel()
        if n == 0 or m == 0:
            return
        equal = q_excl is None and n == m and torch.equal(qpos, kpos)
        if q_excl is not None:
            q_excl, k_excl = q_excl.float(), k_excl.float()
        st = _Stair(part, tag, qidx, qpos, kidx, kpos, q_excl, k_excl, equal)
        blocks = _stair_blocks(qpos, kpos, m, equal)
        for k0 in range(0, m, KEY_CHUNK):
            k1 = min(m, k0 + KEY_CHUNK)
            todo = [blk for blk in blocks if blk[3] > k0]
            if not todo:
                break
            k_c = self.k.index_select(1, kidx[k0:k1])
            v_c = self.v.index_select(1, kidx[k0:k1])
            for blk in todo:
                self._stair_block(st, blk, k0, k1, k_c, v_c)

    def _stair_block(self, st: _Stair, blk, k0: int, k1: int, k_c, v_c) -> None:
        """The (at most two) pieces of one query block against one key chunk."""
        s, e, lo, hi = blk
        rows = st.qidx[s:e]
        q = self.q.index_select(1, rows)
        full = min(k1, lo)
        if full > k0:  # keys every row of the block sees
            mask = None
            if st.q_excl is not None:
                mask = (st.q_excl[s:e] @ st.k_excl[k0:full].t()) == 0
            a, b = 0, full - k0
            out, lse = self.attend(q, k_c[:, a:b], v_c[:, a:b], mask, False)
            self.acc.add(st.part, (st.tag, s), rows, out, lse)
        s0, s1 = max(k0, lo), min(k1, hi)
        if s1 > s0:  # the strip: causal mask (or is_causal on the diagonal)
            a, b = s0 - k0, s1 - k0
            if st.equal:
                out, lse = self.attend(q, k_c[:, a:b], v_c[:, a:b], None, True)
            else:
                mask = st.kpos[None, s0:s1] <= st.qpos[s:e, None]
                if st.q_excl is not None:
                    mask &= (st.q_excl[s:e] @ st.k_excl[s0:s1].t()) == 0
                out, lse = self.attend(q, k_c[:, a:b], v_c[:, a:b], mask, False)
            self.acc.add(st.part, (st.tag, s), rows, out, lse)

    # ----------------------------------------------------------------------------------
    # local part
    # ----------------------------------------------------------------------------------

    def local_part(self, qg, kg, real, window: int) -> None:
        """Local pairs (``0 <= i - j < window``) that share no group, as batched blocks of
        ``BAND_BLOCK`` queries against the ``BAND_BLOCK + window - 1`` keys ending at each
        block's last query; ``window`` must be at most ``max(1, Nk)``."""
        nq, nk = self.q.shape[1], self.k.shape[1]
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
            t = torch.arange(b0 * bq, b1 * bq, device=device).view(b1 - b0, bq)  # queries
            j = (self.offset + t[:, -1:] - width + 1) + cols  # [nb, width] key positions
            valid = (j >= 0) & (j < nk)
            if real is not None:
                valid &= real[j.clamp(0, nk - 1)]
            share = torch.bmm(qgf[t.clamp(max=nq - 1)], kgf[j.clamp(0, nk - 1)].transpose(1, 2))
            mask = base & valid[:, None, :] & ~(share > 0) & (t < nq)[:, :, None]
            if bool(mask.any()):
                self._band_call(b0, t, j, mask)

    def _band_call(self, b0: int, t: torch.Tensor, j: torch.Tensor, mask: torch.Tensor) -> None:
        """One batched call: queries ``t [nb, bq]`` against keys ``j [nb, width]`` under
        ``mask [nb, bq, width]``."""
        h, nq, d = self.q.shape
        h_kv, nk = self.k.shape[0], self.k.shape[1]
        (nb, bq), width = t.shape, j.shape[1]
        s = b0 * bq
        e = min(nq, s + nb * bq)
        if int(j[0, 0]) >= 0 and int(j[-1, -1]) < nk and e - s == nb * bq:
            # interior blocks: overlapping strided views, no copies
            q = _strided_blocks(self.q, s, nb, bq, bq)
            k = _strided_blocks(self.k, int(j[0, 0]), nb, width, bq)
            v = _strided_blocks(self.v, int(j[0, 0]), nb, width, bq)
        else:
            tc, jc = t.clamp(max=nq - 1).reshape(-1), j.clamp(0, nk - 1).reshape(-1)
            q = self.q.index_select(1, tc).view(h, nb, bq, d).transpose(0, 1)
            k = self.k.index_select(1, jc).view(h_kv, nb, width, d).transpose(0, 1)
            v = self.v.index_select(1, jc).view(h_kv, nb, width, d).transpose(0, 1)
        out, lse = self.attend(q, k, v, mask[:, None], False)  # [nb, H, bq, D], [nb, H, bq]
        out = out.transpose(0, 1).reshape(h, nb * bq, d)[:, : e - s]
        lse = lse.transpose(0, 1).reshape(h, nb * bq)[:, : e - s]
        self.acc.add("local", b0, slice(s, e), out, lse)


def _stair_blocks(qpos: torch.Tensor, kpos: torch.Tensor, m: int, equal: bool) -> list:
    """Query blocks of a staircase: ``(first row, end row, keys all rows see, keys the last
    row sees)``, at most ``QUERY_BLOCK`` rows whose horizons fall in one strip."""
    n = qpos.numel()
    device = qpos.device
    if equal:
        visible = torch.arange(1, n + 1, device=device)
    else:
        visible = torch.searchsorted(kpos, qpos, right=True)
    strip = QUERY_BLOCK if equal else STRIP
    group = (visible - 1).div(strip, rounding_mode="floor")  # -1: sees no key
    bounds = torch.arange(0, -(-m // strip) + 1, device=device)
    edges = torch.searchsorted(group, bounds).tolist()
    visible = visible.tolist()
    blocks = []
    for c in range(len(edges) - 1):
        for s in range(edges[c], edges[c + 1], QUERY_BLOCK):
            e = min(edges[c + 1], s + QUERY_BLOCK)
            lo = s if equal else int(visible[s])
            blocks.append((s, e, lo, int(visible[e - 1])))
    return blocks
