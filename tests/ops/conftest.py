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
