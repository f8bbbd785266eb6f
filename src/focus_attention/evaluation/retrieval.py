"""Which layers retrieve: the share of attention the last query of a prompt gives a span of
earlier tokens (a needle), per layer, from the dense model (docs/method.md §9).

Retrieval from far back (a number hidden in a long prompt, a fact given early) runs through
a few heads that attend from the question straight to the needle; a layer whose grouping
drops those keys loses the answer. Ranking the layers by the attention their strongest head
gives the needle, on prompts of the validation split (:func:`rank_retrieval_layers`, run by
``focus bench retrieval-layers``), picks the layers to keep dense
(``FocusConfig.dense_layers``), and its ranking of (layer, key-value head) pairs the heads
(``FocusConfig.dense_heads``; :func:`rank_calibration_heads`, run by ``focus calibrate
--head-budget``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from ..hf.architectures import kv_heads_of
from ..ops.reference import attention_probs
from ..utils.checks import bad
from ..utils.env import environment, library_versions
from .needles import NeedleCase, load_needle_model, needle_cases
from .settings import CalibrateConfig, RetrievalLayersConfig

__all__ = [
    "RetrievalLayersConfig",
    "base_sliding_window",
    "needle_attention",
    "needle_attention_by_head",
    "rank_calibration_heads",
    "rank_retrieval_layers",
    "retrieval_layers_table",
]


def base_sliding_window(model_config: Any, layer: int) -> int | None:
    """The sliding window (tokens, the query included) of the base model's attention in
    ``layer``, or None for full attention: layers that ``config.layer_types`` marks
    ``"sliding_attention"`` (Gemma-2/3), or every layer of a model with a model-wide
    ``sliding_window`` and no layer types (Mistral)."""
    sliding = getattr(model_config, "sliding_window", None)
    if sliding is None:
        return None
    types = getattr(model_config, "layer_types", None)
    if types is None or types[layer] == "sliding_attention":
        return int(sliding)
    return None


@torch.no_grad()
def needle_attention(fm: Any, input_ids: torch.Tensor, span: tuple[int, int]) -> dict[int, float]:
    """Per Focus layer, the largest share of its attention that one head of the prompt's last
    query gives the tokens ``span = (start, end)`` (end excluded), in the dense model: the
    largest of :func:`needle_attention_by_head`'s shares.

    Returns:
        ``{layer: share}``, each share in ``[0, 1]``.

    Raises:
        ValueError: as :func:`needle_attention_by_head`.
    """
    return {layer: max(shares) for layer, shares in needle_attention_by_head(fm, input_ids, span).items()}  # fmt: skip


def needle_attention_by_head(
    fm: Any, input_ids: torch.Tensor, span: tuple[int, int]
) -> dict[int, list[float]]:
    """Per Focus layer and key-value head, the largest share of its attention that one of
    its query heads gives, from the prompt's last query, the tokens ``span = (start, end)``
    (end excluded), in the dense model (the base model's own attention, through
    ``FocusModel.record_dense_attention``, so a base layer's sliding window applies: the
    attention a dense layer or dense head would have; docs/method.md §9).

    Args:
        fm: a :class:`~focus_attention.hf.FocusModel`.
        input_ids: int64 ``[1, N]``, one prompt.
        span: token indices ``0 <= start < end < N`` of the needle.

    Returns:
        ``{layer: [share of key-value head 0, 1, ...]}``, each share in ``[0, 1]`` (the
        softmax mass, computed in float32; logit soft-capping applied where the layer has
        it), the index of the list being the ``kv_head`` of ``FocusConfig.dense_heads``.

    Raises:
        ValueError: a batch other than one prompt, a span outside ``0 <= start < end < N``,
            or Focus disabled (nothing recorded).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"needle_attention: input_ids {tuple(input_ids.shape)}, expected [1, N]")
    start, end = span
    n = input_ids.shape[1]
    if not 0 <= start < end < n:
        raise ValueError(f"needle_attention: span {span} outside 0 <= start < end < N={n}")
    saved = fm.focus_config
    fm.focus_config = saved.replace(dense_layers=(), dense_heads=())  # every head records
    try:
        with fm.record_dense_attention() as records:
            fm(input_ids=input_ids, use_cache=False)
    finally:
        fm.focus_config = saved
    if not records:
        raise ValueError(
            "needle_attention: no Focus layer recorded its attention (called inside "
            "disable_focus(), or on an unloaded model?)"
        )
    out = {}
    for rec in records:
        query = rec["query"][:, :, -1:].float()  # [1, H, 1, D]
        key = rec["key"].float()
        kv_heads = key.shape[1]
        visible = torch.ones(1, 1, key.shape[2], dtype=torch.bool, device=key.device)
        window = base_sliding_window(fm.base_model.config, int(rec["layer"]))
        if window is not None:  # the base layer sees only its last ``window`` keys
            visible[..., : max(0, n - window)] = False
        probs = attention_probs(query, key, visible, rec["scale"], rec["softcap"])
        shares = probs[0, :, 0, start:end].sum(dim=-1)  # [H]
        out[int(rec["layer"])] = shares.view(kv_heads, -1).max(dim=1).values.tolist()
    return out


def rank_retrieval_layers(config: RetrievalLayersConfig) -> dict[str, Any]:
    """Rank the Focus layers, and their key-value heads, by the attention the dense model's
    strongest (query) head of the last query gives the needle
    (:func:`~focus_attention.evaluation.retrieval.needle_attention_by_head`), averaged over
    the needle prompts of ``config`` (:func:`~.needles.needle_cases`; docs/method.md §9).

    Returns:
        JSON-able dict: ``config``, ``ranking`` (layers, most attentive first), ``by_layer``
        ``{layer: mean share}``, ``by_haystack`` ``{haystack: {layer: mean share}}``,
        ``dense_layers`` (the first ``count`` of the ranking, sorted: the value for
        ``FocusConfig.dense_layers`` or ``--dense-layers``), ``head_ranking`` (``[layer,
        kv_head]`` pairs, most attentive first), ``by_head`` ``{"layer:kv_head": mean
        share}``, ``dense_heads`` (the first ``heads`` pairs, sorted: the value for
        ``FocusConfig.dense_heads``), ``prompts``, ``seconds``, ``versions`` and
        ``environment``.

    Raises:
        ValueError: as :func:`~.needles.load_needle_model` and
            :func:`~.needles.needle_cases`; ``count`` above the Focus layers,
            ``heads`` above their (layer, key-value head) pairs.
    """
    fm, tokenizer, bos_id = load_needle_model(config)
    if config.count > len(fm.focus_layers):
        raise bad("RetrievalLayersConfig", "count", config.count,
                  f"at most the {len(fm.focus_layers)} Focus layers")  # fmt: skip
    pairs = len(fm.focus_layers) * kv_heads_of(fm.base_model.config)
    if config.heads > pairs:
        raise bad("RetrievalLayersConfig", "heads", config.heads,
                  f"at most the {pairs} (Focus layer, key-value head) pairs")  # fmt: skip
    t = time.monotonic()
    cases = needle_cases(config, tokenizer, bos_id)
    shares = _head_shares(fm, cases, config.progress)
    by_haystack = {h: {k: _mean([max(row) for row in rows]) for k, rows in sorted(d.items())}
                   for h, d in shares.items()}  # fmt: skip
    layers = sorted(next(iter(by_haystack.values())))
    by_layer = {k: _mean([d[k] for d in by_haystack.values()]) for k in layers}
    ranking = sorted(layers, key=lambda k: -by_layer[k])
    by_head = _by_head(shares)
    head_ranking = sorted(by_head, key=lambda pair: -by_head[pair])
    return {
        "config": asdict(config),
        "ranking": ranking,
        "by_layer": {str(k): v for k, v in by_layer.items()},
        "by_haystack": {h: {str(k): v for k, v in d.items()} for h, d in by_haystack.items()},
        "dense_layers": sorted(ranking[: config.count]),
        "head_ranking": [list(pair) for pair in head_ranking],
        "by_head": {f"{layer}:{head}": v for (layer, head), v in by_head.items()},
        "dense_heads": [list(pair) for pair in sorted(head_ranking[: config.heads])],
        "prompts": len(cases),
        "seconds": time.monotonic() - t,
        "versions": library_versions(),
        "environment": environment(),
    }


def rank_calibration_heads(config: CalibrateConfig) -> dict[str, Any]:
    """Rank the ``(layer, kv_head)`` pairs of ``config.adapter``'s Focus layers for
    ``focus calibrate --head-budget`` without a ``--head-ranking`` file: by the attention the
    dense model gives the needle of pass-key prompts of ``config.split``
    (``config.ranking_length`` tokens, seed 1), that is :func:`rank_retrieval_layers` as
    ``focus bench retrieval-layers --haystacks passkey`` runs it.

    Returns:
        ``config`` (the ranking's own), ``head_ranking``, ``by_head``, ``prompts`` and
        ``seconds`` of :func:`rank_retrieval_layers`' result (what
        :func:`focus_attention.evaluation.calibration.calibrate_adapter` ranks the heads
        with).

    Raises:
        ValueError: as :func:`rank_retrieval_layers`.
    """
    result = rank_retrieval_layers(RetrievalLayersConfig(
        model=config.model, adapter=config.adapter, corpus=config.corpus, split=config.split,
        lengths=(config.ranking_length,), haystacks=("passkey",), count=1, heads=1,
        threads=config.threads,
        progress=config.progress,
    ))  # fmt: skip
    return {k: result[k] for k in ("config", "head_ranking", "by_head", "prompts", "seconds")}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _head_shares(fm: Any, cases: list[NeedleCase], progress: bool) -> dict[str, dict[int, list]]:
    """``{haystack: {layer: [per-prompt list of the key-value heads' shares]}}``."""
    sums: dict[str, dict[int, list[list[float]]]] = {}
    for i, case in enumerate(cases):
        by_head = needle_attention_by_head(fm, case.input_ids, (case.needle_start, case.needle_end))
        for layer, heads in by_head.items():
            sums.setdefault(case.haystack, {}).setdefault(layer, []).append(heads)
        if progress:
            print(f"[retrieval-layers] prompt {i + 1}/{len(cases)} ({case.haystack}, "
                  f"{case.length} tokens, depth {case.depth:.2f})", file=sys.stderr)  # fmt: skip
    return sums


def _by_head(shares: dict[str, dict[int, list]]) -> dict[tuple[int, int], float]:
    """Mean share of every ``(layer, kv_head)``: over each haystack's prompts, then over the
    haystacks."""
    per_haystack = []
    for layers in shares.values():
        means = {}
        for layer, rows in layers.items():
            for head in range(len(rows[0])):
                means[(layer, head)] = _mean([row[head] for row in rows])
        per_haystack.append(means)
    return {pair: _mean([m[pair] for m in per_haystack]) for pair in sorted(per_haystack[0])}


def retrieval_layers_table(result: dict[str, Any]) -> str:
    """A markdown table of the ranking (a row per layer, most attentive first) and the
    suggested ``--dense-layers``."""
    hays = list(result["by_haystack"])
    lines = ["| rank | layer | mean | " + " | ".join(hays) + " |",
             "|---:|---:|---:|" + "---:|" * len(hays)]  # fmt: skip
    for rank, layer in enumerate(result["ranking"], 1):
        key = str(layer)
        cells = [f"{result['by_haystack'][h][key]:.3f}" for h in hays]
        lines.append(
            f"| {rank} | {layer} | {result['by_layer'][key]:.3f} | " + " | ".join(cells) + " |"
        )
    dense = " ".join(str(k) for k in result["dense_layers"])
    lines += ["", f"suggested: --dense-layers {dense}"]
    if result.get("dense_heads"):
        heads = ",".join(f"{layer}:{head}" for layer, head in result["dense_heads"])
        lines.append(f"or, head by head: --dense-heads {heads}")
    return "\n".join(lines)
