"""Fixtures for the op-level tests (builders and oracles live in ``helpers.py``)."""

from __future__ import annotations

import pytest
import torch

from .helpers import BACKENDS, HALF_DTYPES, TINY_BLOCKS, block_modules


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request) -> str:
    """Each explicit sparse backend (``cpu_fused`` after the session's kernel build;
    session scope, so hypothesis tests may use it too)."""
    if request.param == "cpu_fused":
        request.getfixturevalue("fused_kernel")
    return request.param


@pytest.fixture(scope="session", params=("auto", *BACKENDS))
def any_backend(request) -> str:
    """``"auto"`` and each explicit sparse backend."""
    request.getfixturevalue("fused_kernel" if request.param == "cpu_fused" else "kernel_built")
    return request.param


@pytest.fixture(params=HALF_DTYPES, ids=["bf16", "fp16"])
def half_dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Every block constant of the sparse backends shrunk (see ``helpers.TINY_BLOCKS``)."""
    modules = block_modules()
    for name, value in TINY_BLOCKS.items():
        owners = [m for m in modules if hasattr(m, name)]
        assert len(owners) == 1, name  # a renamed or duplicated constant must fail loudly
        monkeypatch.setattr(owners[0], name, value)


@pytest.fixture(scope="package", autouse=True)
def _one_intra_op_thread():
    """Run tests/ops with one intra-op thread, restored afterwards.

    The inputs here are small and CI shares two busy cores: with two OpenMP threads the
    small kernels spend most of their time waiting on each other (measured ~8x slower under
    load). Package scope keeps hypothesis happy (no function-scoped fixture) and leaves the
    other test packages untouched.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
