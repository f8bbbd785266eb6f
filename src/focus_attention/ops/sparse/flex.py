"""The ``flex`` backend: the decomposition of docs/method.md §5 as two calls of PyTorch's
FlexAttention (``torch.nn.attention.flex_attention``), merged by log-sum-exp.

- **local part**: queries and keys in token order. The block mask holds the blocks that
  contain pairs ``0 <= i - j < window`` (a sliding window; key blocks of padding only are
  left out); the ``mask_mod`` keeps the causal, real, in-window pairs that share *no* group
  (those belong to the group part).
- **group part**: tokens laid out group by group, stable in position (a token in ``top_k``
  groups appears once per group; with ``top_k = 1`` this is the paper's sort by group).
  Query rows and key rows of different groups never meet, so the block mask skips every
  block whose rows and columns hold different groups, and every block above the causal
  staircase. The ``mask_mod`` reads each row's group and original position from tensors:
  same group, key position <= query position, and a pair that shares several groups is kept
  only in the lowest of them (so it is counted once). Blocks of one group that lie wholly
  below the staircase, where no pair can share a lower group, are "full" (no ``mask_mod``).
- **merge**: a query's group rows (one per group it is in) and its local row are merged
  with :func:`focus_attention.ops.merge.merge_partials`; a part with no visible key has
  log-sum-exp ``-inf`` and contributes nothing, a query that sees nothing outputs zeros.

Group memberships enter the ``mask_mod`` as 62-bit integer codes (one int64 word per 62
groups), so any ``K`` works. Padding, GQA (``enable_gqa``), bottom-right aligned queries
(positions ``Nk - Nq + t``) and Gemma-2's soft-capping (a ``score_mod``) are handled.

Where it runs (torch 2.13): on CUDA FlexAttention is compiled (``torch.compile``,
block-sparse Triton kernels with log-sum-exp and backward), and ``"auto"`` chooses this
backend there. On CPU it runs eagerly: PyTorch's eager FlexAttention returns the
log-sum-exp but materialises each part's score matrix (``O(Nq x Nk)`` memory) and has no
backward, and compiled FlexAttention on CPU returns no log-sum-exp. So on CPU the backend
is exact, slow and inference-only, used when asked for by name (tests, comparisons). On
CUDA the compiled function takes PyTorch's automatic dynamic shapes; if compiling it that way
fails (seen once, torch 2.11 on an H200: Inductor found no kernel for a head_dim-16 input),
every later call compiles a kernel per shape instead, with one ``RuntimeWarning``.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.attention.flex_attention as flex_module
from torch._dynamo.exc import BackendCompilerFailed
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ..masks import CODE_BITS, group_code_words
from ..merge import merge_partials
from .dispatch import CPU_DTYPES, SparseBackend, SparseInputs, SparseRequest, register_backend

__all__ = [
    "CODE_BITS",
    "FLEX_BLOCK",
    "GroupLayout",
    "causal_block_mask",
    "flex_call",
    "group_block_mask",
    "group_layout",
    "local_block_mask",
    "membership_codes",
    "run_flex",
    "triton_available",
]

#: query and key block size of the block masks (FlexAttention's default tile).
FLEX_BLOCK = 128
#: group number of the filler rows that pad the group layout (never equal to a group).
_FILL_QUERY, _FILL_KEY = -1, -2

_COMPILED = None
_COMPILED_STATIC = None
#: set once compiling with dynamic shapes failed: every later call compiles per shape
_STATIC_ONLY = False


def membership_codes(groups: torch.Tensor) -> list[torch.Tensor]:
    """Bit codes of bool memberships ``[..., K]``: a list of ``ceil(K / 62)`` int64 tensors
    ``[...]``, word ``w`` holding groups ``62 w .. 62 w + 61`` (two rows share a group iff
    some word of theirs has a common bit)."""
    return group_code_words(groups)


def _share(a_codes, a_b, a_i, b_codes, b_b, b_i):
    """Inside a ``mask_mod``: whether row ``a_i`` and row ``b_i`` have a common bit."""
    common = None
    for a, b in zip(a_codes, b_codes, strict=True):
        word = (a[a_b, a_i] & b[b_b, b_i]) != 0
        common = word if common is None else common | word
    return common


def _blocks(n: int) -> int:
    return max(1, -(-n // FLEX_BLOCK))


def _block_mask(partial, full, mask_mod, q_len: int, kv_len: int) -> BlockMask:
    """A :class:`BlockMask` from bool block matrices ``partial`` / ``full`` ``[B, nQ, nK]``
    (``full``: every pair visible, no ``mask_mod``; may be None), with the transposed
    (query-block) lists that the backward needs computed here from the same matrices
    (``BlockMask.from_kv_blocks`` derives them with ``vmap``, which fails inside a
    compiled caller's graph)."""

    def ordered(dense):
        counts = dense.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort((~dense).to(torch.int32), dim=-1, stable=True)
        return counts[:, None].contiguous(), order.to(torch.int32)[:, None].contiguous()

    kv_num, kv_idx = ordered(partial)
    q_num, q_idx = ordered(partial.transpose(1, 2))
    full_kv = full_q = (None, None)
    if full is not None:
        full_kv, full_q = ordered(full), ordered(full.transpose(1, 2))
    return BlockMask(
        (q_len, kv_len),
        kv_num,
        kv_idx,
        *full_kv,
        q_num,
        q_idx,
        *full_q,
        BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
        mask_mod=mask_mod,
    )


# --------------------------------------------------------------------------------------
# local part
# --------------------------------------------------------------------------------------


def local_block_mask(inputs: SparseInputs, q_codes, k_codes) -> BlockMask:
    """Block mask of the local part (token order): blocks that hold a pair
    ``0 <= i - j < window``, minus key blocks of padding only; the ``mask_mod`` keeps the
    causal, real, in-window pairs that share no group (``q_codes`` / ``k_codes``: lists of
    int64 ``[B, Nq]`` / ``[B, Nk]``, :func:`membership_codes`)."""
    nq, nk = inputs.query.shape[2], inputs.key.shape[2]
    device = inputs.query.device
    real = inputs.key_padding_mask
    offset = torch.tensor(nk - nq, device=device)
    window = torch.tensor(inputs.window, device=device)

    def mask_mod(b, h, t, j):
        pos = t + offset
        keep = (j <= pos) & (pos - j < window)
        if real is not None:
            keep = keep & real[b, j]
        return keep & ~_share(q_codes, b, t, k_codes, b, j)

    nqb, nkb = _blocks(nq), _blocks(nk)
    t0 = torch.arange(nqb, device=device) * FLEX_BLOCK
    t1 = (t0 + FLEX_BLOCK).clamp(max=nq) - 1
    lo = (t0 + (nk - nq) - inputs.window + 1).clamp(min=0)  # first key of the block's band
    hi = t1 + (nk - nq)  # last key (causal)
    k0 = torch.arange(nkb, device=device) * FLEX_BLOCK
    k1 = (k0 + FLEX_BLOCK).clamp(max=nk) - 1
    band = (k0[None, :] <= hi[:, None]) & (k1[None, :] >= lo[:, None])  # [nQ, nK]
    if real is None:
        partial = band[None]
    else:
        padded = torch.zeros(real.shape[0], nkb * FLEX_BLOCK, dtype=torch.bool, device=device)
        padded[:, :nk] = real
        has_real = padded.view(real.shape[0], nkb, FLEX_BLOCK).any(dim=-1)  # [B, nK]
        partial = band[None] & has_real[:, None, :]
    return _block_mask(partial, None, mask_mod, nq, nk)


# --------------------------------------------------------------------------------------
# group part
# --------------------------------------------------------------------------------------


@dataclass
class GroupLayout:
    """Tokens laid out group by group (stable in position), padded to one length ``L``.

    Attributes:
        index: int64 ``[B, L]`` token index of each row (0 for filler rows).
        group: int32 ``[B, L]`` group of each row (a negative filler value for filler rows).
        pos: int32 ``[B, L]`` absolute position of each row's token.
        rows: ``(b, g, t, column)`` int64 ``[R]`` of the ``R`` real rows.
        length: ``L``.
    """

    index: torch.Tensor
    group: torch.Tensor
    pos: torch.Tensor
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    length: int


def group_layout(members: torch.Tensor, offset: int, fill: int, extra: int) -> GroupLayout:
    """The group layout of bool ``members [B, N, K]`` (token ``t`` at absolute position
    ``offset + t``), with ``extra`` filler columns after the longest batch element's rows
    (group ``fill``, position ``-1`` for queries' filler, ``N + offset`` for keys')."""
    bsz, n, _ = members.shape
    device = members.device
    bb, gg, tt = torch.nonzero(members.transpose(1, 2), as_tuple=True)  # sorted by (b, g, t)
    counts = members.sum(dim=(1, 2))
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(bb.numel(), device=device) - starts[bb]
    length = (int(counts.max()) if bsz else 0) + extra
    index = torch.zeros(bsz, length, dtype=torch.int64, device=device)
    index[bb, col] = tt
    group = torch.full((bsz, length), fill, dtype=torch.int32, device=device)
    group[bb, col] = gg.to(torch.int32)
    filler_pos = -1 if fill == _FILL_QUERY else n + offset
    pos = torch.full((bsz, length), filler_pos, dtype=torch.int32, device=device)
    pos[bb, col] = (tt + offset).to(torch.int32)
    return GroupLayout(index, group, pos, (bb, gg, tt, col), length)


def _row_codes(lay: GroupLayout, bits: torch.Tensor) -> list[torch.Tensor]:
    """Scatter bool ``bits [R, K]`` of the real rows into codes ``[B, L]`` (filler: 0)."""
    bb, _, _, col = lay.rows
    out = []
    for word in membership_codes(bits):
        full = torch.zeros(lay.index.shape, dtype=torch.int64, device=bits.device)
        full[bb, col] = word
        out.append(full)
    return out


def _block_stats(lay: GroupLayout, nblocks: int):
    """Per block of ``FLEX_BLOCK`` rows: (min group, max group, min pos, max pos, whether
    every row is real), each ``[B, nblocks]``; a block without real rows has min group
    above every group and max group -1."""
    bsz, length = lay.group.shape
    pad = nblocks * FLEX_BLOCK - length
    group = torch.nn.functional.pad(lay.group, (0, pad), value=_FILL_QUERY)
    pos = torch.nn.functional.pad(lay.pos, (0, pad), value=0)
    group = group.view(bsz, nblocks, FLEX_BLOCK)
    pos = pos.view(bsz, nblocks, FLEX_BLOCK)
    real = group >= 0
    big = torch.iinfo(torch.int32).max
    gmin = torch.where(real, group, big).amin(dim=-1)
    gmax = torch.where(real, group, -1).amax(dim=-1)
    pmin = torch.where(real, pos, big).amin(dim=-1)
    pmax = torch.where(real, pos, -1).amax(dim=-1)
    return gmin, gmax, pmin, pmax, real.all(dim=-1)


def _block_any(lay: GroupLayout, bits: torch.Tensor, nblocks: int) -> torch.Tensor:
    """float ``[B, nblocks, K]``: 1 where some real row of the block has the bit."""
    bb, _, _, col = lay.rows
    bsz = lay.index.shape[0]
    out = torch.zeros(bsz, nblocks * FLEX_BLOCK, bits.shape[-1], device=bits.device)
    out[bb, col] = bits.float()
    return out.view(bsz, nblocks, FLEX_BLOCK, -1).amax(dim=2)


def group_block_mask(q_lay: GroupLayout, k_lay: GroupLayout, q_low, k_bits) -> BlockMask:
    """Block mask of the group part. A block is kept when its query rows and key rows have
    a group in common and its earliest key is not after its latest query; it is full when
    both hold one and the same group, only real rows, every key precedes every query, and no
    query row has a lower group that a key row also has (bool ``q_low [Rq, K]``: each query
    row's groups below the row's own; ``k_bits [Rk, K]``: each key row's groups; None when
    no query row has a lower group)."""
    nqb, nkb = _blocks(q_lay.length), _blocks(k_lay.length)
    qgmin, qgmax, qpmin, qpmax, qreal = _block_stats(q_lay, nqb)
    kgmin, kgmax, kpmin, kpmax, kreal = _block_stats(k_lay, nkb)
    kept = (qgmin[:, :, None] <= kgmax[:, None, :]) & (kgmin[:, None, :] <= qgmax[:, :, None])
    kept &= kpmin[:, None, :] <= qpmax[:, :, None]
    one = (qgmin == qgmax)[:, :, None] & (kgmin == kgmax)[:, None, :]
    full = kept & one & (qgmin[:, :, None] == kgmin[:, None, :])
    full &= qreal[:, :, None] & kreal[:, None, :] & (kpmax[:, None, :] <= qpmin[:, :, None])
    if q_low is not None:
        low = _block_any(q_lay, q_low, nqb) @ _block_any(k_lay, k_bits, nkb).transpose(1, 2)
        full &= low == 0
    return _block_mask(kept & ~full, full, _group_mask_mod(q_lay, k_lay, q_low, k_bits), *(
        q_lay.length, k_lay.length))  # fmt: skip


def _group_mask_mod(q_lay: GroupLayout, k_lay: GroupLayout, q_low, k_bits):
    """Same group, causal by original positions, and (when ``q_low`` is given) no group
    below the row's shared by the two tokens."""
    qg, qp, kg, kp = q_lay.group, q_lay.pos, k_lay.group, k_lay.pos
    q_codes = None if q_low is None else _row_codes(q_lay, q_low)
    k_codes = None if q_low is None else _row_codes(k_lay, k_bits)

    def mask_mod(b, h, i, j):
        keep = (qg[b, i] == kg[b, j]) & (kp[b, j] <= qp[b, i])
        if q_codes is not None:
            keep = keep & ~_share(q_codes, b, i, k_codes, b, j)
        return keep

    return mask_mod


def _group_part(inputs: SparseInputs, attend):
    """The group part: ``(out [B, H, Nq, D], lse [B, H, Nq])`` (``lse`` float32, float64
    for float64 inputs), or None when no query row meets a key row."""
    q, k, v = inputs.query, inputs.key, inputs.value
    b, h, nq, d = q.shape
    nk = k.shape[2]
    qg = inputs.query_groups
    kmember = inputs.key_groups
    if inputs.key_padding_mask is not None:
        kmember = kmember & inputs.key_padding_mask[:, :, None]
    if not bool(qg.any()) or not bool(kmember.any()):
        return None
    q_lay = group_layout(qg, nk - nq, _FILL_QUERY, extra=1)  # >= 1 filler: the empty row
    k_lay = group_layout(kmember, 0, _FILL_KEY, extra=0)
    num_groups = qg.shape[-1]
    qb, qgr, qt, qcol = q_lay.rows
    below = torch.arange(num_groups, device=qg.device)[None, :] < qgr[:, None]
    q_low = qg[qb, qt] & below
    kb, _, kt, _ = k_lay.rows
    k_bits = kmember[kb, kt]
    if not bool(q_low.any()):
        q_low = None
    mask = group_block_mask(q_lay, k_lay, q_low, k_bits)
    qx = q.gather(2, q_lay.index[:, None, :, None].expand(b, h, -1, d))
    hk = k.shape[1]
    kx = k.gather(2, k_lay.index[:, None, :, None].expand(b, hk, -1, d))
    vx = v.gather(2, k_lay.index[:, None, :, None].expand(b, hk, -1, d))
    out, lse = attend(qx, kx, vx, mask)
    # query t's r-th group row (in increasing group order); missing rows: the filler column
    rank = torch.cumsum(qg.to(torch.int64), dim=-1)[qb, qt, qgr] - 1
    slots = torch.full((b, int(rank.max()) + 1, nq), q_lay.length - 1, device=qg.device)
    slots[qb, rank, qt] = qcol
    merged = None
    for r in range(slots.shape[1]):
        idx = slots[:, r]
        part = (
            out.gather(2, idx[:, None, :, None].expand(b, h, nq, d)),
            lse.gather(2, idx[:, None, :].expand(b, h, nq)),
        )
        merged = part if merged is None else merge_partials(*merged, *part)
    return merged


# --------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------


#: PyTorch's switch (named in its own warning) that runs eager FlexAttention without
#: tracing the mask through dynamo: the same computation, without a ~1 s trace for every
#: new shape or mask.
_EAGER_SWITCH = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"


#: dispatch keys that ``vmap`` needs and that a dispatch mode's handler excludes.
_VMAP_KEYS = (
    "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchBatched",
    "FuncTorchVmapMode", "Batched", "VmapMode", "BatchedNestedTensor",
)  # fmt: skip


def _functorch_allowed():
    """A guard that lets ``vmap`` run inside a dispatch mode's handler (which excludes the
    functorch dispatch keys for the operators it runs)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _VMAP_KEYS:
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@contextmanager
def _flex_context(eager: bool) -> Iterator[None]:
    """Where a FlexAttention call runs. Inside a dispatch mode's handler (the first run of
    a compiled caller checks custom operators under one) the functorch dispatch keys are
    excluded, and FlexAttention needs them (eager: ``vmap`` over the ``mask_mod``): they
    are let back in. With ``eager``, FlexAttention runs as plain PyTorch code (no dynamo
    trace; only for calls without gradients, which is all CPU FlexAttention can do)."""
    with ExitStack() as stack:
        if is_in_torch_dispatch_mode():
            stack.enter_context(_functorch_allowed())
        if eager and hasattr(flex_module, _EAGER_SWITCH):
            before = getattr(flex_module, _EAGER_SWITCH)
            setattr(flex_module, _EAGER_SWITCH, True)
            stack.callback(setattr, flex_module, _EAGER_SWITCH, before)
        yield


def _flex_function(device: torch.device, *, static: bool = False):
    """Eager FlexAttention on CPU (the only form with a log-sum-exp there), compiled
    elsewhere (created once): with automatic dynamic shapes, or with ``static`` one kernel
    per shape (:func:`flex_call` falls back to it)."""
    global _COMPILED, _COMPILED_STATIC
    if device.type == "cpu":
        return flex_attention
    if static:
        if _COMPILED_STATIC is None:
            _COMPILED_STATIC = torch.compile(flex_attention, dynamic=False)
        return _COMPILED_STATIC
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention)
    return _COMPILED


def _compile_failures() -> tuple[type[BaseException], ...]:
    """The errors of a failed compilation (Inductor's lowering errors among them)."""
    return (BackendCompilerFailed,)


def _flex_forward(q, k, v, block_mask: BlockMask, scale: float, score_mod):
    """``(out, aux)`` of one FlexAttention call. When compiling with dynamic shapes fails
    (seen on CUDA with torch 2.11: Inductor found no kernel for a head_dim-16 input whose
    length had become dynamic, "NoValidChoicesError"), this call and every later one use a
    kernel compiled for its shapes (slower to warm up, recompiled per shape), with one
    ``RuntimeWarning``."""
    global _STATIC_ONLY
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale,
                  enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))  # fmt: skip
    if not _STATIC_ONLY:
        try:
            return _flex_function(q.device)(q, k, v, **kwargs)
        except _compile_failures() as err:
            _STATIC_ONLY = True
            warnings.warn(
                f"FlexAttention did not compile with dynamic shapes ({type(err).__name__}); "
                "compiling a kernel per shape from now on",
                RuntimeWarning,
                stacklevel=4,
            )
    return _flex_function(q.device, static=True)(q, k, v, **kwargs)


def flex_call(q, k, v, block_mask: BlockMask, *, scale: float, score_mod=None):
    """One FlexAttention call, compiled on CUDA and eager on CPU (see the module docstring):
    ``q [B, H, Lq, D]``, ``k``/``v`` ``[B, H_kv, Lk, D]`` (GQA when ``H != H_kv``). Returns
    ``(out [B, H, Lq, D], lse [B, H, Lq])``; a row with no visible key gives 0 and
    ``-inf``. On CPU half-precision inputs are computed in float32 (eager FlexAttention
    would round the probabilities to the input dtype before multiplying by the values), so
    ``out`` is float32 there."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        q, k, v = q.float(), k.float(), v.float()
    with warnings.catch_warnings(), _flex_context(eager=q.device.type == "cpu"):
        # eager on CPU is deliberate (module docstring)
        warnings.filterwarnings("ignore", message="flex_attention called without")
        out, aux = _flex_forward(q, k, v, block_mask, scale, score_mod)
    lse = aux.lse
    return out.masked_fill((lse == float("-inf"))[..., None], 0.0), lse


def causal_block_mask(nq: int, nk: int, key_padding_mask, device) -> BlockMask:
    """Block mask of plain causal attention with bottom-right aligned queries (query ``t``
    at position ``Nk - Nq + t``) over the real keys (bool ``key_padding_mask [B, Nk]`` or
    None); blocks wholly below the diagonal with only real keys are full."""
    offset = torch.tensor(nk - nq, device=device)
    real = key_padding_mask

    def mask_mod(b, h, t, j):
        keep = j <= t + offset
        return keep if real is None else keep & real[b, j]

    nqb, nkb = _blocks(nq), _blocks(nk)
    t0 = torch.arange(nqb, device=device) * FLEX_BLOCK
    t1 = (t0 + FLEX_BLOCK).clamp(max=nq) - 1
    k0 = torch.arange(nkb, device=device) * FLEX_BLOCK
    k1 = (k0 + FLEX_BLOCK).clamp(max=nk) - 1
    kept = (k0[None, :] <= (t1 + nk - nq)[:, None])[None]
    full = (k1[None, :] <= (t0 + nk - nq)[:, None])[None]
    if real is not None:
        padded = torch.zeros(real.shape[0], nkb * FLEX_BLOCK, dtype=torch.bool, device=device)
        padded[:, :nk] = real
        blocks = padded.view(real.shape[0], nkb, FLEX_BLOCK)
        kept = kept & blocks.any(dim=-1)[:, None, :]
        last = nk - (nkb - 1) * FLEX_BLOCK  # keys in the last block
        whole = blocks.all(dim=-1)
        whole[:, -1] = blocks[:, -1, :last].all(dim=-1)
        full = full & whole[:, None, :]
    return _block_mask(kept & ~full, full, mask_mod, nq, nk)


def _attend(inputs: SparseInputs):
    """``attend(q, k, v, block_mask) -> (out, lse)``: :func:`flex_call` with the call's
    scale and softcap."""
    cap = inputs.softcap
    score_mod = None
    if cap is not None:

        def score_mod(score, b, h, i, j):
            return cap * torch.tanh(score / cap)

    def attend(q, k, v, block_mask):
        return flex_call(q, k, v, block_mask, scale=inputs.scale, score_mod=score_mod)

    return attend


def run_flex(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``flex`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse [B, Nq, H]
    float32, or float64 for float64 inputs)``, token-major."""
    if not inputs.needs_grad:  # FlexAttention refuses CPU inputs that require grad at all
        detached = (t.detach() for t in (inputs.query, inputs.key, inputs.value))
        inputs = replace(inputs, **dict(zip(("query", "key", "value"), detached, strict=True)))
    attend = _attend(inputs)
    q_codes = membership_codes(inputs.query_groups)
    k_codes = membership_codes(inputs.key_groups)
    mask = local_block_mask(inputs, q_codes, k_codes)
    out, lse = attend(inputs.query, inputs.key, inputs.value, mask)
    group = _group_part(inputs, attend)
    if group is not None:
        out, lse = merge_partials(out, lse, *group)
    ct = torch.promote_types(inputs.query.dtype, torch.float32)
    out = out.transpose(1, 2).to(inputs.query.dtype).contiguous()
    return out, lse.to(ct).transpose(1, 2).contiguous()


def triton_available() -> bool:
    """Whether Triton (the compiler of FlexAttention's CUDA kernels) is installed."""
    return importlib.util.find_spec("triton") is not None


def _device_reason(request: SparseRequest) -> str | None:
    """Why FlexAttention cannot run ``request`` here: gradients on CPU (PyTorch's CPU
    FlexAttention has no backward), a CUDA device without Triton (no compiled kernels)."""
    if request.device.type == "cpu" and request.needs_grad:
        return (
            "computes no gradients on CPU (PyTorch's FlexAttention has no CPU backward; "
            "'math' or 'auto' for gradients)"
        )
    if request.device.type == "cuda" and not triton_available():
        return "needs Triton on CUDA (compiled FlexAttention), which is not installed"
    return None


BACKEND = SparseBackend(
    name="flex",
    run=run_flex,
    priority=50,
    devices=("cpu", "cuda"),
    dtypes=(*CPU_DTYPES, torch.float64),
    differentiable=True,
    softcap=True,
    check=_device_reason,
    summary="PyTorch FlexAttention, compiled block-sparse kernels on CUDA; eager on CPU",
    auto_devices=("cuda",),
)
register_backend(BACKEND)
