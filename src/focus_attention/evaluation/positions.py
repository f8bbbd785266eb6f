"""Perplexity by position in the window (docs/method.md §9): where in a window the cost of
sparsity arises. Inside the local window a Focus layer is dense, so early positions match the
dense model; only tokens beyond the window can lose keys."""

from __future__ import annotations

import math
from typing import Any

import torch


def bucket_bounds(starts: tuple[int, ...], seq_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` token positions of each bucket that holds a scored token of a
    ``seq_len``-token window (positions ``1 .. seq_len - 1``: the first token is never a
    target). ``starts`` are sorted bucket starts; the last bucket ends at ``seq_len``.

    Raises:
        ValueError: ``starts`` empty, negative or not strictly increasing.
    """
    if not starts or any(s < 0 for s in starts) or list(starts) != sorted(set(starts)):
        raise ValueError(
            f"position buckets: received {starts!r}, expected increasing starts >= 0 "
            "(for example 0,128,512,2048)"
        )
    ends = [*starts[1:], seq_len]
    return [(a, min(b, seq_len)) for a, b in zip(starts, ends, strict=True) if a < seq_len]


class PositionNLL:
    """Next-token negative log-likelihood summed per target position over windows.

    ``add(nll)`` takes the per-token NLL of one window, ``[seq_len - 1]`` (the target at
    position ``p`` is token ``p + 1``, so entry ``i`` belongs to position ``i + 1``).
    """

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.nll = torch.zeros(seq_len, dtype=torch.float64)
        self.count = torch.zeros(seq_len, dtype=torch.long)

    def add(self, nll: torch.Tensor) -> None:
        """Add one window's per-token NLL ``[seq_len - 1]`` (nats)."""
        if nll.shape != (self.seq_len - 1,):
            raise ValueError(
                f"PositionNLL.add: received shape {tuple(nll.shape)}, expected [{self.seq_len - 1}]"
            )
        self.nll[1:] += nll.detach().double().cpu()
        self.count[1:] += 1

    def perplexities(self, bounds: list[tuple[int, int]]) -> list[float | None]:
        """Perplexity of the scored tokens in each ``[start, end)`` bucket (None if none)."""
        out: list[float | None] = []
        for a, b in bounds:
            n = int(self.count[a:b].sum())
            out.append(math.exp(float(self.nll[a:b].sum()) / n) if n else None)
        return out

    def tokens(self, bounds: list[tuple[int, int]]) -> list[int]:
        """Scored tokens in each bucket."""
        return [int(self.count[a:b].sum()) for a, b in bounds]


def position_table(by_position: dict[str, Any]) -> list[str]:
    """Markdown lines of the perplexity-by-position table of an evaluation result
    (``EvalResult.ppl_by_position``): one column per bucket, one row per model it holds
    (``base``, then ``focus_soft`` and ``focus_topk`` where present; ``-`` for a bucket
    without tokens)."""
    bounds = by_position["buckets"]
    head = " | ".join(f"{a}-{b - 1}" for a, b in bounds)
    lines = [
        "",
        "Perplexity by token position in the window:",
        "",
        f"| model | {head} |",
        "|---|" + "---:|" * len(bounds),
        "| tokens | " + " | ".join(f"{n:,d}" for n in by_position["tokens"]) + " |",
    ]

    def row(name: str, values: list[float | None]) -> str:
        return f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in values) + " |"

    lines.append(row("base (dense)", by_position["base"]))
    if "focus_soft" in by_position:
        lines.append(row("Focus soft", by_position["focus_soft"]))
    for k, values in by_position.get("focus_topk", {}).items():
        lines.append(row(f"Focus top-{k}", values))
    return lines


def context_statistics(
    histogram: dict[int, int], window: int | None, sink_tokens: int = 0
) -> dict[str, Any]:
    """Summary of predictions by the number of keys each one sees (docs/method.md §9,
    "Routing affected share").

    Args:
        histogram: ``{context length in tokens: predictions}``.
        window: the Focus local window in tokens (None for a dense model: no shares).
        sink_tokens: the Focus sink tokens (visible to every query).

    Returns:
        ``tokens`` (predictions), ``mean_context`` and ``max_context`` (tokens), and with a
        window ``beyond_window_share`` (share of predictions whose context exceeds
        ``window``: they have keys outside the local window) and ``routed_share`` (context
        above ``window + sink_tokens``: the only predictions Focus can change; the others
        see every key).
    """
    total = sum(histogram.values())
    out: dict[str, Any] = {
        "tokens": total,
        "mean_context": sum(k * n for k, n in histogram.items()) / total if total else 0.0,
        "max_context": max(histogram, default=0),
    }
    if window is not None:
        for name, limit in (("beyond_window_share", window), ("routed_share", window + sink_tokens)):  # fmt: skip
            beyond = sum(n for k, n in histogram.items() if k > limit)
            out[name] = beyond / total if total else 0.0
    return out
