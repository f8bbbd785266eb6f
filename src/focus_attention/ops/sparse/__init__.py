"""Exact sparse attention for hard top-k routing (docs/method.md §5).

- :mod:`.api`: :func:`sparse_attention` and :func:`decode_attention` (over a cache's group
  buckets), their argument checks and the dispatch call;
- :mod:`.dispatch`: the one dispatcher: the backend registry (:func:`register_backend`,
  :func:`resolve_backend`, :func:`backend_names`), the decoding-sized bound
  (:data:`MAX_DECODE_QUERIES`) and the custom operator;
- :mod:`.decomposition`: the disjoint group / local decomposition of the Python backends;
- :mod:`.triton_backend` (this package's Triton kernels: :mod:`.triton_decode` over group
  buckets, :mod:`.buckets`, and :mod:`.triton_prefill`), :mod:`.gather` (decoding-sized
  calls), :mod:`.masked` (decoding without a host synchronisation), :mod:`.cpu_fused` (with
  :mod:`.extension`, the build of ``csrc/focus_cpu.cpp``), :mod:`.cpu_flash`, :mod:`.flex`
  (PyTorch's FlexAttention), :mod:`.math`: the built-in backends, registered on import in
  ``"auto"``'s order.
"""

from . import cpu_flash, cpu_fused, flex, gather, masked, math, triton_backend  # noqa: F401  (each registers its backend)
from .api import Backend, decode_attention, sparse_attention
from .buckets import GroupBuckets
from .cpu_fused import fused_kernel_available
from .dispatch import (
    MAX_DECODE_QUERIES,
    BackendUnavailable,
    SparseBackend,
    SparseInputs,
    SparseRequest,
    backend_names,
    decoding_sized,
    register_backend,
    resolve_backend,
)

#: ``backend=`` values of the built-in backends, ``"auto"`` first, then ``"auto"``'s order
#: (:func:`backend_names` also lists backends registered later).
BACKENDS = ("auto", *backend_names())

__all__ = [
    "BACKENDS",
    "MAX_DECODE_QUERIES",
    "Backend",
    "BackendUnavailable",
    "GroupBuckets",
    "SparseBackend",
    "SparseInputs",
    "SparseRequest",
    "backend_names",
    "decode_attention",
    "decoding_sized",
    "fused_kernel_available",
    "register_backend",
    "resolve_backend",
    "sparse_attention",
]
