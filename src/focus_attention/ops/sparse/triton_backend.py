"""The ``triton`` backend: this package's Triton kernels behind
:func:`~focus_attention.ops.sparse_attention` and
:func:`~focus_attention.ops.sparse.decode_attention` (docs/method.md §5, "Backends").

- A call over a cache's group buckets, and a decoding-sized call
  (:func:`~.dispatch.decoding_sized`) without gradients, runs :func:`~.triton_decode.bucket_decode`:
  each query reads its window and the bucket entries of its groups, split along the keys. A
  static cache hands over the buckets it keeps; for a call that brings key memberships they
  are built here (:meth:`~.buckets.GroupBuckets.from_groups`, a fixed-shape scatter).
- Any other call (a prompt, a chunk of one, a call that needs gradients) runs
  :func:`~.triton_prefill.group_prefill`: the local band and the groups' older keys over a
  layout sorted by group, merged in the kernel; differentiable (a FlashAttention-2 style
  backward over the same layouts).

Memberships per key-value head (``[B, N, H_kv, K]``) are the kernels' routing rows
``R = H_kv`` directly (no fold of the heads into the batch). Both run without a host
synchronisation and compile once per dtype and head size, not per
length. CUDA with Triton installed (PyTorch's CUDA builds ship it), or CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``, for tests); float32, bfloat16 and float16; at
most 62 groups; soft-capping; differentiable. ``"auto"`` chooses it on CUDA, before
``gather``.
"""

from __future__ import annotations

import torch

from .buckets import GroupBuckets
from .dispatch import (
    SparseBackend,
    SparseInputs,
    SparseRequest,
    decoding_sized,
    register_backend,
)
from .triton_decode import KERNEL_DTYPES, bucket_decode
from .triton_prefill import group_prefill
from .triton_support import MAX_KERNEL_GROUPS, triton_reason

__all__ = ["run_triton"]


def run_triton(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``triton`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse [B, Nq, H]
    float32 or None when not asked for)``, token-major; a query with no visible key gives
    zeros and ``-inf``."""
    q, key = inputs.query, inputs.key
    query_groups = _routing_rows(inputs.query_groups)
    kwargs = dict(scale=inputs.scale, softcap=inputs.softcap,
                  key_padding_mask=inputs.key_padding_mask, needs_lse=inputs.needs_lse)  # fmt: skip
    buckets = None if inputs.needs_grad else inputs.buckets
    lengths = inputs.key_lengths
    if buckets is None and decoding_sized(q.shape[2]) and not inputs.needs_grad:
        buckets = GroupBuckets.from_groups(_routing_rows(inputs.key_groups))
        lengths = torch.full((q.shape[0],), key.shape[2], dtype=torch.int32, device=q.device)
    if buckets is not None:
        return bucket_decode(q, key, inputs.value, query_groups, buckets, lengths,
                             inputs.window, **kwargs)  # fmt: skip
    key_groups = _routing_rows(inputs.key_groups)
    return group_prefill(q, key, inputs.value, query_groups, key_groups, inputs.window, **kwargs)


def _routing_rows(groups: torch.Tensor) -> torch.Tensor:
    """The kernels' layout ``[B, R, N, K]`` of memberships ``[B, N, K]`` (``R = 1``) or
    ``[B, N, H_kv, K]`` (``R = H_kv``, a routing per key-value head; a transposed view)."""
    return groups[:, None] if groups.dim() == 3 else groups.transpose(1, 2)


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
    buckets=True,
    check=_where,
    auto_devices=("cuda",),
    head_routing=True,
    summary="this package's Triton kernels: group buckets for decoding, a group-sorted prefill",
)
register_backend(BACKEND)
