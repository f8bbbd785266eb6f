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

**Layouts.** Query, key and value are read with their own strides: any batch, head and
token strides (splits of a fused projection, transposes, slices of a preallocated cache,
heads or batch rows expanded with a stride of 0); a tensor whose last dimension is not
contiguous is copied first. Each gradient is allocated like its input where that is dense
(else contiguous) and written with its own strides.

**Gradients** (FlashAttention-2's backward: probabilities recomputed from the saved
log-sum-exp): ``dq`` per query tile of the same class layout, over the same key tiles;
``dk``/``dv`` per key tile of the *keys'* class layout, over the group-sorted *queries* (for
each group a key of the tile holds, that group's queries from ``window`` positions after
the tile's first key of the group) and the queries whose window holds its keys, summed
over the packed query heads in registers. Each gradient row is written once: no atomics.

**On the device.** Layouts are built with fixed-shape torch operations (a stable sort of the
codes; a cumulative count and a scatter for a group-sorted layout): no host synchronisation
and no shape that depends on the routing; the grids derive from shapes only
(:func:`prefill_grids`: tiles along x, key-value heads along y, the batch along z). Lengths, the
window, ``K`` and the log-sum-exp's batch stride are not specialised on, so for a head size
that is a multiple of 16 (and 16-byte aligned tensors) one compilation per dtype, head
size, ``rep``, ``R = 1`` or not and flags serves every length; for other head sizes the
divisibility of ``N * D`` by 16 may give a second one. Tiles are fixed per kernel and head
size (:func:`prefill_blocks`; no autotuning).

**Numerics.** fp32 accumulation and softmax state. Half-precision inputs on CUDA round the
probabilities (and ``dS``) to the input dtype for the tensor-core dots, as FlashAttention
does; fp32 inputs use IEEE fp32 dots (no TF32); under the interpreter every dot runs in
fp32 (its bfloat16 dots are not usable).

**Memory** beside the results, per batch element and routing row ``R``: the queries' class
order (8-12 bytes per query), the keys' group order (``4 K + 4..8`` bytes per key: ``Nk * K``
rows, an upper bound of the memberships, codes and a count table of ``4 K`` bytes per 64
keys), and while building them temporaries of about ``30 K`` bytes per token (codes,
cumulative counts, scatter indices); at 128K tokens, ``K = 8``, ``R = 1``: about 6 MiB kept
and 30 MiB transient, against 1 GiB for a bfloat16 output of 32 heads of 128. The forward's
layouts stay alive until the backward, which adds ``delta`` (float32 ``[B, Nq, H]``), the
keys' class order and the queries' group order (the same sizes with queries and keys
swapped), and a contiguous copy of the output's gradient when it is strided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ...utils.checks import check_int
from ..checks import check_bool, check_device, check_positive, check_qkv, check_tensor, fail
from ..masks import effective_window
from .dispatch import BackendUnavailable
from .triton_support import (
    MAX_KERNEL_GROUPS,
    KernelLaunch,
    check_grid,
    group_codes,
    interpreting,
    triton_reason,
)

__all__ = [
    "DELTA_ROWS",
    "MAX_HEAD_DIM",
    "PREFILL_DTYPES",
    "ClassOrder",
    "GroupOrder",
    "PrefillBlocks",
    "TileSizes",
    "class_order",
    "group_order",
    "group_prefill",
    "prefill_blocks",
    "prefill_grids",
    "prefill_launches",
]

#: largest head size the kernels take (padded to a power of two inside).
MAX_HEAD_DIM = 256
#: input dtypes the kernels take (computed with fp32 accumulation).
PREFILL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: groups whose codes fit an int32 word (faster than int64 on GPUs).
_INT32_GROUPS = 31
#: log2(e): the kernels compute logits in base 2.
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TileSizes:
    """Tile sizes and launch options of one kernel.

    Attributes:
        block_m: rows of a query tile (``queries_per_tile * rep`` of them used).
        queries_per_tile: queries per query tile (``QPT = block_m // rep``).
        block_n: keys per key tile.
        num_warps, num_stages: CUDA launch options (ignored by the interpreter).
    """

    block_m: int
    queries_per_tile: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillBlocks:
    """The tiles of one call's kernels.

    Attributes:
        forward, dq, dkdv: the forward kernel's, the ``dq`` kernel's and the ``dk``/``dv``
            kernel's tiles (the latter's ``block_n`` keys per program).
        block_d: head size padded to a power of two (at least 16).
        count_step: tokens per entry of the layouts' count tables.
    """

    forward: TileSizes
    dq: TileSizes
    dkdv: TileSizes
    block_d: int
    count_step: int


#: ``(block_m, block_n, num_warps, num_stages)`` of the forward, dq and dk/dv kernels on CUDA,
#: by padded head size (half precision): the largest tiles tried for which ptxas reports no
#: register spill on sm_90 and sm_100 at one, three and four query heads per key-value head
#: (every row and column of a tile is a gathered load: its 64-bit addresses take registers).
#: The spills that remain are named with their reasons in
#: :data:`~.triton_compile.NAMED_SPILLS`; python -m focus_attention.ops.sparse.triton_compile
#: prints them. float32 inputs (FMA dots, a correctness path) take small tiles by head size
#: (``_FP32_TILES``, more warps for wide ones); the interpreter small tiles whose edges the
#: tests cross (the backward's differ from the forward's, as on CUDA).
_CUDA_TILES = {
    64: ((64, 64, 8, 2), (64, 64, 8, 2), (32, 32, 8, 2)),
    128: ((64, 32, 8, 2), (64, 32, 8, 2), (32, 64, 8, 2)),
    256: ((64, 16, 8, 2), (64, 16, 8, 1), (32, 32, 8, 1)),
}
_FP32_TILES = {
    64: ((16, 16, 8, 1), (16, 16, 8, 1), (16, 16, 8, 1)),
    128: ((16, 16, 8, 1), (16, 16, 8, 1), (16, 16, 8, 1)),
    256: ((16, 16, 8, 1), (16, 16, 8, 1), (16, 16, 8, 1)),
}
#: float32 tiles of at least this many query rows at D = 256 (64 or more query heads per
#: key-value head) run this many warps: 4.9-7.1 KB spilled instead of up to 17.9 KB at 8
_FP32_WIDE_ROWS, _FP32_WIDE_WARPS = 64, 16
_INTERPRETER_TILES = ((32, 16, 1, 1), (16, 32, 1, 1), (16, 32, 1, 1))


def prefill_blocks(
    head_dim: int, rep: int, dtype: torch.dtype = torch.bfloat16, *, interpret: bool | None = None
) -> PrefillBlocks:
    """The fixed tiles for ``head_dim``, ``rep`` query heads per key-value head and the input
    ``dtype``: CUDA tiles by head size (``_CUDA_TILES``; no autotuning), or, under Triton's
    interpreter (``interpret``, default: whether ``TRITON_INTERPRET=1``), small tiles whose
    edges tests cross at small lengths. A query tile has at least ``rep`` rows; a tile
    that needs more rows than the table's for that (more than 32 or 64 query heads per
    key-value head) takes proportionally fewer keys, at least 16.

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
        table, step = _INTERPRETER_TILES, 16
    elif dtype == torch.float32:
        table, step = _FP32_TILES[max(64, block_d)], 64
    else:
        table, step = _CUDA_TILES[max(64, block_d)], 64
    wide = dtype == torch.float32 and not interpret and block_d == 256
    tiles = []
    for block_m, block_n, warps, stages in table:
        rows = max(block_m, 1 << (rep - 1).bit_length())  # at least one query per tile
        block_n = max(16, block_m * block_n // rows)  # the tile's area kept for more rows
        warps = _FP32_WIDE_WARPS if wide and rows >= _FP32_WIDE_ROWS else warps
        tiles.append(TileSizes(rows, rows // rep, block_n, warps, stages))
    return PrefillBlocks(*tiles, block_d=block_d, count_step=step)


def _code_dtype(num_groups: int) -> torch.dtype:
    """int32 codes where ``K`` fits one (faster on GPUs), else int64."""
    return torch.int32 if num_groups <= _INT32_GROUPS else torch.int64


@dataclass(frozen=True)
class ClassOrder:
    """A token list (the queries, or the keys) sorted by membership class: by group code,
    then by position, each token once; per batch element and routing row (``R``).

    Attributes:
        rows: int32 ``[B, R, N]`` the token index of each row.
        codes: ``[B, R, N]`` the group code of each row (int32 for ``K <= 31``, else int64;
            bit ``g`` set iff the token holds group ``g``).
    """

    rows: torch.Tensor
    codes: torch.Tensor


def class_order(members: torch.Tensor) -> ClassOrder:
    """The :class:`ClassOrder` of bool memberships ``[B, R, N, K]`` (a stable sort of the
    codes on their device; no host synchronisation)."""
    codes, order = torch.sort(group_codes(members), dim=-1, stable=True)
    return ClassOrder(order.to(torch.int32), codes.to(_code_dtype(members.shape[-1])))


@dataclass(frozen=True)
class GroupOrder:
    """A token list laid out group by group (docs/method.md §5): the tokens of group 0 in
    position order, then those of group 1, ..., one row per membership; per batch element and
    routing row (``R``).

    Attributes:
        rows: int32 ``[B, R, N * K + 1]`` the token index of each row; rows past the last
            membership are unused (``N * K`` bounds the memberships; the final row takes the
            non-members' writes while it is built).
        segments: int32 ``[B, R, K]`` where group ``g`` starts in ``rows``.
        counts: int32 ``[B, R, ceil(N / step), K]``: entry ``[.., c, g]`` counts the tokens
            of group ``g`` with index below ``(c + 1) * step`` (the last entry: all of them).
        codes: ``[B, R, N]`` the group code of each token, in token order (int32 for
            ``K <= 31``, else int64).
        low_masks: ``[K]`` of the codes' dtype, ``2**g - 1`` (the groups below ``g``).
        step: tokens per entry of ``counts``.
    """

    rows: torch.Tensor
    segments: torch.Tensor
    counts: torch.Tensor
    codes: torch.Tensor
    low_masks: torch.Tensor
    step: int


def group_order(members: torch.Tensor, step: int) -> GroupOrder:
    """The :class:`GroupOrder` of bool memberships ``[B, R, N, K]`` (``N >= 1``; padding
    already removed from them), built with fixed-shape operations on their device (a
    cumulative count and a scatter; no host synchronisation, the same operations for any
    routing of the same shapes).

    Raises:
        ValueError: ``step`` not an int ``>= 1``.
    """
    check_int("group_order", "step", step, 1)
    bsz, routes, n, k = members.shape
    device = members.device
    cum = torch.cumsum(members, dim=2, dtype=torch.int32)  # [B, R, N, K]
    totals = cum[:, :, -1, :]
    segments = torch.cumsum(totals, dim=-1, dtype=torch.int32) - totals
    slots = n * k
    dest = (segments[:, :, None, :] + cum - 1).to(torch.int64)
    dest = torch.where(members, dest, slots).reshape(bsz, routes, slots)
    tokens = torch.arange(n, dtype=torch.int32, device=device)
    tokens = tokens[None, None, :, None].expand(bsz, routes, n, k).reshape(bsz, routes, slots)
    rows = torch.zeros(bsz, routes, slots + 1, dtype=torch.int32, device=device)
    rows.scatter_(2, dest, tokens)
    ends = torch.arange(step, n + step, step, device=device).clamp(max=n) - 1
    low = group_codes(torch.ones(k, k, dtype=torch.bool, device=device).tril(-1))  # 2**g - 1
    code_dtype = _code_dtype(k)
    codes = group_codes(members).to(code_dtype)
    return GroupOrder(rows, segments, cum.index_select(2, ends), codes, low.to(code_dtype), step)


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
    Differentiable in ``query``, ``key`` and ``value`` (FlashAttention-2's backward over the
    same layouts; the log-sum-exp output too).

    Args:
        query: ``[B, H, Nq, D]`` float32, bfloat16 or float16, ``D <= 256``; any strides
            (see "Layouts" in the module docstring).
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
            and ``> 0``, a batch or ``H_kv`` above 65,535 (CUDA's grid).
        BackendUnavailable: (a ``ValueError``) Triton cannot run here (the reason).
    """
    window, scale = _checked(query, key, value, query_groups, key_groups, window, scale,
                             softcap, key_padding_mask)  # fmt: skip
    reason = triton_reason(query.device)
    if reason is not None:
        raise BackendUnavailable(f"group_prefill: received {query.device} tensors, expected "
                                 f"a device the Triton kernels run on: it {reason}")  # fmt: skip
    b, h, nq, d = query.shape
    if query.numel() == 0:  # also Nk = 0, which implies Nq = 0
        lse = query.new_full((b, nq, h), -math.inf, dtype=torch.float32)
        return query.new_zeros(b, nq, h, d), lse if needs_lse else None
    args = (query, key, value, query_groups, key_groups, key_padding_mask, window, scale, softcap)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        out, lse = _GroupPrefill.apply(*args)
        return out, lse if needs_lse else None
    launch = _Launch.of(*args)
    keys = group_order(launch.key_members(), launch.blocks.count_step)
    return _forward(launch, class_order(query_groups), keys, needs_lse)


def prefill_launches(
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
    interpret: bool = False,
) -> list[KernelLaunch]:
    """The four kernel launches of a differentiated :func:`group_prefill` call (forward,
    then the backward's ``delta``, ``dq`` and ``dk``/``dv`` kernels) as its launcher builds
    them, without running them: the layouts and result buffers are allocated on the inputs'
    device (any device: nothing is launched), with the CUDA tiles (``interpret`` False) or
    the interpreter's. ``needs_lse``: the log-sum-exp output is returned, so its gradient
    reaches the backward. What :mod:`.triton_compile` compiles for GPU targets.

    Raises:
        ValueError: as :func:`group_prefill` (not ``BackendUnavailable``), for a non-empty
            call.
    """
    window, scale = _checked(query, key, value, query_groups, key_groups, window, scale,
                             softcap, key_padding_mask)  # fmt: skip
    if query.numel() == 0:
        fail("query", f"shape {tuple(query.shape)}", "a non-empty call (it launches nothing)")
    launch = _Launch.of(query, key, value, query_groups, key_groups, key_padding_mask, window,
                        scale, softcap, interpret=interpret)  # fmt: skip
    queries = class_order(query_groups)
    keys = group_order(launch.key_members(), launch.blocks.count_step)
    out, lse = _results(launch, needs_lse=True)
    dlse = torch.zeros_like(lse) if needs_lse else None
    backward, _ = _backward_launches(launch, out, lse, None, dlse, queries, keys, needs_dq=True)
    return [_forward_launch(launch, queries, keys, out, lse, needs_lse=True), *backward]


#: rows of ``[B * Nq * H, D]`` per program of the backward's ``delta`` kernel
DELTA_ROWS = 16


def prefill_grids(batch: int, heads: int, kv_heads: int, nq: int, nk: int,
                  blocks: PrefillBlocks) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """The launch grids of the prefill kernels, by kernel name, from shapes alone: query or
    key tiles along x, key-value heads along y, the batch along z (the backward's ``delta``
    kernel: blocks of ``DELTA_ROWS`` rows of ``Nq x H`` along x, the batch along y).

    Raises:
        ValueError: a grid beyond CUDA's limits (:func:`~.triton_support.check_grid`): more
            than 65,535 key-value heads or batch elements.
    """
    axes = ("query tiles", "key-value heads H_kv", "batch B")
    grids = {
        "group_prefill_fwd": (_cdiv(nq, blocks.forward.queries_per_tile), kv_heads, batch),
        "group_prefill_bwd_delta": (_cdiv(nq * heads, DELTA_ROWS), batch),
        "group_prefill_bwd_dq": (_cdiv(nq, blocks.dq.queries_per_tile), kv_heads, batch),
        "group_prefill_bwd_dkdv": (_cdiv(nk, blocks.dkdv.block_n), kv_heads, batch),
    }
    rows = ("blocks of Nq x H rows", "batch B")
    for name, grid in grids.items():
        check_grid("query", name, grid, rows if len(grid) == 2 else axes)
    return grids


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its last dimension is contiguous (any other strides: views of a
    fused projection, transposes, cache slices, expanded heads), else a contiguous copy
    (the kernels read rows of ``D`` consecutive elements)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


@dataclass(frozen=True)
class _Launch:
    """What every kernel launch of one call shares."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_groups: torch.Tensor
    key_groups: torch.Tensor
    padding: torch.Tensor | None
    window: int
    scale: float
    softcap: float | None
    blocks: PrefillBlocks
    grids: dict[str, tuple[int, ...]]
    interpret: bool

    @classmethod
    def of(cls, q, k, v, query_groups, key_groups, padding, window, scale, softcap, *,
           interpret: bool | None = None) -> _Launch:  # fmt: skip
        """The launch of checked inputs (``interpret``: the interpreter's tiles and dots;
        default: whether ``TRITON_INTERPRET=1``)."""
        interpret = interpreting() if interpret is None else interpret
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        (b, h, nq, d), (h_kv, nk) = q.shape, k.shape[1:3]
        blocks = prefill_blocks(d, h // h_kv, q.dtype, interpret=interpret)
        grids = prefill_grids(b, h, h_kv, nq, nk, blocks)
        return cls(q, k, v, query_groups, key_groups, padding, window, scale, softcap, blocks,
                   grids, interpret)  # fmt: skip

    def key_members(self) -> torch.Tensor:
        """The keys' memberships without padding keys."""
        if self.padding is None:
            return self.key_groups
        return self.key_groups & self.padding[:, None, :, None]

    def real(self) -> torch.Tensor:
        """The padding mask as bytes (any tensor when there is none: not read)."""
        return self.q if self.padding is None else self.padding.contiguous().view(torch.uint8)

    def numbers(self, out: torch.Tensor, lse: torch.Tensor, *grads: torch.Tensor) -> list:
        """Strides (query, key, value, token-major output, log-sum-exp, then each gradient
        buffer's own) and sizes."""
        tensors = (self.q, self.k, self.v, out)
        strides = [s for x in (*tensors, *grads) for s in x.stride()[:3]]
        strides[12:12] = lse.stride()[:2]
        sizes = [self.q.shape[2], self.k.shape[2], self.window, self.query_groups.shape[1],
                 self.query_groups.shape[3]]  # fmt: skip
        return [*strides, *sizes]

    def scales(self) -> list:
        """``scale * log2(e)``, ``scale / softcap``, ``softcap * log2(e)`` (1 for no cap)."""
        cap = 1.0 if self.softcap is None else self.softcap
        return [self.scale * _LOG2E, self.scale / cap, cap * _LOG2E]

    def constants(self, tiles: TileSizes) -> dict:
        """A kernel's compile-time arguments and launch options for ``tiles``."""
        blocks, h, d = self.blocks, self.q.shape[1], self.q.shape[3]
        return dict(REP=h // self.k.shape[1], QPT=tiles.queries_per_tile,
                    BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=blocks.block_d,
                    HEAD_DIM=d, COUNT_STEP=blocks.count_step,
                    HAS_SOFTCAP=self.softcap is not None, HAS_PADDING=self.padding is not None,
                    EXACT=self.q.dtype == torch.float32 or self.interpret,
                    num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip


def _results(launch: _Launch, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's token-major ``out [B, Nq, H, D]`` and float32 ``lse [B, Nq, H]`` (the
    output itself in its place when not needed: not written)."""
    b, h, nq, d = launch.q.shape
    out = torch.empty(b, nq, h, d, dtype=launch.q.dtype, device=launch.q.device)
    lse = torch.empty(b, nq, h, dtype=torch.float32, device=out.device) if needs_lse else out
    return out, lse


def _forward_launch(launch: _Launch, queries: ClassOrder, keys: GroupOrder, out: torch.Tensor,
                    lse: torch.Tensor, needs_lse: bool) -> KernelLaunch:  # fmt: skip
    """The forward kernel's launch into ``out`` and ``lse``."""
    args = (launch.q, launch.k, launch.v, out, lse, queries.rows, queries.codes, keys.rows,
            keys.codes, keys.segments, keys.counts, keys.low_masks, launch.real(),
            *launch.numbers(out, lse), *launch.scales())  # fmt: skip
    constants = dict(WRITE_LSE=needs_lse, **launch.constants(launch.blocks.forward))
    return KernelLaunch("group_prefill_fwd", launch.grids["group_prefill_fwd"], args, constants)


def _forward(launch: _Launch, queries: ClassOrder, keys: GroupOrder, needs_lse: bool):
    """Allocate the results and launch the forward kernel (no host synchronisation)."""
    from . import triton_prefill_kernels as kernels  # lazy: defining a kernel picks its mode

    out, lse = _results(launch, needs_lse)
    _forward_launch(launch, queries, keys, out, lse, needs_lse).start(kernels)
    return out, lse if needs_lse else None


def _backward_launches(launch: _Launch, out, lse, dout, dlse, queries: ClassOrder,
                       keys: GroupOrder, needs_dq: bool):  # fmt: skip
    """The backward's launches (the ``delta`` pass, the query-tile kernel for ``dq`` when
    ``needs_dq``, the key-tile kernel for ``dk``/``dv``, which lays the keys out by class
    and the queries by group) and the gradients they write, ``(dq or None, dk, dv)``. Each
    gradient is allocated like its input where that is dense, else contiguous, and its own
    strides reach the kernel: an input may be a view with gaps (a split of a fused
    projection, a cache slice) or with a stride 0 (expanded heads)."""
    q, k, v = launch.q, launch.k, launch.v
    b, h, nq, d = q.shape
    dout = out.new_zeros(out.shape) if dout is None else dout.contiguous()
    delta = torch.empty_like(lse)
    delta_args = (out, dout, lse if dlse is None else dlse.contiguous(), delta, nq * h)
    launches = [KernelLaunch("group_prefill_bwd_delta", launch.grids["group_prefill_bwd_delta"],
                             delta_args, dict(HEAD_DIM=d, ROWS=DELTA_ROWS, HAS_DLSE=dlse is not None,
                                              BLOCK_D=launch.blocks.block_d))]  # fmt: skip
    dq = torch.empty_like(q) if needs_dq else None
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    scales = [launch.scale, *launch.scales()]
    if dq is not None:
        args = (q, k, v, dout, lse, delta, dq, queries.rows, queries.codes, keys.rows,
                keys.codes, keys.segments, keys.counts, keys.low_masks, launch.real(),
                *launch.numbers(dout, lse, dq), *scales)  # fmt: skip
        launches.append(KernelLaunch("group_prefill_bwd_dq", launch.grids["group_prefill_bwd_dq"],
                                     args, launch.constants(launch.blocks.dq)))  # fmt: skip
    key_classes = class_order(launch.key_members())
    query_groups = group_order(launch.query_groups, launch.blocks.count_step)
    args = (q, k, v, dout, lse, delta, dk, dv, key_classes.rows, key_classes.codes,
            query_groups.rows, query_groups.codes, query_groups.segments, query_groups.counts,
            query_groups.low_masks, launch.real(), *launch.numbers(dout, lse, dk, dv), *scales)  # fmt: skip
    launches.append(KernelLaunch("group_prefill_bwd_dkdv", launch.grids["group_prefill_bwd_dkdv"],
                                 args, launch.constants(launch.blocks.dkdv)))  # fmt: skip
    return launches, (dq, dk, dv)


def _backward(launch: _Launch, out, lse, dout, dlse, queries: ClassOrder, keys: GroupOrder,
              needs_dq: bool):  # fmt: skip
    """Run the backward's launches (:func:`_backward_launches`); ``(dq, dk, dv)``."""
    from . import triton_prefill_kernels as kernels  # lazy: defining a kernel picks its mode

    launches, grads = _backward_launches(launch, out, lse, dout, dlse, queries, keys, needs_dq)
    for item in launches:
        item.start(kernels)
    return grads


class _GroupPrefill(torch.autograd.Function):
    """:func:`group_prefill` with gradients for ``query``, ``key`` and ``value`` (and through
    the log-sum-exp output). The forward's layouts are kept for the backward, which builds
    the two it adds (keys by class, queries by group)."""

    @staticmethod
    def forward(ctx, query, key, value, query_groups, key_groups, padding, window, scale, softcap):
        launch = _Launch.of(query, key, value, query_groups, key_groups, padding, window, scale,
                            softcap)  # fmt: skip
        queries = class_order(query_groups)
        keys = group_order(launch.key_members(), launch.blocks.count_step)
        out, lse = _forward(launch, queries, keys, needs_lse=True)
        ctx.launch, ctx.queries, ctx.keys = launch, queries, keys
        ctx.save_for_backward(out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.launch, out, lse, dout, dlse, ctx.queries, ctx.keys,
                               ctx.needs_input_grad[0])  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None


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
    q_shape, k_shape = query_groups.shape, key_groups.shape
    if q_shape[1] != k_shape[1] or q_shape[3] != k_shape[3]:
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
