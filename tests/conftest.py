"""Fixtures shared by every test package."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="session")
def fused_kernel() -> bool:
    """Build (or load) the ``cpu_fused`` C++ kernel once per session, so its first build
    (about a minute) shows as this fixture's setup instead of inside whichever test runs
    first. Skips the requesting test when the kernel cannot be built here or
    ``FOCUS_NO_EXTENSION`` is set."""
    if os.environ.get("FOCUS_NO_EXTENSION", "") not in ("", "0"):
        pytest.skip("FOCUS_NO_EXTENSION set: the cpu_fused kernel is disabled")
    import warnings

    from focus_attention.ops import fused_kernel_available
    from focus_attention.ops.sparse import extension

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        available = fused_kernel_available()
    if not available:
        pytest.skip(f"the cpu_fused kernel is unavailable: {extension.unavailable_reason()}")
    return True
