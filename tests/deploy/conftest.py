"""tests/deploy configuration: tiny models come from ``tests/tiny.py``."""

from __future__ import annotations

import torch

# small CPU ops are fastest single-threaded, and the machine is shared
torch.set_num_threads(1)
