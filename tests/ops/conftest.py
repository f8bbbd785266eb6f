"""Fixtures for the op-level exactness tests (helpers live in ``helpers.py``)."""

from __future__ import annotations

import pytest
import torch

from .helpers import BACKENDS, HALF_DTYPES


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each explicit sparse backend: PyTorch's CPU flash kernel and the blocked math path."""
    return request.param


@pytest.fixture(params=HALF_DTYPES, ids=["bf16", "fp16"])
def half_dtype(request) -> torch.dtype:
    return request.param


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
