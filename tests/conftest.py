"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def inductor():
    """Skip unless inductor can compile a trivial function on this machine (it needs a C++
    compiler on CPU); dynamo's caches are reset around the module. Compile with
    ``torch._inductor.config.patch(compile_threads=1)``: a worker-process pool takes
    minutes to start on a loaded machine."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(compile_threads=1):
            out = torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as err:  # no compiler, unsupported platform, ...
        pytest.skip(f"inductor cannot compile here: {type(err).__name__}: {err}")
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, torch.full((3,), 3.0))
    yield
    torch._dynamo.reset()
