"""Fixtures for the op-level tests (builders and oracles live in ``helpers.py``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from focus_attention.ops.sparse import dispatch
from focus_attention.ops.sparse.triton_support import interpreting

from .helpers import BACKENDS, HALF_DTYPES, TINY_BLOCKS, block_modules

#: query-key pairs (``B x H x Nq x Nk``) of the largest ``triton`` call the shared grids run
#: under Triton's interpreter (see :func:`interpreted_triton_calls`)
INTERPRETED_TRITON_WORK = 60_000


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request) -> str:
    """Each explicit sparse backend (``cpu_fused`` after the session's kernel build;
    session scope, so hypothesis tests may use it too)."""
    if request.param == "cpu_fused":
        request.getfixturevalue("fused_kernel")
    if request.param == "triton":
        request.getfixturevalue("interpreted_triton_calls")
    return request.param


@pytest.fixture(scope="session", params=("auto", *BACKENDS))
def any_backend(request) -> str:
    """``"auto"`` and each explicit sparse backend."""
    request.getfixturevalue("fused_kernel" if request.param == "cpu_fused" else "kernel_built")
    if request.param == "triton":
        request.getfixturevalue("interpreted_triton_calls")
    return request.param


@pytest.fixture(scope="session")
def interpreted_triton_calls():
    """Under Triton's interpreter (no CUDA device) the shared grids run the ``triton``
    backend on calls of at most :data:`INTERPRETED_TRITON_WORK` query-key pairs per head
    (``B x H x Nq x Nk``) and skip longer ones, naming why: the interpreter runs each
    program in NumPy, a 1,000-token prefill takes tens of seconds. Longer inputs, tile edges
    and every feature of the kernels are covered by tests/ops/test_triton_decode.py and
    tests/ops/test_triton_prefill.py, and compiled on a GPU by their ``gpu`` tests."""
    if not interpreting():
        yield
        return
    registered = dispatch._REGISTRY["triton"]

    @functools.wraps(registered.run)
    def run(inputs):
        b, h, nq, _ = inputs.query.shape
        work = b * h * nq * inputs.key.shape[2]
        if work > INTERPRETED_TRITON_WORK:
            pytest.skip(f"triton under the interpreter: {work:,} query-key pairs > "
                        f"{INTERPRETED_TRITON_WORK:,} (longer calls: tests/ops/test_triton_*.py)")  # fmt: skip
        return registered.run(inputs)

    dispatch._REGISTRY["triton"] = dataclasses.replace(registered, run=run)
    yield
    dispatch._REGISTRY["triton"] = registered


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
