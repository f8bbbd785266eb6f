"""tests/hf configuration: tiny models are built in ``tests/tiny.py``; fixtures live here."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama_focus

# small CPU ops are fastest single-threaded, and the machine is shared
torch.set_num_threads(1)


@pytest.fixture
def reference_llama():
    """The reference tiny-llama with Focus on every layer (window 32, K = 4, top_k = 1)."""
    return tiny_llama_focus()
