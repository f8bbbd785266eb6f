"""Decoding that reads only the keys a query attends: :func:`bucket_decode`, a Triton kernel
over a key-value cache and its :class:`~.buckets.GroupBuckets` (docs/method.md §4-§5,
"Decoding"), and :func:`bucket_decode_reference`, the same function in PyTorch.

A decoding step of ``Nq`` queries (1, or a few speculative tokens) against a preallocated
cache of capacity ``C`` attends, per query, its local window and the keys of its groups
older than the window, which the buckets list per group. Nothing is read back to the host
and no shape depends on values (the launch grid depends on shapes only), so a step can be
captured in a CUDA graph. Each (row, key-value head, query) runs ``num_splits`` programs
(flash-decoding: batch-1 parallelism), each taking an equal share of the window and of every
bucket, merged by log-sum-exp in a second small kernel (none when ``num_splits = 1``).

The kernels run on CUDA, and on CPU tensors under Triton's interpreter
(:mod:`.triton_support`); elsewhere :func:`bucket_decode` raises ``BackendUnavailable`` and
:func:`bucket_decode_reference` is the fallback.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...utils.checks import check_int
from ..checks import check_bool, check_device, check_positive, check_qkv, check_tensor, fail
from ..masks import effective_window
from ..reference import masked_attention
from .buckets import GroupBuckets
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
    "BLOCK_KEYS",
    "KERNEL_DTYPES",
    "MAX_BLOCK_HEADS",
    "MAX_HEAD_DIM",
    "MAX_SPLITS",
    "MERGE_TILE",
    "MIN_PROGRAMS_PER_SM",
    "MIN_SPLIT_KEYS",
    "DECODE_TILES",
    "DecodeCall",
    "bucket_decode",
    "bucket_decode_reference",
    "check_decode",
    "decode_launches",
    "decode_tiles",
    "default_num_splits",
    "reference_visibility",
]

#: input dtypes of the kernel.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: largest ``head_dim`` the kernel takes (any ``D`` in ``1..256``: it is padded to a power
#: of two of at least 16 inside the kernel).
MAX_HEAD_DIM = 256
#: most splits per (row, key-value head, query).
MAX_SPLITS = 128
#: keys per block of the kernel's loops under Triton's interpreter (on CUDA:
#: :data:`DECODE_TILES`).
BLOCK_KEYS = 64
#: ``(keys per block, warps, most query heads per program)`` of the split kernel on CUDA by
#: head size padded to a power of two (at least 64): the largest blocks for which ptxas
#: reports no register spill on sm_80, sm_90 and sm_100 in half precision, within every
#: target's shared memory (the compile table, :mod:`.triton_compile`).
DECODE_TILES = {64: (32, 8, 64), 128: (32, 8, 32), 256: (16, 8, 32)}
#: most partial results (splits x head-dimension columns) per step of the merge kernel, whose
#: 4 warps hold them in registers (ptxas reports no spill at 128 splits)
MERGE_TILE = 2048
#: most query heads of one key-value head in one program (more run in several programs).
MAX_BLOCK_HEADS = 64
#: on CUDA the default split count aims at this many programs per streaming multiprocessor,
MIN_PROGRAMS_PER_SM = 2
#: and gives each split at least this many cache positions.
MIN_SPLIT_KEYS = 512

_OWNER = "bucket_decode"


@dataclass(frozen=True)
class DecodeCall:
    """A checked call of :func:`bucket_decode` (see it for the arguments); ``window`` capped
    at ``max(1, C)``, ``scale`` resolved to a float."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_groups: torch.Tensor
    buckets: GroupBuckets
    key_lengths: torch.Tensor
    key_padding_mask: torch.Tensor | None
    window: int
    scale: float
    softcap: float | None


def check_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_groups: torch.Tensor,
    buckets: GroupBuckets,
    key_lengths: torch.Tensor,
    window: int,
    scale: float | None,
    softcap: float | None,
    key_padding_mask: torch.Tensor | None,
) -> DecodeCall:
    """Validate the arguments shared by :func:`bucket_decode` and
    :func:`bucket_decode_reference` (shapes, dtypes, devices; no value is read).

    Raises:
        ValueError: as listed in :func:`bucket_decode`.
    """
    check_qkv(query, key, value)
    b, _, nq, _ = query.shape
    h_kv, capacity = key.shape[1], key.shape[2]
    _check_routing(query_groups, buckets, b, h_kv, nq, capacity)
    check_device("query_groups", query_groups, query.device, "query")
    check_device("buckets", buckets.index, query.device, "query")
    check_tensor("key_lengths", key_lengths, 1)
    if key_lengths.dtype not in (torch.int32, torch.int64) or key_lengths.shape[0] != b:
        fail("key_lengths", f"a {key_lengths.dtype} tensor of shape "
             f"{tuple(key_lengths.shape)}", f"int32 or int64 [B={b}]")  # fmt: skip
    check_device("key_lengths", key_lengths, query.device, "query")
    key_lengths = key_lengths.contiguous()  # the kernel reads it by row index (e.g. an expand)
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, 2)
        check_bool("key_padding_mask", key_padding_mask)
        if tuple(key_padding_mask.shape) != (b, capacity):
            fail("key_padding_mask", f"shape {tuple(key_padding_mask.shape)}",
                 f"[B={b}, C={capacity}], True = real")  # fmt: skip
        check_device("key_padding_mask", key_padding_mask, query.device, "query")
    check_int(_OWNER, "window", window, 1)
    if nq > capacity:
        fail("query", f"Nq = {nq} queries for a cache of C = {capacity} keys", "Nq <= C")
    scale = check_positive("scale", scale)
    softcap = check_positive("softcap", softcap)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return DecodeCall(query, key, value, query_groups, buckets, key_lengths, key_padding_mask,
                      effective_window(window, capacity), scale, softcap)  # fmt: skip


def _check_routing(query_groups, buckets, batch: int, kv_heads: int, nq: int, capacity: int):
    """``query_groups`` bool ``[B, R, Nq, K]`` with ``R`` 1 or ``H_kv``, and buckets of the
    same ``B``, ``R``, ``K`` over the cache's capacity."""
    check_tensor("query_groups", query_groups, 4)
    check_bool("query_groups", query_groups)
    b, r, q_len, k = query_groups.shape
    if b != batch or q_len != nq or r not in (1, kv_heads):
        fail("query_groups", f"shape {tuple(query_groups.shape)}",
             f"[B={batch}, R=1 or H_kv={kv_heads}, Nq={nq}, K]")  # fmt: skip
    if not 1 <= k <= MAX_KERNEL_GROUPS:
        fail("query_groups", f"K = {k} groups", f"1 <= K <= {MAX_KERNEL_GROUPS}")
    if not isinstance(buckets, GroupBuckets):
        fail("buckets", type(buckets).__name__, "a GroupBuckets")
    expected = (batch, r, k, capacity)
    got = (buckets.batch, buckets.rows, buckets.num_groups, buckets.capacity)
    if got != expected:
        fail("buckets", "B, R, K, C = {}, {}, {}, {}".format(*got),
             "B, R, K, C = {}, {}, {}, {} (the query groups' and the cache's)".format(
                 *expected))  # fmt: skip


def bucket_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_groups: torch.Tensor,
    buckets: GroupBuckets,
    key_lengths: torch.Tensor,
    window: int,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    needs_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Focus attention of a decoding step over a key-value cache, reading only the keys each
    query attends (docs/method.md §4-§5): a Triton kernel, no host synchronisation, a launch
    grid that depends on shapes only (capturable in a CUDA graph).

    Query ``t`` of row ``b`` sits at position ``pos = L_b - Nq + t``; it attends key ``j``
    iff ``j <= pos``, key ``j`` is real, and ``pos - j < window`` or the query and the key
    share a group (through routing row ``h`` for key-value head ``h`` when ``R = H_kv``,
    row 0 when ``R = 1``): :func:`~focus_attention.ops.sparse_attention` on the first ``L_b``
    keys of the row. A query at a negative position (``L_b < Nq``) sees nothing.

    Args:
        query: ``[B, H, Nq, D]``, float32, bfloat16 or float16, ``1 <= D <= 256``.
        key, value: ``[B, H_kv, C, D]`` caches of capacity ``C`` (any strides, e.g. views of
            larger buffers), ``H % H_kv == 0``. Slots at or beyond a row's length may hold
            anything (NaN, inf): they are never read.
        query_groups: bool ``[B, R, Nq, K]``, ``R`` 1 or ``H_kv``, ``1 <= K <= 62``.
        buckets: the cache's :class:`~.buckets.GroupBuckets` (``B``, ``R``, ``K``, ``C``),
            holding exactly the keys ``0 .. L_b - 1`` of row ``b`` (crop them with the
            cache: an entry at or beyond ``L_b`` makes the result wrong).
        key_lengths: int32 or int64 ``[B]``, ``L_b`` keys cached in row ``b``,
            ``Nq <= L_b <= C`` (not checked, which would read the device; clamped to ``0..C``).
        window: local window in tokens, an int ``>= 1`` (counts the query itself).
        scale: logit scale, default ``D ** -0.5``.
        softcap: Gemma-2 logit soft-capping ``c * tanh(logits / c)``, or None.
        key_padding_mask: bool ``[B, C]``, True = real key (left padding), or None.
        num_splits: programs per (row, key-value head, query) along the keys, ``1..128``;
            default :func:`default_num_splits` (shapes only).
        needs_lse: return the log-sum-exp (else None in its place).

    Returns:
        Token-major ``out [B, Nq, H, D]`` in the query's dtype and float32
        ``lse [B, Nq, H]`` (natural log; zeros and ``-inf`` for a query that sees no key),
        or ``(out, None)`` when ``needs_lse`` is False.

    Raises:
        ValueError: wrong ranks, shapes, dtypes or devices; ``H % H_kv != 0``; ``K`` outside
            ``1..62``; ``Nq > C``; ``window`` not an int ``>= 1``; ``scale``/``softcap`` not
            a finite number ``> 0``; ``num_splits`` not an int in ``1..128``; a dtype other
            than float32/bfloat16/float16 or ``D > 256`` (the kernel's limits).
        BackendUnavailable: (a ``ValueError``) the kernels cannot run on the inputs' device
            (the reason from :func:`~.triton_support.triton_reason`).
    """
    call = check_decode(query, key, value, query_groups, buckets, key_lengths, window, scale,
                        softcap, key_padding_mask)  # fmt: skip
    _check_kernel_limits(call.query, num_splits)
    b, h, nq, d = query.shape
    out = torch.empty(b, nq, h, d, dtype=query.dtype, device=query.device)
    lse = torch.empty(b, nq, h, dtype=torch.float32, device=query.device)
    if out.numel() == 0:  # a zero-size call: nothing to launch
        return out, lse.fill_(-math.inf) if needs_lse else None
    if num_splits is None:
        num_splits = default_num_splits(b, key.shape[1], nq, key.shape[2], query.device)
    _launch(call, out, lse, num_splits)
    return out, lse if needs_lse else None


def _check_kernel_limits(query: torch.Tensor, num_splits: int | None) -> None:
    """What the kernel takes beyond :func:`check_decode`: its dtypes, ``D <= 256``, the
    split count, and a device where Triton runs (else ``BackendUnavailable``)."""
    if query.dtype not in KERNEL_DTYPES:
        fail("query", f"dtype {query.dtype}", "float32, bfloat16 or float16 (the kernel's)")
    if query.shape[-1] > MAX_HEAD_DIM:
        fail("query", f"head_dim D = {query.shape[-1]}", f"1 <= D <= {MAX_HEAD_DIM}")
    if num_splits is not None:
        check_int(_OWNER, "num_splits", num_splits, 1)
        if num_splits > MAX_SPLITS:
            fail(f"{_OWNER}.num_splits", repr(num_splits), f"an int in 1..{MAX_SPLITS}")
    reason = triton_reason(query.device)
    if reason is not None:
        raise BackendUnavailable(f"{_OWNER}: the Triton kernel {reason}")


def _launch(call: DecodeCall, out: torch.Tensor, lse: torch.Tensor, num_splits: int) -> None:
    """Run the kernels of a checked, non-empty call into token-major ``out``/``lse``."""
    # Triton picks compile or interpret when a kernel is defined: import on first launch
    from . import triton_decode_kernels as kernels

    for launch in decode_launches(call, out, lse, num_splits):
        launch.start(kernels)


def decode_launches(call: DecodeCall, out: torch.Tensor, lse: torch.Tensor, num_splits: int, *,
                    interpret: bool | None = None) -> list[KernelLaunch]:  # fmt: skip
    """The launches of :func:`bucket_decode` for a checked, non-empty call (a
    :class:`DecodeCall` from :func:`check_decode`) into token-major ``out [B, Nq, H, D]`` and
    float32 ``lse [B, Nq, H]``, built but not run: the split programs, and with
    ``num_splits > 1`` their merge (the float32 partial results are allocated here).
    ``interpret``: the interpreter's dots (default: whether ``TRITON_INTERPRET=1``).

    One program per (row, key-value head, query, block of query heads) along x, one per
    split along y (the grid's y axis is limited to 65,535: splits are at most 128).

    Raises:
        ValueError: more programs than a CUDA grid's x axis takes (``2**31 - 1``).
    """
    b, nq, h, d = out.shape
    h_kv = call.key.shape[1]
    rep = h // h_kv
    interpret = interpreting() if interpret is None else interpret
    if num_splits == 1:  # the programs write the final results
        part_out, part_lse = out[:, :, :, None], lse[:, :, :, None]
    else:
        part_out = out.new_empty(b, nq, h, num_splits, d, dtype=torch.float32)
        part_lse = lse.new_empty(b, nq, h, num_splits)
    block_keys, warps, most_heads = decode_tiles(d, interpret)
    block_heads = min(MAX_BLOCK_HEADS, most_heads, max(16, _next_power_of_2(rep)))
    head_blocks = -(-rep // block_heads)
    grid = check_grid("query", "bucket_decode", (b * h_kv * nq * head_blocks, num_splits),
                      ("programs B x H_kv x Nq x head blocks", "splits"))  # fmt: skip
    query_codes = group_codes(call.query_groups)  # [B, R, Nq]
    buckets, padding = call.buckets, call.key_padding_mask
    pad = call.key_lengths if padding is None else padding
    pad_strides = (0, 0) if padding is None else padding.stride()
    args = (call.query, call.key, call.value, query_codes, buckets.codes, buckets.index,
            buckets.count, call.key_lengths, pad, part_out, part_lse,
            nq, h_kv, rep, head_blocks, call.key.shape[2], call.window, buckets.num_groups,
            num_splits, call.scale, 1.0 if call.softcap is None else call.softcap,
            *call.query.stride(), *call.key.stride(), *call.value.stride(),
            *query_codes.stride(), *buckets.codes.stride(), *buckets.index.stride(),
            *buckets.count.stride(), *pad_strides, *part_out.stride(), *part_lse.stride())  # fmt: skip
    options = dict(HEAD_DIM=d, BLOCK_H=block_heads, BLOCK_D=max(16, _next_power_of_2(d)),
                   BLOCK_N=block_keys, PER_HEAD=query_codes.shape[1] > 1,
                   HAS_PAD=padding is not None, SOFTCAP=call.softcap is not None,
                   DOT=_dot_mode(call.query.dtype, interpret), num_warps=warps)  # fmt: skip
    launches = [KernelLaunch("decode_partials", grid, args, options)]
    if num_splits > 1:
        args = (part_out, part_lse, out, lse, num_splits)
        block_s = _next_power_of_2(num_splits)
        block_d = min(_next_power_of_2(d), max(16, MERGE_TILE // block_s))
        options = dict(HEAD_DIM=d, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)
        launches.append(KernelLaunch("decode_merge", (b * nq * h,), args, options))
    return launches


def decode_tiles(head_dim: int, interpret: bool) -> tuple[int, int, int]:
    """``(keys per block, warps, most query heads per program)`` of the split kernel for
    ``head_dim``: :data:`DECODE_TILES` on CUDA; under Triton's interpreter
    :data:`BLOCK_KEYS` (4 warps, ignored, and :data:`MAX_BLOCK_HEADS`)."""
    if interpret:
        return BLOCK_KEYS, 4, MAX_BLOCK_HEADS
    return DECODE_TILES[max(64, _next_power_of_2(head_dim))]


def _dot_mode(dtype: torch.dtype, interpret: bool) -> int:
    """The ``DOT`` mode of the split kernel's dots for inputs of ``dtype``: 1 for float32
    (IEEE, no TF32), 2 for bfloat16 under the interpreter (whose bfloat16 dots are not
    usable), else 0 (the inputs' dtype on tensor cores)."""
    if dtype == torch.float32:
        return 1
    return 2 if dtype == torch.bfloat16 and interpret else 0


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_num_splits(
    batch: int, kv_heads: int, num_queries: int, capacity: int, device: torch.device
) -> int:
    """The split count :func:`bucket_decode` uses by default, from shapes only (never from
    values, so a captured graph stays valid): 1 off CUDA (the interpreter runs programs one
    after another); on CUDA enough splits for :data:`MIN_PROGRAMS_PER_SM` programs per
    streaming multiprocessor, each split covering at least :data:`MIN_SPLIT_KEYS` cache
    positions, at most :data:`MAX_SPLITS`."""
    if torch.device(device).type != "cuda":
        return 1
    programs = max(1, batch * kv_heads * num_queries)
    wanted = -(-MIN_PROGRAMS_PER_SM * _sm_count(torch.device(device)) // programs)
    return max(1, min(wanted, capacity // MIN_SPLIT_KEYS, MAX_SPLITS))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side query, cached)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def bucket_decode_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_groups: torch.Tensor,
    buckets: GroupBuckets,
    key_lengths: torch.Tensor,
    window: int,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    needs_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`bucket_decode` in PyTorch, on any device and floating dtype: every query
    against the whole cache under its Focus mask, built on the device from the buckets'
    ``codes`` (the ``index`` lists are not read), in float32 (float64 for float64 inputs).
    A fixed sequence of device operations whose shapes depend on the input shapes only (no
    host synchronisation, no gather of a data-dependent size): the fallback where the
    kernel cannot run, and a second implementation to compare it with. ``num_splits`` is
    checked and otherwise ignored. Memory ``O(B x H x Nq x C)``.

    Returns and raises as :func:`bucket_decode`, except that any floating dtype and
    ``head_dim`` is taken, ``lse`` is float64 for float64 inputs, and nothing is
    ``BackendUnavailable``.
    """
    call = check_decode(query, key, value, query_groups, buckets, key_lengths, window, scale,
                        softcap, key_padding_mask)  # fmt: skip
    if num_splits is not None:
        check_int(_OWNER, "num_splits", num_splits, 1)
    visible, real = reference_visibility(call)  # [B, R, Nq, C], [B, C]
    ct = torch.promote_types(query.dtype, torch.float32)
    # a slot beyond the length may hold NaN: zero its value row (its weight is 0, NaN * 0 not)
    v = torch.where(real[:, None, :, None], value.to(ct), 0.0)
    out, lse = masked_attention(query, key, v, visible, scale=call.scale, softcap=call.softcap)
    out = out.transpose(1, 2).contiguous().to(query.dtype)
    return out, lse.transpose(1, 2).contiguous() if needs_lse else None


def reference_visibility(call: DecodeCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(visible, real)`` of a checked call: bool ``[B, R, Nq, C]``, key ``j`` visible to
    query ``t`` of routing row ``r`` (causal, real, in the window or sharing a group by the
    buckets' codes), and bool ``[B, C]``, the real keys below each row's length. Fixed-shape."""
    b, _, nq, _ = call.query.shape
    capacity = call.key.shape[2]
    dev = call.query.device
    length = call.key_lengths.to(torch.int64).clamp(0, capacity)
    slots = torch.arange(capacity, device=dev)
    real = slots < length[:, None]  # [B, C]
    if call.key_padding_mask is not None:
        real = real & call.key_padding_mask
    pos = length[:, None] - nq + torch.arange(nq, device=dev)  # [B, Nq]
    distance = pos[:, :, None] - slots  # [B, Nq, C]
    causal = (distance >= 0) & real[:, None, :]
    query_codes = group_codes(call.query_groups)  # [B, R, Nq]
    share = (call.buckets.codes[:, :, None, :] & query_codes[..., None]) != 0
    visible = causal[:, None] & ((distance < call.window)[:, None] | share)
    if visible.shape[1] == 1 and call.key.shape[1] > 1:  # one routing for every key-value head
        visible = visible.expand(b, call.key.shape[1], nq, capacity)
    return visible, real
