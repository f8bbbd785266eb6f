"""Fixtures shared by every test package."""

from __future__ import annotations

import os

import pytest

# The Triton kernels run on CPU tensors under Triton's interpreter, which Triton switches on
# when a kernel is defined: set before any test imports them, and only on a machine without
# a CUDA device (there they compile, as in production). FOCUS_TRITON_COMPILE=1 keeps it off.
if os.environ.get("FOCUS_TRITON_COMPILE", "0") != "1":
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


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
def kernel_built() -> bool:
    """Build (or load) the ``cpu_fused`` C++ kernel once per session, so its first build
    (about a minute) shows as this fixture's setup instead of inside whichever test runs
    first; whether it is available. Tests that call the op with ``backend="auto"`` on CPU
    use it (``auto`` builds the kernel on first use)."""
    if os.environ.get("FOCUS_NO_EXTENSION", "") not in ("", "0"):
        return False
    import warnings

    from focus_attention.ops import fused_kernel_available

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fused_kernel_available()


@pytest.fixture(scope="session")
def fused_kernel(kernel_built: bool) -> bool:
    """:func:`kernel_built` for tests that need the kernel itself: skips them when it
    cannot be built here or ``FOCUS_NO_EXTENSION`` is set."""
    if not kernel_built:
        from focus_attention.ops.sparse import extension

        reason = extension.unavailable_reason() or "FOCUS_NO_EXTENSION set"
        pytest.skip(f"the cpu_fused kernel is unavailable: {reason}")
    return True


@pytest.fixture(scope="module")
def module_assets(tmp_path_factory, kernel_built):
    """Tiny offline assets (a random LLaMA model directory, a word-level tokenizer and a
    small corpus with its cache), built once per test module (``tiny_assets``). The kernel is
    loaded first: its build directory lies under ``FOCUS_HOME``, which the fixtures below
    point at the tiny cache, where a first use would rebuild it (about a minute)."""
    from tiny_assets import make_tiny_assets

    return make_tiny_assets(tmp_path_factory.mktemp("tiny-assets"))


@pytest.fixture
def assets(module_assets, monkeypatch):
    """``module_assets`` with ``FOCUS_HOME`` pointing at their cache for one test."""
    from tiny_assets import use_tiny_assets

    return use_tiny_assets(module_assets, monkeypatch)


@pytest.fixture(scope="module")
def adapter(module_assets, tmp_path_factory):
    """A 4-step tiny adapter trained on ``module_assets`` (``tiny_assets.tiny_config``:
    K = 4, top_k = 2, window 8, 1 sink token, both layers)."""
    from tiny_assets import tiny_config, use_tiny_assets

    from focus_attention.training import train

    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        out = tmp_path_factory.mktemp("adapter") / "run"
        train(tiny_config(module_assets, out, steps=4, eval_every=-1, save_every=0))
    return out
