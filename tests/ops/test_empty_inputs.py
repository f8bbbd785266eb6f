"""Calls with a zero-size dimension return an empty (or all-zero) result of the right shape
on every backend, with and without gradients, for ``sparse_attention`` and
``gated_attention``."""

from __future__ import annotations

import pytest
import torch

from focus_attention.ops import gated_attention, sparse_attention

#: (B, H, H_kv, Nq, Nk, D) of each zero-size dimension, with a valid configuration.
EMPTY_SHAPES = {
    "batch0": (0, 4, 2, 5, 7, 8),
    "heads0": (2, 0, 1, 5, 7, 8),
    "heads0-kv0": (2, 0, 0, 5, 7, 8),
    "queries0": (2, 4, 2, 0, 7, 8),
    "keys0": (2, 4, 2, 0, 0, 8),
    "batch0-keys0": (0, 4, 2, 0, 0, 8),
}
K = 3


def _inputs(shape, requires_grad: bool):
    b, h, h_kv, nq, nk, d = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, nq, d, generator=g, requires_grad=requires_grad)
    k = torch.randn(b, h_kv, nk, d, generator=g, requires_grad=requires_grad)
    v = torch.randn(b, h_kv, nk, d, generator=g, requires_grad=requires_grad)
    kg = torch.rand(b, nk, K, generator=g) < 0.5
    kpm = torch.ones(b, nk, dtype=torch.bool)
    return q, k, v, kg[:, nk - nq :], kg, kpm


@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_sparse_attention_on_empty_inputs(name, any_backend):
    q, k, v, qg, kg, kpm = _inputs(EMPTY_SHAPES[name], requires_grad=False)
    out, lse = sparse_attention(
        q, k, v, qg, kg, 2, key_padding_mask=kpm, backend=any_backend, return_lse=True
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert out.numel() == 0 and lse.numel() == 0


@pytest.mark.parametrize("backend_name", ["auto", "math"])
@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_sparse_attention_on_empty_inputs_with_gradients(name, backend_name):
    q, k, v, qg, kg, kpm = _inputs(EMPTY_SHAPES[name], requires_grad=True)
    out, lse = sparse_attention(
        q, k, v, qg, kg, 2, key_padding_mask=kpm, backend=backend_name, return_lse=True
    )
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for grad, t in zip(grads, (q, k, v), strict=True):
        assert grad.shape == t.shape and (grad == 0).all()


@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_inference_only_backends_still_refuse_gradients_on_empty_inputs(name):
    q, k, v, qg, kg, _ = _inputs(EMPTY_SHAPES[name], requires_grad=True)
    for backend in ("cpu_fused", "cpu_flash"):
        with pytest.raises(ValueError, match="require grad"):
            sparse_attention(q, k, v, qg, kg, 2, backend=backend)


@pytest.mark.parametrize("gate", ["paper", "log"])
@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_gated_attention_on_empty_inputs(name, gate):
    q, k, v, qg, kg, kpm = _inputs(EMPTY_SHAPES[name], requires_grad=True)
    qp, kp = torch.softmax(qg.float(), -1), torch.softmax(kg.float(), -1)
    out = gated_attention(q, k, v, qp, kp, 2, gate=gate, key_padding_mask=kpm)
    assert out.shape == q.shape and out.numel() == 0
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for grad, t in zip(grads, (q, k, v), strict=True):
        assert grad is None or (grad.shape == t.shape and (grad == 0).all())
