"""``eager_only`` (src/focus_attention/utils/compile.py): decorated functions run eagerly under
``torch.compile`` and never fill Dynamo's cache, whatever their callers and arguments."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.config

from focus_attention.utils.compile import eager_only


@eager_only
def _scale(x, factor, *extra, offset=0.0):
    assert not torch.compiler.is_compiling()  # runs eagerly
    return x * factor + offset + len(extra)


@eager_only
def _count_nonzero(x):
    return int((x != 0).sum())  # data-dependent: a graph break if it were traced


class _Caller(torch.nn.Module):
    def forward(self, x):
        return _scale(x, 2.0) + 1


class _OtherCaller(torch.nn.Module):
    def forward(self, x):
        return _scale(x, 3.0, x, x, offset=1.0) * _count_nonzero(x)


def test_decorated_functions_run_eagerly_with_their_results():
    x = torch.arange(4.0)
    assert torch.equal(_scale(x, 2.0, 1, offset=1.0), x * 2 + 2)
    assert _count_nonzero(x) == 3
    assert _scale.__name__ == "_scale" and _scale.__wrapped__ is not None


@pytest.mark.slow
def test_many_callers_and_argument_shapes_hit_no_recompile_limit():
    """Callers of several types, argument counts and keyword sets, over lengths and dtypes:
    every call gives the eager result and no code object reaches the recompile limit
    (a wrapper code object shared by every decorated function reached it after a few)."""
    torch._dynamo.reset()
    callers = [torch.compile(m, backend="eager") for m in (_Caller(), _OtherCaller())]
    fns = [
        torch.compile(lambda x: _scale(x, 0.5, offset=2.0), backend="eager"),
        torch.compile(lambda x: _count_nonzero(x) + _scale(x, 1.0, 1, 2, 3), backend="eager"),
    ]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8):
        for n in (3, 5, 8, 13, 21, 34):
            for dtype in (torch.float32, torch.float64):
                x = torch.linspace(-1, 1, n, dtype=dtype)
                assert torch.equal(callers[0](x), (x * 2.0 + 0.0 + 0) + 1)
                assert torch.equal(callers[1](x), (x * 3.0 + 1.0 + 2) * int((x != 0).sum()))
                assert torch.equal(fns[0](x), x * 0.5 + 2.0 + 0)
                assert torch.equal(fns[1](x), int((x != 0).sum()) + (x * 1.0 + 0.0 + 3))
    torch._dynamo.reset()
