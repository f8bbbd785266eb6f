"""``focus bench needle``: retrieval from long prompts, dense attention against Focus top-k
(docs/method.md §9).

A number (the needle) is hidden at a chosen depth of a long prompt (the haystack) and asked
for at its end; the model answers greedily and the answer counts when its first number is the
needle's, exactly. Two haystacks: ``passkey`` (a short filler paragraph repeated, the
synthetic pass-key test) and ``book`` (held-out prose of a corpus, a different stretch per
trial). Every (haystack, length, depth, trial) prompt is answered by the dense model (Focus
disabled) and by Focus at every ``top_k``, so the modes see the same prompts.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from ..assets.models import auto_prepend_bos, load_model
from ..evaluation.needles import NeedleCase, answer_of, build_case, haystack_tokens
from ..evaluation.retrieval import needle_attention_by_head
from ..hf import FocusModel
from ..hf.architectures import kv_heads_of
from ..utils.checks import bad
from ..utils.env import environment, library_versions
from ..utils.plots import save_png
from .needle_diagnostics import needle_modes
from .settings import (
    HAYSTACKS,
    NEEDLE_DEPTHS,
    NEEDLE_LENGTHS,
    NeedleBenchConfig,
    RetrievalLayersConfig,
)

if TYPE_CHECKING:
    from ..evaluation.settings import CalibrateConfig

__all__ = [
    "HAYSTACKS",
    "NEEDLE_DEPTHS",
    "NEEDLE_LENGTHS",
    "NeedleBenchConfig",
    "RetrievalLayersConfig",
    "needle_table",
    "plot_needle",
    "rank_calibration_heads",
    "rank_retrieval_layers",
    "retrieval_layers_table",
    "run_needle_benchmark",
]


def _haystack_ids(
    config: NeedleBenchConfig | RetrievalLayersConfig, tokenizer: Any, kind: str
) -> list[int]:
    """Token ids the haystack of ``kind`` is cut from (long enough for the longest prompt)."""
    return haystack_tokens(tokenizer, kind, config.corpus, config.split, max(config.lengths))


def _cases(
    config: NeedleBenchConfig | RetrievalLayersConfig, tokenizer: Any, bos_id: int | None
) -> list[NeedleCase]:
    """Every prompt of the benchmark, deterministic in ``config.seed``."""
    rng = random.Random(config.seed)
    cases = []
    for kind in config.haystacks:
        source = _haystack_ids(config, tokenizer, kind)
        for length in config.lengths:
            for depth in config.depths:
                for trial in range(config.trials):
                    cases.append(
                        build_case(
                            tokenizer, source, kind, length, depth, trial, rng, bos_id=bos_id
                        )  # fmt: skip
                    )
    return cases


def _answer(model: Any, tokenizer: Any, case: NeedleCase, max_new_tokens: int) -> tuple[str, float]:  # fmt: skip
    """Greedy answer of ``model`` to ``case`` and the seconds it took (prefill + decode)."""
    t = time.monotonic()
    ids = case.input_ids.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return text, time.monotonic() - t


def run_needle_benchmark(
    config: NeedleBenchConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run every prompt in every mode (module docstring).

    ``checkpoint``, when given, receives the result so far after every cell (``"complete":
    False``), so that an interrupted run keeps the cells it answered (``focus bench needle``
    rewrites its JSON with it).

    Returns:
        JSON-able dict: ``config``, ``cells`` (one per prompt and mode: haystack, length,
        depth, trial, mode, answer, generated text, correct, seconds), ``accuracy``
        ``{haystack: {mode: {length: {depth: share}}}}``, ``complete`` (True),
        ``versions`` and ``environment``.

    Raises:
        ValueError: a length above the model's ``max_position_embeddings``, a haystack too
            short, or the errors of loading the model or adapter.
    """
    fm, tokenizer, bos_id = _load(config)
    fm.focus_config = fm.focus_config.override(**config.overrides(without=("top_k",)))
    modes = needle_modes(fm, config.top_k, config.diagnostics, config.seed, config.dense)
    cells = []
    for case in _cases(config, tokenizer, bos_id):
        for mode, enter in modes:
            with enter() as kept_share:
                text, seconds = _answer(fm, tokenizer, case, config.max_new_tokens)
            cells.append(_cell(case, mode, text, seconds, kept_share()))
            if config.progress:
                c = cells[-1]
                print(f"[needle] {c['haystack']} {c['length']} tokens depth {c['depth']:.2f} "
                      f"trial {c['trial']} {mode}: {'ok ' if c['correct'] else 'miss'} "
                      f"{c['seconds']:.1f} s{_kept_text(c['distant_kept'])}",
                      file=sys.stderr)  # fmt: skip
            if checkpoint is not None:
                checkpoint(_needle_result(config, cells, complete=False))
    return _needle_result(config, cells, complete=True)


def _needle_result(config: NeedleBenchConfig, cells: list[dict[str, Any]], *, complete: bool) -> dict[str, Any]:  # fmt: skip
    """The JSON-able result of the ``cells`` answered so far."""
    return {
        "config": asdict(config),
        "cells": list(cells),
        "accuracy": _accuracy(cells),
        "distant_kept": _distant_kept(cells),
        "complete": complete,
        "versions": library_versions(),
        "environment": environment(),
    }


def _load(config: NeedleBenchConfig | RetrievalLayersConfig) -> tuple[Any, Any, int | None]:
    """``(Focus model in eval mode, tokenizer, BOS id or None)`` of a configuration.

    Raises:
        ValueError: a length above the model's ``max_position_embeddings``, or the errors of
            loading the model or adapter.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    base, tokenizer = load_model(config.model, quiet=not config.progress)
    limit = getattr(base.config, "max_position_embeddings", None)
    if limit is not None and max(config.lengths) > limit:
        raise bad(type(config).__name__, "lengths", config.lengths, f"at most {limit} tokens")
    fm = FocusModel.from_pretrained(base, config.adapter).eval()
    return fm, tokenizer, tokenizer.bos_token_id if auto_prepend_bos(base) else None


def rank_retrieval_layers(config: RetrievalLayersConfig) -> dict[str, Any]:
    """Rank the Focus layers, and their key-value heads, by the attention the dense model's
    strongest (query) head of the last query gives the needle
    (:func:`~focus_attention.evaluation.retrieval.needle_attention_by_head`), averaged over
    the needle prompts of ``config`` (module docstring; docs/method.md §9).

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
        ValueError: as :func:`run_needle_benchmark`; ``count`` above the Focus layers,
            ``heads`` above their (layer, key-value head) pairs.
    """
    fm, tokenizer, bos_id = _load(config)
    if config.count > len(fm.focus_layers):
        raise bad("RetrievalLayersConfig", "count", config.count,
                  f"at most the {len(fm.focus_layers)} Focus layers")  # fmt: skip
    pairs = len(fm.focus_layers) * kv_heads_of(fm.base_model.config)
    if config.heads > pairs:
        raise bad("RetrievalLayersConfig", "heads", config.heads,
                  f"at most the {pairs} (Focus layer, key-value head) pairs")  # fmt: skip
    t = time.monotonic()
    cases = _cases(config, tokenizer, bos_id)
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
        ``seconds`` of :func:`rank_retrieval_layers`' result (this function is the
        ``rank_heads`` that ``focus calibrate`` hands to
        :func:`focus_attention.evaluation.calibration.calibrate_adapter`).

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


def _kept_text(share: float | None) -> str:
    return "" if share is None else f", distant keys kept {share:.3f}"


def _cell(case: NeedleCase, mode: str, text: str, seconds: float, kept: float | None) -> dict[str, Any]:  # fmt: skip
    return {
        "haystack": case.haystack,
        "length": case.length,
        "depth": case.depth,
        "trial": case.trial,
        "mode": mode,
        "answer": case.answer,
        "generated": text,
        "correct": answer_of(text) == case.answer,
        "seconds": seconds,
        "distant_kept": kept,
    }


def _accuracy(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Share of correct answers per haystack, mode, length and depth (string keys)."""
    groups: dict[tuple, list[bool]] = {}
    for c in cells:
        key = (c["haystack"], c["mode"], str(c["length"]), f"{c['depth']:g}")
        groups.setdefault(key, []).append(bool(c["correct"]))
    out: dict[str, Any] = {}
    for (hay, mode, length, depth), hits in groups.items():
        row = out.setdefault(hay, {}).setdefault(mode, {}).setdefault(length, {})
        row[depth] = sum(hits) / len(hits)
    return out


def _distant_kept(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean share of distant keys kept per haystack, mode and length (string keys), over the
    cells that measured it."""
    groups: dict[tuple, list[float]] = {}
    for c in cells:
        if c.get("distant_kept") is not None:
            key = (c["haystack"], c["mode"], str(c["length"]))
            groups.setdefault(key, []).append(c["distant_kept"])
    out: dict[str, Any] = {}
    for (hay, mode, length), shares in groups.items():
        out.setdefault(hay, {}).setdefault(mode, {})[length] = sum(shares) / len(shares)
    return out


def needle_table(result: dict[str, Any]) -> str:
    """Markdown tables of the accuracy: one per haystack, a row per mode and length, a
    column per depth, the row's mean and the mean share of distant keys kept (``-`` where
    it was not measured)."""
    lines = []
    kept = result.get("distant_kept", {})
    for hay, modes in result["accuracy"].items():
        depths = list(next(iter(next(iter(modes.values())).values())))
        lines += [
            f"{hay} haystack: share of needles retrieved (greedy answer, exact number)",
            "",
            "| mode | tokens | "
            + " | ".join(f"depth {d}" for d in depths)
            + " | mean | distant kept |",
            "|---|---:|" + "---:|" * (len(depths) + 2),
        ]
        for mode, lengths in modes.items():
            for length, row in lengths.items():
                vals = [row[d] for d in depths]
                cells = " | ".join(f"{v:.2f}" for v in vals)
                share = kept.get(hay, {}).get(mode, {}).get(length)
                share_text = "-" if share is None else f"{share:.3f}"
                lines.append(f"| {mode} | {length} | {cells} | {sum(vals) / len(vals):.2f} "
                             f"| {share_text} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines).rstrip()


def plot_needle(result: dict[str, Any], path: str) -> None:
    """One heatmap per (haystack, mode): lengths (rows) by depths (columns), the share
    retrieved in each cell; written to ``path`` (:func:`~focus_attention.utils.plots.save_png`)."""
    import matplotlib  # heavy: imported only to draw a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    acc = result["accuracy"]
    panels = [(hay, mode, grid) for hay, modes in acc.items() for mode, grid in modes.items()]
    ncols = max(len(m) for m in acc.values())
    fig, axes = plt.subplots(len(acc), ncols, figsize=(3.2 * ncols, 2.8 * len(acc)),
                             squeeze=False)  # fmt: skip
    for i, (hay, mode, grid) in enumerate(panels):
        ax = axes[i // ncols][i % ncols]
        lengths, depths = list(grid), list(next(iter(grid.values())))
        values = [[grid[n][d] for d in depths] for n in lengths]
        ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set(xticks=range(len(depths)), xticklabels=depths, yticks=range(len(lengths)),
               yticklabels=lengths, xlabel="needle depth", ylabel="tokens",
               title=f"{hay}: {mode}")  # fmt: skip
        for r, row in enumerate(values):
            for c, v in enumerate(row):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
