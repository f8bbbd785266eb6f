"""``decode_attention``, the public decoding op over a cache's group buckets, runs through the
one dispatcher: each backend that decodes over buckets (the Triton kernel, here under Triton's
interpreter, and ``masked``'s PyTorch form) equals the dense oracle row by row on the first
``L_b`` keys; ``"auto"`` picks the kernel on CUDA and ``masked`` elsewhere; a backend that
needs key memberships, and inputs that need gradients, are refused by name
(docs/method.md §5, "Decoding with a static cache")."""

from __future__ import annotations

import pytest
import torch

from focus_attention.ops.sparse import (
    MAX_DECODE_QUERIES,
    BackendUnavailable,
    GroupBuckets,
    SparseRequest,
    decode_attention,
    decoding_sized,
    resolve_backend,
)
from focus_attention.ops.sparse.triton_support import triton_reason

from .test_triton_decode import build

CASES = {
    "base": dict(),
    "gqa-top2": dict(heads=6, kv_heads=2, top_k=2),
    "pad-left-nq4": dict(padding="left", nq=4, top_k=2),
    "sinks-nq2": dict(sinks=3, top_k=2, window=1, nq=2),
    "three-rows": dict(lengths=(5, 47, 16), top_k=2),
    "softcap": dict(softcap=1.5, top_k=2, nq=2),
}


def _decode(setup, backend: str):
    query, key, value, query_groups, buckets, lengths, window = setup.args
    out, lse = decode_attention(query, key, value, query_groups[:, 0], buckets, lengths, window,
                                backend=backend, return_lse=True, **setup.kwargs)  # fmt: skip
    return out.transpose(1, 2), lse.transpose(1, 2)


@pytest.mark.parametrize("backend", ["auto", "masked", "triton"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_backend_decodes_over_buckets_as_the_oracle(name, backend):
    setup = build(**CASES[name])
    if "softcap" in setup.kwargs:  # queries scaled up, so the capping changes the logits
        setup.args = (setup.args[0] * 4.0, *setup.args[1:])
        for *_, case in setup.cases:
            case.q = case.q * 4.0
    setup.check(*_decode(setup, backend))


def test_the_output_is_the_transposed_token_major_layout_of_sparse_attention():
    setup = build(nq=3, top_k=2)
    out = decode_attention(*setup.args[:3], setup.args[3][:, 0], *setup.args[4:])
    assert out.shape == setup.args[0].shape and out.transpose(1, 2).is_contiguous()


def test_auto_decodes_over_buckets_with_the_kernel_on_cuda_and_masked_elsewhere():
    request = dict(dtype=torch.float32, needs_grad=False, num_groups=4, num_queries=1,
                   over_buckets=True)  # fmt: skip
    assert resolve_backend("auto", SparseRequest(torch.device("cpu"), **request)).name == "masked"
    cuda = SparseRequest(torch.device("cuda"), **request)
    expected = "triton" if triton_reason(torch.device("cuda")) is None else "masked"
    assert resolve_backend("auto", cuda).name == expected


def test_backends_without_buckets_and_inputs_needing_grad_are_refused_by_name():
    setup = build()
    query, key, value, query_groups, buckets, lengths, window = setup.args
    args = (query, key, value, query_groups[:, 0], buckets, lengths, window)
    with pytest.raises(BackendUnavailable, match="'gather'.*does not decode over group buckets"):
        decode_attention(*args, backend="gather")
    with pytest.raises(BackendUnavailable, match="without gradients"):
        decode_attention(query.clone().requires_grad_(), *args[1:], backend="masked")
    with pytest.raises(BackendUnavailable, match="cuda_kernels"):
        decode_attention(*args, backend="cuda_kernels")
    other = GroupBuckets.empty(buckets.batch, 1, buckets.num_groups, buckets.capacity + 1)
    with pytest.raises(ValueError, match="buckets"):
        decode_attention(*args[:4], other, *args[5:])


def test_one_decoding_sized_bound():
    assert decoding_sized(MAX_DECODE_QUERIES) and not decoding_sized(MAX_DECODE_QUERIES + 1)
    on_cuda = dict(device=torch.device("cuda"), dtype=torch.float64, needs_grad=False, num_groups=4)
    gather = resolve_backend("gather", SparseRequest(**on_cuda, num_queries=1))
    assert gather.why_not_auto(SparseRequest(**on_cuda, num_queries=MAX_DECODE_QUERIES)) is None
    reason = gather.why_not_auto(SparseRequest(**on_cuda, num_queries=MAX_DECODE_QUERIES + 1))
    assert f"at most {MAX_DECODE_QUERIES} queries" in reason
