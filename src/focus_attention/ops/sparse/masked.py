"""The ``masked`` backend: decoding without reading the host. Each query attends every cached
key under its row of the Focus mask, built on the device from the membership masks
(docs/method.md §5, "Decoding"): no key is gathered, so no count of visible keys is read
back (``gather`` reads one per call, a host synchronisation), and a call is a fixed, short
sequence of device operations.

It reads all ``Nk`` keys and values (``gather`` reads about ``window + Nk / K``): the choice
for short calls where launching operations costs more than reading keys (a small model on a
GPU). A call over a cache's group buckets (a static cache's decoding step) runs their
PyTorch form, :func:`~.triton_decode.bucket_decode_reference` (the mask built from the
buckets' codes over the whole capacity): ``"auto"`` chooses it for those calls only, where
``triton`` cannot run them. A longer call (a prefill) runs in blocks of
:data:`MASKED_BLOCK` queries, each against the keys up to its last query, so memory stays
``O(MASKED_BLOCK x Nk)`` per head and the arithmetic is dense attention's. Any device and
floating dtype, soft-capping, inference only.

A call whose caller does not read the log-sum-exp (a Focus layer's) and has no soft-capping
is one call of PyTorch's ``scaled_dot_product_attention`` under the boolean mask, in the
inputs' dtype (one fused kernel where the device has one): the arithmetic of the dense
model's own ``sdpa`` attention. Otherwise the block is
:func:`focus_attention.ops.reference.masked_attention`, in float32 (float64 for float64
inputs: half-precision keys and values are copied to float32 whole, ``2 x Nk x D`` floats
per key-value head). As in dense attention
under a mask, a value row that no query sees still enters the product with weight 0, so a
NaN or infinity there (a cache holding garbage in its padding) makes the output NaN, where
the gathering backends skip the row; on the SDPA path a NaN key no query sees does too (a
NaN logit plus the mask's ``-inf`` stays NaN, as in the dense model's ``sdpa``).
"""

from __future__ import annotations

import torch

from ..reference import masked_attention
from .dispatch import SparseBackend, SparseInputs, SparseRequest, register_backend
from .gather import query_rows, visible_keys
from .triton_decode import bucket_decode_reference

__all__ = ["MASKED_BLOCK", "run_masked"]

#: queries per block of a longer call (a decoding step is one block)
MASKED_BLOCK = 256


def run_masked(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``masked`` backend: ``(out [B, Nq, H, D] in the query's dtype, lse [B, Nq, H])``,
    token-major; a query with no visible key gives zeros and ``-inf``. ``lse`` is None when
    ``inputs.needs_lse`` is False and there is no soft-capping (then SDPA runs the block).
    A call over group buckets runs :func:`~.triton_decode.bucket_decode_reference`."""
    if inputs.buckets is not None:
        return _over_buckets(inputs)
    attend = _attend_block
    if not inputs.needs_lse and inputs.softcap is None:
        attend = _attend_block_sdpa
    nq = inputs.query.shape[2]
    if nq <= MASKED_BLOCK:
        return attend(inputs)
    parts = [attend(query_rows(inputs, a, min(nq, a + MASKED_BLOCK)))
             for a in range(0, nq, MASKED_BLOCK)]  # fmt: skip
    out = torch.cat([p[0] for p in parts], dim=1)
    return out, None if parts[0][1] is None else torch.cat([p[1] for p in parts], dim=1)


def _attend_block_sdpa(inputs: SparseInputs) -> tuple[torch.Tensor, None]:
    """One block of queries against every key, under the mask, by one call of
    ``scaled_dot_product_attention`` in the inputs' dtype: ``(out [B, Nq, H, D], None)``.
    The ``rep = H / H_kv`` query heads of a key-value head are rows of one product (no
    ``enable_gqa``, which not every SDPA kernel takes), so the mask ``[B, 1, rep * Nq, Nk]``
    is a view for a decoding step. The kernel's output may have any strides (CUDA's
    memory-efficient kernel returns a transposed layout). Rows with no visible key (padding
    queries) are zeroed here, whatever the kernel gives them."""
    q = inputs.query
    b, h, nq, d = q.shape
    h_kv, nk = inputs.key.shape[1], inputs.key.shape[2]
    rep = h // h_kv
    vis = visible_keys(inputs)  # [B, Nq, Nk]
    mask = vis[:, None, None].expand(b, 1, rep, nq, nk).reshape(b, 1, rep * nq, nk)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b, h_kv, rep * nq, d), inputs.key, inputs.value, attn_mask=mask,
        scale=inputs.scale,
    )  # fmt: skip
    # [B, H_kv, rep * Nq, D] -> token-major [B, Nq, H, D] (query head = kv head * rep + r)
    out = out.unflatten(2, (rep, nq)).permute(0, 3, 1, 2, 4).reshape(b, nq, h, d)
    if inputs.key_padding_mask is not None:  # only padding leaves a query no key
        out = out.masked_fill(~vis.any(dim=-1)[..., None, None], 0.0)
    return out.contiguous(), None


def _attend_block(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of queries against every key, under the mask, by
    :func:`~focus_attention.ops.reference.masked_attention`: as :func:`run_masked`."""
    q = inputs.query
    out, lse = masked_attention(q, inputs.key, inputs.value, visible_keys(inputs),
                                scale=inputs.scale, softcap=inputs.softcap)  # fmt: skip
    return out.transpose(1, 2).contiguous().to(q.dtype), lse.transpose(1, 2).contiguous()


def _over_buckets(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A call over a cache's group buckets: :func:`~.triton_decode.bucket_decode_reference`."""
    return bucket_decode_reference(
        inputs.query, inputs.key, inputs.value, inputs.query_groups[:, None], inputs.buckets,
        inputs.key_lengths, inputs.window, scale=inputs.scale, softcap=inputs.softcap,
        key_padding_mask=inputs.key_padding_mask, needs_lse=inputs.needs_lse,
    )  # fmt: skip


def _buckets_only(request: SparseRequest) -> str | None:
    """``"auto"`` chooses the backend for calls over group buckets only."""
    if request.over_buckets:
        return None
    return "is chosen by 'auto' only to decode over group buckets (ask for it by name)"


BACKEND = SparseBackend(
    name="masked",
    run=run_masked,
    priority=9,
    softcap=True,
    buckets=True,
    auto_check=_buckets_only,
    summary="attends every key under the Focus mask, no host synchronisation (decoding)",
)
register_backend(BACKEND)
