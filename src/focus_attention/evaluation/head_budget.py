"""A head budget for ``focus calibrate --head-budget`` (docs/method.md §9, "Long-context
settings"): the share of a model's key-value heads that attend densely, filled with the
top-ranked ``(layer, kv_head)`` pairs of a ranking.

A ranking is a JSON file with ``head_ranking`` (``[layer, kv_head]`` pairs, most important
first) and, optionally, ``by_head`` (``{"layer:kv_head": score}``) and ``config.model`` (the
model it was computed on): what ``focus bench retrieval-layers --json`` writes (the dense
model's attention on the needle) and what ``focus train --method head-gates`` writes (the
trained gates, largest first).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["budget_heads", "choose_dense_heads", "read_head_ranking"]


def budget_heads(share: float, total: int) -> int:
    """Dense heads of a budget: ``ceil(share * total)``, the product rounded to 9 decimals
    first (``0.2 * 90`` is 18, not 19).

    Raises:
        ValueError: ``share`` outside (0, 1] or ``total`` below 1.
    """
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"head_budget: received {share!r}, expected a share of the key-value heads in (0, 1]")  # fmt: skip
    if total < 1:
        raise ValueError(f"head_budget: the model has {total} key-value heads in Focus layers")
    return math.ceil(round(share * total, 9))


def read_head_ranking(path: str | Path, model: str | None = None) -> dict[str, Any]:
    """The ranking in the JSON file ``path``: ``{"head_ranking": [(layer, kv_head), ...],
    "by_head": {...}, "model": name or None, "file": str(path)}``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, no ``head_ranking`` list of distinct ``[layer, kv_head]``
            integer pairs, or ranked on another model than ``model`` (when both name one).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"head_ranking: {path} is not a file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"head_ranking: {path} is not JSON ({err})") from err
    pairs = data.get("head_ranking") if isinstance(data, dict) else None
    ok = isinstance(pairs, list) and pairs and all(
        isinstance(p, list) and len(p) == 2 and all(type(v) is int and v >= 0 for v in p) for p in pairs
    )  # fmt: skip
    if not ok:
        raise ValueError(f"head_ranking: {path} has no 'head_ranking' list of [layer, kv_head] pairs of ints >= 0 (as focus bench retrieval-layers --json writes)")  # fmt: skip
    ranked = [tuple(p) for p in pairs]
    if len(set(ranked)) != len(ranked):
        raise ValueError(f"head_ranking: {path} ranks a (layer, kv_head) pair twice")
    ranked_on = (data.get("config") or {}).get("model")
    if model is not None and ranked_on is not None and ranked_on != model:
        raise ValueError(f"head_ranking: {path} ranks the heads of model {ranked_on!r}, not of {model!r}")  # fmt: skip
    return {"head_ranking": ranked, "by_head": data.get("by_head", {}), "model": ranked_on,
            "file": str(path)}  # fmt: skip


def choose_dense_heads(ranking: list[tuple[int, int]], share: float, focus_layers: list[int],
                       kv_heads: int, dense_layers: tuple[int, ...] = ()) -> tuple[tuple[int, int], ...]:  # fmt: skip
    """The dense heads of a budget: the first pairs of ``ranking`` that lie in routed Focus
    layers (``focus_layers`` outside ``dense_layers``), as many as bring the dense key-value
    heads to :func:`budget_heads` ``(share, len(focus_layers) * kv_heads)``; a dense layer's
    heads count as dense. Sorted.

    Raises:
        ValueError: a bad share; a ranked pair outside the model (layer not a Focus layer of
            it, head ``>= kv_heads``); ``dense_layers`` alone above the budget; a ranking
            with too few pairs.
    """
    wanted = budget_heads(share, len(focus_layers) * kv_heads)
    outside = [p for p in ranking if p[0] not in focus_layers or p[1] >= kv_heads]
    if outside:
        raise ValueError(f"head_ranking: pairs {outside[:4]} are not (layer, kv_head) pairs of this model's Focus layers {list(focus_layers)} with {kv_heads} key-value heads each (a ranking of another model?)")  # fmt: skip
    already = len(set(dense_layers) & set(focus_layers)) * kv_heads
    if already > wanted:
        raise ValueError(f"head_budget {share}: dense_layers {list(dense_layers)} already keep {already} key-value heads dense, above the budget of {wanted}; pass fewer dense layers or a larger budget")  # fmt: skip
    routed = [p for p in ranking if p[0] not in dense_layers]
    if len(routed) < wanted - already:
        raise ValueError(f"head_budget {share}: {wanted - already} dense heads wanted, the ranking has {len(routed)} pairs of routed layers")  # fmt: skip
    return tuple(sorted(routed[: wanted - already]))
