"""Exploration, not a package feature: run a ``focus`` command with query-key routers that
score only the low-frequency rotary pairs of the pre-rotary queries and keys (pair index
``>= START`` of ``head_dim / 2``, LLaMA's rotate-half layout), the pairs whose rotation over a
few thousand tokens is small. The other pairs are zeroed before the router sees them; the
attention itself is unchanged.

usage: python experiments/routing-diagnostic/low_frequency.py START focus-arguments...
e.g.   python experiments/routing-diagnostic/low_frequency.py 20 train --router-input query_key ...
"""

from __future__ import annotations

import sys

import torch

from focus_attention.cli import main
from focus_attention.hf import query_key

ORIGINAL = query_key.PRE_ROTARY["llama"]


def low_frequency(start: int):
    """A ``PRE_ROTARY`` entry: LLaMA's pre-rotary queries and keys with the rotary pairs
    below ``start`` zeroed."""

    def project(module, hidden):
        q, k = ORIGINAL(module, hidden)
        half = q.shape[-1] // 2
        keep = torch.zeros(q.shape[-1], dtype=q.dtype, device=q.device)
        keep[start:half] = 1
        keep[half + start :] = 1
        return q * keep, k * keep

    return project


if __name__ == "__main__":
    query_key.PRE_ROTARY["llama"] = low_frequency(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
