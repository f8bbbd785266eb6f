"""The ``cpu_fused`` backend: this package's C++ kernel (``csrc/focus_cpu.cpp``, built on
first use by :mod:`.extension`), the decomposition of docs/method.md §5 in one call.

Tiles of query rows of one membership class (the query heads sharing a key head times the
class's queries) gather their keys in blocks into float32 buffers and run an online
softmax with MKL's sgemm; the local tiles merge into the same rows by log-sum-exp (the
maximum of both parts). Where every key is in one group and the classes are many and small
(queries in several groups), the keys are laid out group by group once and the group part
runs per block of consecutive queries and single group, each query's groups merged by
log-sum-exp (docs/method.md §5). Memberships per key-value head (``[B, N, H_kv,
K]``) are planned per head in the kernel, which writes every head's rows in place. No
intermediate result returns to Python. Inference only, CPU, at most 64 groups (membership
codes are at most 64-bit integers); the fastest CPU path.
"""

from __future__ import annotations

import torch

from . import extension
from .dispatch import CPU_DTYPES, SparseBackend, SparseInputs, SparseRequest, register_backend

__all__ = [
    "FUSED_BAND",
    "FUSED_KEYS",
    "FUSED_MAX_GROUPS",
    "FUSED_ROWS",
    "FUSED_SEGMENT_KEYS",
    "fused_kernel_available",
    "launch_kernel",
    "rows_contiguous",
    "run_cpu_fused",
]

#: query rows (query heads sharing a key head x queries) per group tile and keys per block,
#: tuned on CPU at 16-32K tokens in interleaved runs (384 x 128 was as fast as 384 x 256/512
#: and keeps each thread's tile buffers near 0.4 MiB, so the op's peak memory stays at
#: dense SDPA's).
FUSED_ROWS = 384
FUSED_KEYS = 128
#: queries per local tile.
FUSED_BAND = 32
#: fewest keys per phase-1 segment when a call has too few tiles for the threads (decoding
#: steps: the keys of a tile are split by position, merged by log-sum-exp). In interleaved
#: decoding calls (SmolLM2-135M's shape, K = 8, window 128, 2 threads) 1024 was 10-20% faster
#: than 2048 for top_k = 1 at 4K-16K cached keys and equal at 1K; 512 and 256 gained nothing.
FUSED_SEGMENT_KEYS = 1024
#: most groups the kernel takes (its membership codes are at most 64-bit integers).
FUSED_MAX_GROUPS = 64


def fused_kernel_available() -> bool:
    """Whether the ``cpu_fused`` backend can run here.

    Builds the kernel on first call (about a minute, once per install, torch version and
    CPU). Returns False, with one ``RuntimeWarning`` that says why, when it cannot be built
    or loaded or ``FOCUS_NO_EXTENSION=1`` is set.
    """
    return extension.load() is not None


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, N, D]`` itself where its rows of ``D`` elements follow one another along
    ``N`` (any batch and head strides, as in a prefix view of a preallocated KV cache),
    else a contiguous copy."""
    n, d = t.shape[-2:]
    if (d <= 1 or t.stride(3) == 1) and (n <= 1 or t.stride(2) == d):
        return t
    return t.contiguous()


#: the kernel's "no padding" argument (an empty bool tensor), made once
_NO_PADDING = torch.empty(0, dtype=torch.bool)


def launch_kernel(
    kernel,
    inputs: SparseInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Run the loaded kernel module on ``inputs`` into the token-major float32 buffers
    ``out [B, Nq, H, D]`` and ``lse [B, Nq, H]``.

    ``qkv`` replaces the query, key and value of ``inputs`` (default: theirs). The query
    must be contiguous; key and value rows contiguous along ``Nk`` (see
    :func:`rows_contiguous`)."""
    q, k, v = (inputs.query, inputs.key, inputs.value) if qkv is None else qkv
    kpm = inputs.key_padding_mask
    kernel.focus_forward(
        q,
        k,
        v,
        inputs.query_groups.contiguous(),
        inputs.key_groups.contiguous(),
        _NO_PADDING if kpm is None else kpm.contiguous(),
        inputs.window,
        inputs.scale,
        out,
        lse,
        max(1, FUSED_ROWS // (q.shape[1] // k.shape[1])),
        FUSED_KEYS,
        FUSED_BAND,
        FUSED_SEGMENT_KEYS,
    )


def run_cpu_fused(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cpu_fused`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse
    [B, Nq, H] float32)``, token-major. Inputs are converted to float32 row by row."""
    kernel = extension.load()
    assert kernel is not None  # why_not() refused the call otherwise
    # one copy into [B, H, N, D] rows where the rows are not already contiguous along N
    # (transformers hands over transposed views; a KV cache's prefix view is taken as it is)
    q = inputs.query.contiguous()
    k, v = rows_contiguous(inputs.key), rows_contiguous(inputs.value)
    b, h, nq, d = q.shape
    out = torch.empty(b, nq, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, nq, h, dtype=torch.float32, device=q.device)
    launch_kernel(kernel, inputs, out, lse, (q, k, v))
    return out.to(q.dtype), lse


def _kernel_reason(request: SparseRequest) -> str | None:
    """Why the kernel cannot run here (it could not be built or loaded), or None."""
    if extension.load() is not None:
        return None
    return f"is unavailable: {extension.unavailable_reason()}"


BACKEND = SparseBackend(
    name="cpu_fused",
    run=run_cpu_fused,
    priority=10,
    devices=("cpu",),
    dtypes=CPU_DTYPES,
    max_groups=FUSED_MAX_GROUPS,
    check=_kernel_reason,
    summary="this package's C++ kernel (built on first use); inference only",
    head_routing=True,
)
register_backend(BACKEND)
