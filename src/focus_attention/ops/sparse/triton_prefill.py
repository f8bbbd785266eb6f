"""Prefill under the Focus mask as Triton kernels of this package (docs/method.md §4-§5).

:func:`group_prefill` computes exactly what
:func:`~focus_attention.ops.sparse_attention` computes, for long prefill and chunked prefill
on a GPU (or on the CPU under Triton's interpreter, for tests): query ``i`` attends key
``j`` iff ``j <= i``, key ``j`` is real, and ``i - j < window`` or the two share a group.

**Decomposition.** The visible pairs split into two disjoint parts, merged by the kernel's
online softmax (one running maximum and sum per row, so an empty part contributes nothing):

- the *local part*: ``0 <= i - j < window`` and ``j`` real, read in token order;
- the *group part*: ``i - j >= window`` and the two share a group, read from a group-sorted
  key layout (per batch element and routing row, the real keys of group ``g`` in position
  order, one row per membership), a pair that shares several groups counted only in its
  lowest shared group.

Queries are laid out by *membership class*: sorted by their group code (the set of groups
they hold), then by position, each query once. A query tile therefore reads all of its
queries' group part (for each group a row holds, that group's keys up to ``window``
positions before the tile's last query of the group) and their local part, and writes the
final output once: no partial results go through memory and no merge pass runs. With
``top_k = 1`` a class is a group and this is the paper's sort by group. Rows of a tile that
does not hold a group are masked, so tiles that straddle two classes cost the union of
their groups; the local part of a tile reads the key tiles that the windows of its
queries reach, more than a token-order band when a class's queries lie far apart (the
tile's ``QPT`` queries span about ``QPT * Nq / class size`` positions).

**GQA.** The ``rep = H / H_kv`` query heads of a key-value head are packed into the rows of
one tile (``QPT = BLOCK_M // rep`` queries each), so every key/value tile is loaded once for
all of them, and a tile's queries (hence its local key tiles) are ``rep`` times fewer.

**On the device.** The layouts are built with fixed-shape torch operations (a stable sort of
the query codes; a cumulative count and a scatter for the key layout): no host
synchronisation, no shape that depends on the routing. The kernel is compiled once per head
size, dtype, ``rep`` and flags: lengths, windows, batch and head strides and ``K`` are not
specialised on.

Costs beside the output (per batch element and routing row ``R``): query order and codes
(8-12 bytes per query), the key layout (4 bytes per key and group: ``Nk * K`` rows, an upper
bound of the memberships), key codes (4-8 bytes per key) and a count table
(``4 K`` bytes per ``COUNT_STEP`` keys). Building them allocates temporaries of about
``21 K`` bytes per key (codes, cumulative counts, scatter indices).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...utils.checks import check_int
from ..checks import check_bool, check_device, check_positive, check_qkv, check_tensor, fail
from ..masks import effective_window
from .dispatch import BackendUnavailable
from .triton_support import MAX_KERNEL_GROUPS, group_codes, interpreting, triton_reason

__all__ = [
    "MAX_HEAD_DIM",
    "PREFILL_DTYPES",
    "PrefillBlocks",
    "PrefillLayout",
    "group_prefill",
    "prefill_blocks",
    "prefill_layout",
]

#: largest head size the kernels take (padded to a power of two inside).
MAX_HEAD_DIM = 256
#: input dtypes the kernels take (computed with fp32 accumulation).
PREFILL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: groups whose codes fit an int32 word (faster than int64 on GPUs).
_INT32_GROUPS = 31


@dataclass(frozen=True)
class PrefillBlocks:
    """Tile sizes of one launch.

    Attributes:
        block_m: rows of a query tile (``queries_per_tile * rep`` of them used).
        queries_per_tile: queries of the class layout per tile (``QPT``).
        block_n: keys per key tile.
        block_d: head size padded to a power of two (at least 16).
        count_step: positions per entry of the key count table.
        num_warps, num_stages: CUDA launch options (ignored by the interpreter).
    """

    block_m: int
    queries_per_tile: int
    block_n: int
    block_d: int
    count_step: int
    num_warps: int
    num_stages: int


def prefill_blocks(head_dim: int, rep: int, *, interpret: bool | None = None) -> PrefillBlocks:
    """The fixed tile sizes for ``head_dim`` and ``rep`` query heads per key-value head:
    small tiles under the interpreter (tests cross their edges at small lengths), CUDA sizes
    by head size otherwise (``interpret``: default, whether ``TRITON_INTERPRET=1``).

    Raises:
        ValueError: ``head_dim`` not in ``1..MAX_HEAD_DIM`` or ``rep < 1``.
    """
    check_int("prefill_blocks", "head_dim", head_dim, 1)
    check_int("prefill_blocks", "rep", rep, 1)
    if head_dim > MAX_HEAD_DIM:
        fail("head_dim", head_dim, f"at most {MAX_HEAD_DIM} (the kernels' largest tile)")
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    interpret = interpreting() if interpret is None else interpret
    if interpret:
        rows, block_n, warps, stages = 32, 16, 1, 1
    elif block_d <= 64:
        rows, block_n, warps, stages = 64, 64, 4, 3
    elif block_d <= 128:
        rows, block_n, warps, stages = 64, 64, 4, 2
    else:
        rows, block_n, warps, stages = 64, 32, 8, 1
    rows = max(rows, 1 << (rep - 1).bit_length())  # at least one query per tile
    return PrefillBlocks(rows, rows // rep, block_n, block_d, block_n, warps, stages)


@dataclass(frozen=True)
class PrefillLayout:
    """The device-side layouts of one call (docs/method.md §5), per batch element and
    routing row (``R`` of them).

    Attributes:
        query_rows: int32 ``[B, R, Nq]`` the query index of each row of the class layout
            (queries sorted by group code, then position; each query once).
        query_codes: ``[B, R, Nq]`` the group code of each row (int32 for ``K <= 31``,
            else int64; bit ``g`` set iff the query holds group ``g``).
        key_rows: int32 ``[B, R, Nk * K + 1]`` the group-sorted key layout: the real keys
            of group 0 in position order, then group 1, ...; rows past the last are unused
            (``Nk * K`` bounds the memberships; the final row takes the non-members' writes).
        key_codes: ``[B, R, Nk]`` the group code of each key (0 for padding).
        segments: int32 ``[B, R, K]`` where group ``g`` starts in ``key_rows``.
        counts: int32 ``[B, R, ceil(Nk / count_step), K]``: entry ``[.., c, g]`` counts
            the real keys of group ``g`` at positions below ``(c + 1) * count_step``.
        low_masks: ``[K]`` of the code dtype, ``2**g - 1`` (the groups below ``g``).
        count_step: positions per entry of ``counts``.
    """

    query_rows: torch.Tensor
    query_codes: torch.Tensor
    key_rows: torch.Tensor
    key_codes: torch.Tensor
    segments: torch.Tensor
    counts: torch.Tensor
    low_masks: torch.Tensor
    count_step: int


def prefill_layout(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    count_step: int,
) -> PrefillLayout:
    """Build the layouts of :class:`PrefillLayout` on the memberships' device with
    fixed-shape operations (no host synchronisation; the same operations for any routing of
    the same shapes).

    Args:
        query_groups: bool ``[B, R, Nq, K]``; key_groups: bool ``[B, R, Nk, K]``, ``Nk >= 1``,
            ``K <= MAX_KERNEL_GROUPS``.
        key_padding_mask: bool ``[B, Nk]`` (True = real) or None.
        count_step: positions per entry of the count table, ``>= 1``.
    """
    bsz, routes, nk, k = key_groups.shape
    members = key_groups
    if key_padding_mask is not None:
        members = members & key_padding_mask[:, None, :, None]
    code_dtype = torch.int32 if k <= _INT32_GROUPS else torch.int64
    query_codes, order = torch.sort(group_codes(query_groups), dim=-1, stable=True)
    cum = torch.cumsum(members, dim=2, dtype=torch.int32)  # [B, R, Nk, K]
    totals = cum[:, :, -1, :]
    segments = torch.cumsum(totals, dim=-1, dtype=torch.int32) - totals
    slots = nk * k
    dest = (segments[:, :, None, :] + cum - 1).to(torch.int64)
    dest = torch.where(members, dest, slots).reshape(bsz, routes, slots)  # slot nk*k: unused
    tokens = torch.arange(nk, dtype=torch.int32, device=members.device)
    tokens = tokens[None, None, :, None].expand(bsz, routes, nk, k).reshape(bsz, routes, slots)
    key_rows = torch.zeros(bsz, routes, slots + 1, dtype=torch.int32, device=members.device)
    key_rows.scatter_(2, dest, tokens)
    ends = torch.arange(count_step, nk + count_step, count_step, device=members.device)
    counts = cum.index_select(2, ends.clamp(max=nk) - 1)
    low = torch.pow(2, torch.arange(k, device=members.device, dtype=torch.int64)) - 1
    return PrefillLayout(
        query_rows=order.to(torch.int32),
        query_codes=query_codes.to(code_dtype),
        key_rows=key_rows,
        key_codes=group_codes(members).to(code_dtype),
        segments=segments,
        counts=counts.contiguous(),
        low_masks=low.to(code_dtype),
        count_step=count_step,
    )


def group_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    window: int,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    needs_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact attention under the Focus mask for prefill and chunked prefill, as Triton
    kernels (docs/method.md §4-§5; the decomposition and costs are in this module's
    docstring).

    Query ``t`` sits at position ``Nk - Nq + t`` (bottom-right aligned). Query ``i`` attends
    key ``j`` iff ``j <= i``, key ``j`` is real, and (``i - j < window`` or they share a
    group): exactly :func:`~focus_attention.ops.sparse_attention`'s mask. Runs on CUDA
    tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).

    Args:
        query: ``[B, H, Nq, D]`` float32, bfloat16 or float16, ``D <= 256``.
        key, value: ``[B, H_kv, Nk, D]``, the query's dtype, ``H % H_kv == 0``, ``Nq <= Nk``.
        query_groups: bool ``[B, R, Nq, K]``; ``R = 1`` (one routing for every key-value
            head) or ``R = H_kv`` (key-value head ``h`` uses row ``h``); ``K <= 62``.
        key_groups: bool ``[B, R, Nk, K]``.
        window: local window in tokens, an int ``>= 1`` (counts the query itself).
        scale: logit scale, default ``D ** -0.5``.
        softcap: optional Gemma-2 logit soft-capping ``c * tanh(logits / c)``.
        key_padding_mask: optional bool ``[B, Nk]``, True = real key.
        needs_lse: whether to return the log-sum-exp (else None in its place).

    Returns:
        ``(out, lse)``: token-major ``out [B, Nq, H, D]`` in the query's dtype and
        ``lse [B, Nq, H]`` float32 (natural log of the visible logits' exp-sum); a query
        that sees no key gets zeros and ``-inf``. ``lse`` is None when ``needs_lse`` is
        False.

    Raises:
        ValueError: a malformed argument (the message names it): ranks, shapes, dtypes,
            devices, ``R`` not 1 or ``H_kv``, ``K`` outside ``1..62``, ``D > 256``,
            ``Nq > Nk``, ``window`` not an int ``>= 1``, ``scale``/``softcap`` not finite
            and ``> 0``.
        BackendUnavailable: (a ``ValueError``) Triton cannot run here (the reason).
    """
    window, scale = _checked(query, key, value, query_groups, key_groups, window, scale,
                             softcap, key_padding_mask)  # fmt: skip
    b, h, nq, d = query.shape
    if query.numel() == 0 or key.shape[2] == 0:
        out = query.new_zeros(b, nq, h, d)
        return out, query.new_full((b, nq, h), -math.inf, dtype=torch.float32) if needs_lse else None  # fmt: skip
    blocks = prefill_blocks(d, h // key.shape[1])
    layout = prefill_layout(query_groups, key_groups, key_padding_mask, blocks.count_step)
    return _forward(query, key, value, layout, blocks, window, scale, softcap,
                    key_padding_mask, needs_lse)  # fmt: skip


def _forward(q, k, v, layout: PrefillLayout, blocks: PrefillBlocks, window, scale, softcap,
             padding, needs_lse):  # fmt: skip
    """Allocate the results and launch the forward kernel (no host synchronisation)."""
    from . import triton_prefill_kernels as kernels  # lazy: defining a kernel picks its mode

    b, h, nq, d = q.shape
    h_kv, nk = k.shape[1], k.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(b, nq, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, nq, h, dtype=torch.float32, device=q.device) if needs_lse else out
    real = out if padding is None else padding.view(torch.uint8)
    cap = 1.0 if softcap is None else softcap
    grid = (_cdiv(nq, blocks.queries_per_tile), b * h_kv)
    kernels.group_prefill_fwd[grid](
        q, k, v, out, lse,
        layout.query_rows, layout.query_codes, layout.key_rows, layout.key_codes,
        layout.segments, layout.counts, layout.low_masks, real,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        nq, nk, window, h_kv, layout.query_rows.shape[1], layout.low_masks.shape[0],
        scale * kernels.LOG2E, scale / cap, cap * kernels.LOG2E,
        REP=h // h_kv, QPT=blocks.queries_per_tile, BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n, BLOCK_D=blocks.block_d, HEAD_DIM=d,
        COUNT_STEP=blocks.count_step, HAS_SOFTCAP=softcap is not None,
        HAS_PADDING=padding is not None, WRITE_LSE=needs_lse,
        EXACT=q.dtype == torch.float32 or interpreting(),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return out, lse if needs_lse else None


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints ``a >= 0``, ``b >= 1``."""
    return -(-a // b)


def _checked(query, key, value, query_groups, key_groups, window, scale, softcap, padding):
    """Validate :func:`group_prefill`'s arguments; returns ``(window, scale)`` (the window
    capped at ``Nk``, the default scale)."""
    check_qkv(query, key, value)
    b, h, nq, d = query.shape
    h_kv, nk = key.shape[1], key.shape[2]
    if query.dtype not in PREFILL_DTYPES:
        fail("query", f"dtype {query.dtype}", "float32, bfloat16 or float16")
    if d > MAX_HEAD_DIM:
        fail("query", f"head_dim D = {d}", f"D <= {MAX_HEAD_DIM} (the kernels' largest tile)")
    if nq > nk:
        fail("query", f"Nq = {nq} queries for Nk = {nk} keys", "Nq <= Nk")
    for name, groups, n in (("query_groups", query_groups, nq), ("key_groups", key_groups, nk)):
        _check_groups(name, groups, (b, n), h_kv, query.device)
    if query_groups.shape[1] != key_groups.shape[1] or query_groups.shape[3] != key_groups.shape[3]:  # fmt: skip
        fail("key_groups", f"shape {tuple(key_groups.shape)}",
             f"R and K of query_groups {tuple(query_groups.shape)}")  # fmt: skip
    check_int("group_prefill", "window", window, 1)
    scale = check_positive("scale", scale)
    check_positive("softcap", softcap)
    if padding is not None:
        check_tensor("key_padding_mask", padding, 2)
        check_bool("key_padding_mask", padding)
        if tuple(padding.shape) != (b, nk):
            fail("key_padding_mask", f"shape {tuple(padding.shape)}", f"[B={b}, Nk={nk}]")
        check_device("key_padding_mask", padding, query.device, "query")
    reason = triton_reason(query.device)
    if reason is not None:
        raise BackendUnavailable(f"group_prefill: received {query.device} tensors, expected "
                                 f"a device the Triton kernels run on: it {reason}")  # fmt: skip
    return effective_window(window, nk), d**-0.5 if scale is None else scale


def _check_groups(name: str, groups, lead: tuple[int, int], h_kv: int, device) -> None:
    """``groups`` is bool ``[B, R, N, K]`` with ``R`` in ``{1, H_kv}`` and ``1 <= K <= 62``
    on ``device``."""
    check_tensor(name, groups, 4)
    check_bool(name, groups)
    b, n = lead
    r, k = groups.shape[1], groups.shape[3]
    if groups.shape[0] != b or groups.shape[2] != n or r not in (1, h_kv):
        fail(name, f"shape {tuple(groups.shape)}", f"[B={b}, R=1 or H_kv={h_kv}, N={n}, K]")
    if not 1 <= k <= MAX_KERNEL_GROUPS:
        fail(name, f"K = {k} groups", f"1 <= K <= {MAX_KERNEL_GROUPS}")
    check_device(name, groups, device, "query")
