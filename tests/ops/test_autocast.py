"""Inside ``torch.autocast`` the ops compute as written (in their inputs' dtype, or the one
they cast to): the result equals the call outside autocast bitwise, on every backend, with
and without gradients."""

from __future__ import annotations

import pytest
import torch

from focus_attention.ops import gated_attention, group_scores, sparse_attention

from .helpers import make_case


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_sparse_attention_ignores_autocast(any_backend, softcap):
    case = make_case(batch=2, heads=4, kv_heads=2, nk=48, groups=4, top_k=2, padding="left")
    args = (case.q, case.k, case.v, case.qg, case.kg, case.window)
    kw = dict(key_padding_mask=case.kpm, backend=any_backend, softcap=softcap, return_lse=True)
    try:
        plain = sparse_attention(*args, **kw)
    except ValueError as err:  # a backend that cannot take this call (softcap)
        pytest.skip(str(err))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = sparse_attention(*args, **kw)
    for a, b in zip(plain, mixed, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("gate", ["log", "paper"])
def test_gated_attention_ignores_autocast(gate):
    case = make_case(batch=2, heads=4, kv_heads=2, nk=40, groups=4)
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(2, 40, 4, generator=g), dim=-1)
    q = case.q.clone().requires_grad_(True)

    def run():
        return gated_attention(q, case.k, case.v, probs, probs, case.window, gate=gate)

    plain = run()
    (grad_plain,) = torch.autograd.grad(plain.sum(), q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = run()
    (grad_mixed,) = torch.autograd.grad(mixed.sum(), q)
    assert mixed.dtype == torch.float32 and torch.equal(plain, mixed)
    assert torch.equal(grad_plain, grad_mixed)


def test_group_scores_ignore_autocast():
    g = torch.Generator().manual_seed(4)
    hidden, proj, cents = (torch.randn(*s, generator=g) for s in ((2, 30, 64), (64, 16), (8, 16)))
    plain = group_scores(hidden, proj, cents, 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = group_scores(hidden, proj, cents, 0.1)
    assert mixed.dtype == torch.float32 and torch.equal(plain, mixed)
