"""The two public calls of the op, both through the one dispatcher of :mod:`.dispatch`
(docs/method.md §4-§5):

- :func:`sparse_attention`: exact attention under the Focus hard-routing mask, without
  materialising it, from the memberships of queries and keys; argument checks, then one call
  of the custom operator of :mod:`.dispatch`, which resolves and runs a backend (called
  directly in plain eager calls, where the operator's dispatch would only add overhead).
- :func:`decode_attention`: the same attention of the newest tokens over a key-value cache
  whose keys' groups the cache keeps as :class:`~.buckets.GroupBuckets` (as
  ``flash_attn_with_kvcache`` takes a cache and its lengths): nothing is read back to the
  host, so a decoding step can be captured in a CUDA graph."""

from __future__ import annotations

from typing import Literal

import torch

from ...utils.precision import without_autocast
from ..checks import check_device, check_positive, check_qkv, check_tensor, fail
from ..masks import check_groups, effective_window
from .buckets import GroupBuckets
from .dispatch import (
    SparseInputs,
    check_backend_name,
    run_backend,
    run_differentiable,
    run_inference,
    sparse_attention_op,
)
from .triton_decode import check_decode

__all__ = ["Backend", "decode_attention", "sparse_attention"]

#: the ``backend=`` names for type checkers: :data:`~focus_attention.ops.names.SPARSE_BACKENDS`
#: as a ``Literal`` (checked against the registry by tests/ops/test_sparse_backends.py)
Backend = Literal["auto", "triton", "gather", "masked", "cpu_fused", "cpu_flash", "flex", "math"]


@without_autocast
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
    backend: Backend | str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention under the Focus hard-routing mask, without materialising it.

    Query ``t`` sits at absolute position ``Nk - Nq + t`` (bottom-right aligned: prefill,
    decode with ``Nq = 1`` and chunked prefill). Query ``i`` attends key ``j`` iff ``j <= i``,
    key ``j`` is real, and (``i - j < window`` or the two tokens share at least one group).
    The result equals dense softmax attention under :func:`focus_mask` (docs/method.md
    §4-§5). A query with no visible key (possible only for padding) outputs zeros.

    Args:
        query: ``[B, H, Nq, D]`` floating point (the CPU kernels take float32, bfloat16
            and float16). key, value: ``[B, H_kv, Nk, D]``, ``H % H_kv == 0`` (GQA/MQA).
        query_groups, key_groups: bool ``[B, Nq, K]``, ``[B, Nk, K]`` memberships (any number
            per token), or both ``[B, N, H_kv, K]`` (a routing per key-value head,
            :func:`~.dispatch.fold_heads`). window: an int ``>= 1`` (counts the query).
        scale: logit scale, default ``D ** -0.5``. key_padding_mask: bool ``[B, Nk]`` (True =
            real) or None. softcap: Gemma-2 soft-capping ``c * tanh(logits / c)`` or None.
        backend: ``"auto"`` (the first that can run the call, in :func:`backend_names`'s
            order) or a registered backend (a differentiable one for inputs needing grad):
            - ``"triton"``: this package's Triton kernels, no host synchronisation: group
              buckets and a split-K kernel reading only the window's and the query's groups'
              keys for decoding-sized calls (:data:`~.dispatch.MAX_DECODE_QUERIES`), else a
              group-sorted prefill kernel with its backward (``"auto"`` on CUDA); CUDA, or the
              CPU under ``TRITON_INTERPRET=1``; float32, bfloat16, float16, K <= 62, ``softcap``.
            - ``"gather"``: reads only the visible keys (``"auto"`` on CUDA for
              decoding-sized calls); any device and dtype, ``softcap``, differentiable.
            - ``"masked"``: every key under the call's Focus mask, built on the device: no
              host synchronisation (decoding where launches cost more than reading keys;
              ``"auto"`` only in :func:`decode_attention`); any device and dtype, ``softcap``,
              inference only; blocks of 256 queries, one SDPA call each in the inputs' dtype
              when neither ``return_lse`` nor ``softcap`` is given.
            - ``"cpu_fused"``: this package's C++ kernel (built on first use); CPU, float32,
              bfloat16, float16 (in float32), K <= 64, no softcap, inference only;
              ``"cpu_flash"``: PyTorch's CPU flash kernel merged in float32; the same, any K.
            - ``"flex"``: PyTorch's FlexAttention, applies ``softcap``; compiled and
              differentiable on CUDA; eager and inference only on CPU (not for ``"auto"``).
            - ``"math"``: blocked PyTorch code; differentiable, any device and dtype, ``softcap``.
        return_lse: also return the log-sum-exp of the visible logits.

    Returns:
        ``out [B, H, Nq, D]`` in the query's dtype, with ``return_lse`` also ``lse [B, H,
        Nq]`` (natural log; float32, float64 for float64 inputs; ``-inf`` for a query with
        no visible key): transposed views of token-major ``[B, Nq, H, D]`` / ``[B, Nq, H]``
        buffers (``out.transpose(1, 2)``, transformers' layout, is contiguous). A zero-size
        ``B``, ``H``, ``Nq`` or ``Nk`` gives an empty result of that shape on every backend
        (gradients included). Inside ``torch.autocast`` the op computes in its inputs' dtype.
        Under ``torch.compile`` a call without gradients is one opaque custom operator
        (``torch.ops.focus_attention.sparse_attention``) run eagerly: a compiled caller
        gets the eager result exactly; one that needs gradients runs behind a graph break.

    Raises:
        ValueError: wrong ranks or shapes (memberships: a head axis other than ``H_kv``),
            mismatched batch/length/K/D, ``H % H_kv != 0``, non-boolean group masks,
            ``window`` not an int ``>= 1``, ``Nq > Nk``, ``scale`` or ``softcap`` not a
            finite number > 0, tensors on different devices, ``D < 1``;
            ``BackendUnavailable`` (a ``ValueError``): an unknown backend, one that cannot
            run the call (named, with its reason: gradients, a device, dtype, softcap or
            number of groups it does not take, a kernel not built), or ``"auto"`` when no
            backend can (every backend's reason).
    """
    given = (query, key, value, query_groups, key_groups, window, scale, key_padding_mask, softcap)
    window, scale, softcap = _checked(*given)
    check_backend_name(backend)
    args = (query, key, value, query_groups, key_groups, key_padding_mask, window, scale)
    out, lse = _run(backend, args, softcap, return_lse)
    return (out.transpose(1, 2), _lse(lse).transpose(1, 2)) if return_lse else out.transpose(1, 2)


def _lse(lse: torch.Tensor | None) -> torch.Tensor:
    """The log-sum-exp of a call that asked for it (every backend then returns one)."""
    assert lse is not None
    return lse


def _run(backend: str, args: tuple, softcap: float | None, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Token-major ``(out, lse)`` of checked arguments: with autograd in Python, in plain eager
    calls by the backend directly (what the operator would run, without its dispatch; the
    log-sum-exp only if asked for), else through the custom operator."""
    query, key, value = args[:3]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return run_differentiable(backend, SparseInputs(*args, softcap, needs_grad=True))
    if _plain_eager(query):
        inputs = SparseInputs(*args, softcap, needs_grad=False, needs_lse=return_lse)
        return run_inference(backend, inputs)
    return sparse_attention_op(*args, softcap, backend, return_lse)


def _plain_eager(query: torch.Tensor) -> bool:
    """Whether the call runs eagerly on a plain tensor (not traced by ``torch.compile`` or
    ``torch.export``, not a fake, meta or subclass tensor): the custom operator, there only
    for tracers, is then skipped (its dispatch would only add overhead to a decoding step)."""
    return (
        type(query) is torch.Tensor
        and query.device.type != "meta"
        and not torch.compiler.is_compiling()
    )


def _checked(query, key, value, query_groups, key_groups, window, scale, padding, softcap):
    """Validate the arguments of :func:`sparse_attention`; returns the effective
    ``(window, scale, softcap)`` (the window capped at ``max(1, Nk)``, the default scale)."""
    check_qkv(query, key, value)
    d = query.shape[-1]
    _check_query_groups(query_groups, query, key)  # the query's shape first, then the keys'
    owner = "sparse_attention"
    _, _, nk, _ = check_groups(query_groups, key_groups, padding, window, owner=owner)
    if key.shape[2] != nk:
        fail("key_groups", f"shape {tuple(key_groups.shape)}",
             _groups_shape(query_groups.dim(), key.shape[0], f"Nk={key.shape[2]}", key))  # fmt: skip
    check_device("query_groups", query_groups, query.device, "query")
    scale = check_positive("scale", scale)
    softcap = check_positive("softcap", softcap)
    return effective_window(window, nk), d**-0.5 if scale is None else scale, softcap


def _groups_shape(rank: int, batch: int, tokens: str, key: torch.Tensor) -> str:
    """The expected shape of memberships of ``rank`` 3 (shared) or 4 (per key-value head)."""
    if rank == 4:
        return f"[B={batch}, {tokens}, H_kv={key.shape[1]}, K] (H_kv: the key's heads)"
    return f"[B={batch}, {tokens}, K]"


def _check_query_groups(query_groups: object, query: torch.Tensor, key: torch.Tensor) -> None:
    """``query_groups`` of rank 3, ``[B, Nq, K]``, or 4, ``[B, Nq, H_kv, K]`` (a routing per
    key-value head), with the query's ``B``, ``Nq`` and the key's ``H_kv``."""
    rank = query_groups.dim() if isinstance(query_groups, torch.Tensor) else 3
    b, q_len = query.shape[0], query.shape[2]
    if rank not in (3, 4):
        fail("query_groups", f"a tensor of shape {tuple(query_groups.shape)} (rank {rank})",
             f"rank 3 {_groups_shape(3, b, f'Nq={q_len}', key)} or rank 4 "
             f"{_groups_shape(4, b, f'Nq={q_len}', key)}")  # fmt: skip
    check_tensor("query_groups", query_groups, rank)
    lead = (b, q_len, key.shape[1])[: rank - 1]
    if tuple(query_groups.shape[: rank - 1]) != lead:
        fail("query_groups", f"shape {tuple(query_groups.shape)}",
             _groups_shape(rank, b, f"Nq={q_len}", key))  # fmt: skip


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_groups: torch.Tensor,
    buckets: GroupBuckets,
    key_lengths: torch.Tensor,
    window: int,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: Backend | str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Focus attention of the newest ``Nq`` tokens over a key-value cache and its group
    buckets, without reading anything back to the host (docs/method.md §5, "Decoding with a
    static cache").

    Row ``b`` holds ``L_b = key_lengths[b]`` cached keys; query ``t`` sits at position
    ``L_b - Nq + t`` and attends key ``j`` iff ``j`` is at or before it, real, and inside the
    window or in one of the query's groups: :func:`sparse_attention` on the first ``L_b``
    keys, with the keys' groups read from ``buckets`` instead of a membership tensor.

    Args:
        query: ``[B, H, Nq, D]``; key, value: ``[B, H_kv, C, D]``, caches of capacity ``C``
            (slots at or beyond a row's length are never read; ``H % H_kv == 0``).
        query_groups: bool ``[B, Nq, K]``, the queries' memberships, or ``[B, Nq, H_kv, K]``
            (a routing per key-value head).
        buckets: the cache's :class:`~.buckets.GroupBuckets` ``(B, 1, K, C)``, holding exactly
            the keys ``0 .. L_b - 1`` of each row; ``(B, H_kv, K, C)`` (routing row ``h`` for
            key-value head ``h``) with per-head ``query_groups``. Backends without per-head
            routing of their own run each key-value head as a batch row of its own
            (:func:`~.dispatch.fold_heads`).
        key_lengths: int32 or int64 ``[B]``, ``Nq <= L_b <= C`` (not checked: that would read
            the device).
        window: local window in tokens, an int ``>= 1``.
        scale: logit scale, default ``D ** -0.5``; softcap: Gemma-2 logit soft-capping.
        key_padding_mask: bool ``[B, C]``, True = real key, or None.
        backend: ``"auto"`` (``triton`` where its kernel runs, else ``masked``'s PyTorch form
            over the buckets) or a registered backend that decodes over group buckets.
        return_lse: also return the log-sum-exp of the visible logits.

    Returns:
        ``out [B, H, Nq, D]`` in the query's dtype (with ``return_lse`` also ``lse [B, H, Nq]``
        float32, float64 for float64 inputs; ``-inf`` for a query with no visible key), as
        transposed views of token-major buffers like :func:`sparse_attention`'s. Inference
        only: no gradient flows through it.

    Raises:
        ValueError: wrong ranks, shapes, dtypes or devices, buckets of another batch, number
            of routing rows (1 for shared, ``H_kv`` for per-head ``query_groups``), groups or
            capacity, ``Nq > C``, ``window`` not an int ``>= 1``, ``scale`` or
            ``softcap`` not a finite number ``> 0``; ``BackendUnavailable`` (a ``ValueError``):
            an unknown backend, one that does not decode over buckets, inputs that require
            grad, or ``"auto"`` when no backend can run the call (every backend's reason).
    """
    check_backend_name(backend)
    _check_query_groups(query_groups, query, key)
    rows = query_groups[:, None] if query_groups.dim() == 3 else query_groups.transpose(1, 2)
    call = check_decode(query, key, value, rows, buckets, key_lengths, window, scale, softcap,
                        key_padding_mask)  # fmt: skip
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    inputs = SparseInputs(
        query, key, value, query_groups, None, key_padding_mask, call.window, call.scale,
        call.softcap, needs_grad, return_lse, buckets=buckets, key_lengths=call.key_lengths,
    )  # fmt: skip
    out, lse = run_backend(backend, inputs)
    if return_lse:
        return out.transpose(1, 2), _lse(lse).transpose(1, 2)
    return out.transpose(1, 2)
