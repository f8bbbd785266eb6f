"""The ``triton`` backend: this package's Triton kernels behind
:func:`~focus_attention.ops.sparse_attention` (docs/method.md §5, "Backends").

- A call of at most :data:`TRITON_DECODE_QUERIES` queries (decoding, speculative tokens)
  without gradients runs
  :func:`~.triton_decode.bucket_decode`: the call's key memberships become group buckets
  (:meth:`~.buckets.GroupBuckets.from_groups`, a fixed-shape scatter), and each query reads
  its window and the bucket entries of its groups, split along the keys. A model with a
  static KV cache keeps the buckets between steps instead (:mod:`focus_attention.hf.static_cache`).
- Any other call (a prompt, a chunk of one, a call that needs gradients) runs
  :func:`~.triton_prefill.group_prefill`: the local band and the groups' older keys over a
  layout sorted by group, merged in the kernel; differentiable (a FlashAttention-2 style
  backward over the same layouts).

Both run without a host synchronisation and compile once per dtype and head size, not per
length. CUDA with Triton installed (PyTorch's CUDA builds ship it), or CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``, for tests); float32, bfloat16 and float16; at
most 62 groups; soft-capping; differentiable. ``"auto"`` chooses it on CUDA, before
``gather``.
"""

from __future__ import annotations

import torch

from .buckets import GroupBuckets
from .dispatch import SparseBackend, SparseInputs, SparseRequest, register_backend
from .triton_decode import KERNEL_DTYPES, bucket_decode
from .triton_prefill import group_prefill
from .triton_support import MAX_KERNEL_GROUPS, triton_reason

__all__ = ["TRITON_DECODE_QUERIES", "run_triton"]

#: most queries of a call that the decoding kernel runs; longer calls run the prefill kernel
TRITON_DECODE_QUERIES = 8


def run_triton(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``triton`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse [B, Nq, H]
    float32 or None when not asked for)``, token-major; a query with no visible key gives
    zeros and ``-inf``."""
    q, key = inputs.query, inputs.key
    query_groups, key_groups = inputs.query_groups[:, None], inputs.key_groups[:, None]
    kwargs = dict(scale=inputs.scale, softcap=inputs.softcap,
                  key_padding_mask=inputs.key_padding_mask, needs_lse=inputs.needs_lse)  # fmt: skip
    if q.shape[2] <= TRITON_DECODE_QUERIES and not inputs.needs_grad:
        buckets = GroupBuckets.from_groups(key_groups)
        lengths = torch.full((q.shape[0],), key.shape[2], dtype=torch.int32, device=q.device)
        return bucket_decode(q, key, inputs.value, query_groups, buckets, lengths,
                             inputs.window, **kwargs)  # fmt: skip
    return group_prefill(q, key, inputs.value, query_groups, key_groups, inputs.window, **kwargs)


def _where(request: SparseRequest) -> str | None:
    """Why the kernels cannot run ``request``: a device Triton does not run on here."""
    return triton_reason(request.device)


BACKEND = SparseBackend(
    name="triton",
    run=run_triton,
    priority=7,
    dtypes=KERNEL_DTYPES,
    differentiable=True,
    softcap=True,
    max_groups=MAX_KERNEL_GROUPS,
    check=_where,
    auto_devices=("cuda",),
    summary="this package's Triton kernels: group buckets for decoding, a group-sorted prefill",
)
register_backend(BACKEND)
