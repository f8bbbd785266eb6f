"""``sparse_attention`` under ``torch.compile``: calls without gradients are one opaque
custom operator (``torch.ops.focus_attention.sparse_attention``), so a compiled caller gets
bitwise the eager result; calls that need gradients run eagerly behind a graph break."""

from __future__ import annotations

import pytest
import torch

from focus_attention.ops import sparse_attention

from .helpers import BACKENDS, make_case

OP = torch.ops.focus_attention.sparse_attention.default


def _case():
    """Several membership classes (two tokens in every group), GQA, padding."""
    case = make_case(
        nk=40, heads=4, kv_heads=2, dim=8, window=8, top_k=1, padding="random", seed=40
    )
    case.kg[:, :2] = True
    case.qg[:, :2] = True
    case.kpm[:, :2] = True
    return case


@pytest.mark.parametrize("backend", ["auto", "cpu_flash", "math", "masked"])
@pytest.mark.parametrize("with_padding", [False, True], ids=["no-pad", "pad"])
@pytest.mark.parametrize("needs_lse", [True, False], ids=["lse", "out"])
def test_the_custom_op_passes_opcheck(backend, with_padding, needs_lse, kernel_built):
    """Schema, fake (meta) implementation and AOT dispatch agree with the eager op, with the
    log-sum-exp asked for and not (then it is an empty tensor)."""
    case = _case()
    kpm = case.kpm if with_padding else None
    args = (case.q, case.k, case.v, case.qg, case.kg, kpm, case.window, 0.35, None, backend,
            needs_lse)  # fmt: skip
    result = torch.library.opcheck(OP, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_the_fake_implementation_gives_token_major_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(nk=30, nq=7, heads=6, kv_heads=3, dim=5, top_k=2, seed=1)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (case.q, case.k, case.v, case.qg, case.kg)]
        out, lse = OP(*args, None, 4, 0.5, None, "auto")
    assert out.shape == (1, 7, 6, 5) and out.dtype == torch.float32
    assert lse.shape == (1, 7, 6) and lse.dtype == torch.float32


@pytest.mark.slow
def test_compiled_callers_get_the_eager_result_bitwise(inductor, fused_kernel):
    """``fullgraph=True``: the op is traced as one opaque call, no graph break. Inductor
    once compiled the op's Python body wrongly (max error ~2 on this input)."""
    import torch._inductor.config

    case = _case()
    args = (case.q, case.k, case.v, case.qg, case.kg, case.kpm)
    with torch._inductor.config.patch(compile_threads=1), torch.no_grad():
        for backend in ("auto", *BACKENDS):

            def user_code(q, k, v, qg, kg, kpm, backend=backend):  # a model calling the op
                out, lse = sparse_attention(
                    q * 1.0, k, v, qg, kg, case.window, key_padding_mask=kpm, backend=backend,
                    return_lse=True,
                )  # fmt: skip
                alone = sparse_attention(
                    q * 1.0, k, v, qg, kg, case.window, key_padding_mask=kpm, backend=backend
                )  # without the log-sum-exp a backend may take another path (masked: SDPA)
                flat = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
                return flat + 0.0, lse * 1.0, alone + 0.0

            eager = user_code(*args)
            compiled = torch.compile(user_code, fullgraph=True)(*args)
            for got, expected in zip(compiled, eager, strict=True):
                assert torch.equal(got, expected), backend
        direct = torch.compile(sparse_attention, fullgraph=True)(*args[:5], case.window)
        assert torch.equal(direct, sparse_attention(*args[:5], case.window))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "math"])
def test_compiled_gradients_equal_eager_gradients(inductor, backend):
    """With inputs that require grad the op runs eagerly (a graph break): compiled outputs
    and gradients are bitwise those of eager mode."""
    import torch._inductor.config

    case = _case()

    def attention(q, k, v):  # a model calling the op with gradients
        out = sparse_attention(
            q * 2.0, k, v, case.qg, case.kg, case.window, key_padding_mask=case.kpm,
            backend=backend,
        )  # fmt: skip
        return out * 3.0

    cot = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(0))

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (case.q, case.k, case.v)]
        out = fn(*leaves)
        return out, torch.autograd.grad(out, leaves, cot)

    with torch._inductor.config.patch(compile_threads=1):
        eager_out, eager_grads = run(attention)
        compiled_out, compiled_grads = run(torch.compile(attention))
    assert torch.equal(compiled_out, eager_out)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        assert torch.equal(a, b)
