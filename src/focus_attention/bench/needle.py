"""``focus bench needle``: retrieval from long prompts, dense attention against Focus top-k
(docs/method.md §9).

A number (the needle) is hidden at a chosen depth of a long prompt (the haystack) and asked
for at its end; the model answers greedily and the answer counts when its first number is the
needle's, exactly. Two haystacks: ``passkey`` (a short filler paragraph repeated, the
synthetic pass-key test) and ``book`` (held-out prose of a corpus, a different stretch per
trial). Every (haystack, length, depth, trial) prompt is answered by the dense model (Focus
disabled) and by Focus at every ``top_k``, so the modes see the same prompts
(:mod:`focus_attention.evaluation.needles`).

The ranking of the layers and heads that retrieve (``focus bench retrieval-layers``) lives
with evaluation, in :mod:`focus_attention.evaluation.retrieval`; its names are re-exported
here.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from ..evaluation.needles import (
    NeedleCase,
    answer_margin,
    answer_of,
    load_needle_model,
    needle_cases,
)
from ..evaluation.retrieval import (
    RetrievalLayersConfig,
    rank_calibration_heads,
    rank_retrieval_layers,
    retrieval_layers_table,
)
from ..utils.env import environment, library_versions
from ..utils.plots import save_png
from .needle_diagnostics import needle_modes
from .settings import HAYSTACKS, NEEDLE_DEPTHS, NEEDLE_LENGTHS, NeedleBenchConfig

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


def _answer(model: Any, tokenizer: Any, case: NeedleCase, max_new_tokens: int) -> tuple[str, float, float]:  # fmt: skip
    """Greedy answer of ``model`` to ``case``, the seconds it took (prefill + decode) and
    its :func:`~focus_attention.evaluation.needles.answer_margin`."""
    t = time.monotonic()
    ids = case.input_ids.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    seconds = time.monotonic() - t
    new = out.sequences[0, ids.shape[1] :]
    answer = tokenizer(" " + case.answer, add_special_tokens=False).input_ids
    margin = answer_margin([step[0] for step in out.logits], new.tolist(), answer)
    return tokenizer.decode(new, skip_special_tokens=True), seconds, margin


def run_needle_benchmark(
    config: NeedleBenchConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run every prompt in every mode (module docstring).

    ``checkpoint``, when given, receives the result so far after every cell (``"complete":
    False``), so that an interrupted run keeps the cells it answered (``focus bench needle``
    rewrites its JSON with it).

    Returns:
        JSON-able dict: ``config``, ``cells`` (one per prompt and mode: haystack, length,
        depth, trial, mode, answer, generated text, correct, seconds, ``distant_kept``:
        the share of distant keys kept on the prompt, ``needle_seen``: ``{layer: share of
        the needle's tokens the prompt's last query sees}`` per routed layer, None for
        dense, ``answer_margin``: the logit margin of the answer's tokens,
        :func:`~focus_attention.evaluation.needles.answer_margin`), ``accuracy``
        ``{haystack: {mode: {length: {depth: share}}}}``, ``distant_kept`` and
        ``answer_margin`` (means ``{haystack: {mode: {length: mean}}}``), ``complete``
        (True), ``versions`` and ``environment``.

    Raises:
        ValueError: a length above the model's ``max_position_embeddings``, a haystack too
            short, ``diagnostic_top_k`` above the adapter's ``num_groups``, or the errors of
            loading the model or adapter.
    """
    fm, tokenizer, bos_id = load_needle_model(config)
    fm.focus_config = fm.focus_config.override(**config.overrides(without=("top_k",)))
    modes = needle_modes(fm, config.top_k, config.diagnostics, config.seed, config.dense,
                         config.diagnostic_top_k)  # fmt: skip
    cells = []
    for case in needle_cases(config, tokenizer, bos_id):
        for mode, enter in modes:
            with enter() as measure:
                text, seconds, margin = _answer(fm, tokenizer, case, config.max_new_tokens)
            kept, seen = measure(case.needle_start, case.needle_end)
            cells.append(_cell(case, mode, text, seconds, kept, seen, margin))
            if config.progress:
                c = cells[-1]
                print(f"[needle] {c['haystack']} {c['length']} tokens depth {c['depth']:.2f} "
                      f"trial {c['trial']} {mode}: {'ok ' if c['correct'] else 'miss'} "
                      f"{c['seconds']:.1f} s{_margin_text(c['answer_margin'])}"
                      f"{_kept_text(c['distant_kept'])}{_seen_text(seen)}",
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
        "distant_kept": _mean_per_length(cells, "distant_kept"),
        "answer_margin": _mean_per_length(cells, "answer_margin"),
        "complete": complete,
        "versions": library_versions(),
        "environment": environment(),
    }


def _margin_text(margin: float | None) -> str:
    return "" if margin is None else f", margin {margin:+.2f}"


def _kept_text(share: float | None) -> str:
    return "" if share is None else f", distant keys kept {share:.3f}"


def _seen_text(seen: dict[int, float] | None) -> str:
    if not seen:
        return ""
    whole = sum(share == 1.0 for share in seen.values())
    mean = sum(seen.values()) / len(seen)
    return f", needle tokens seen {mean:.3f} (whole in {whole}/{len(seen)} routed layers)"


def _cell(case: NeedleCase, mode: str, text: str, seconds: float, kept: float | None,
          seen: dict[int, float] | None = None, margin: float | None = None) -> dict[str, Any]:  # fmt: skip
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
        "needle_seen": None if seen is None else {str(k): v for k, v in seen.items()},
        "answer_margin": None if margin is None or math.isnan(margin) else margin,
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


def _mean_per_length(cells: list[dict[str, Any]], field: str) -> dict[str, Any]:
    """Mean of each cell's ``field`` (``distant_kept``, ``answer_margin``) per haystack, mode
    and length (string keys), over the cells that measured it."""
    groups: dict[tuple, list[float]] = {}
    for c in cells:
        if c.get(field) is not None:
            key = (c["haystack"], c["mode"], str(c["length"]))
            groups.setdefault(key, []).append(c[field])
    out: dict[str, Any] = {}
    for (hay, mode, length), values in groups.items():
        out.setdefault(hay, {}).setdefault(mode, {})[length] = sum(values) / len(values)
    return out


def needle_table(result: dict[str, Any]) -> str:
    """Markdown tables of the accuracy: one per haystack, a row per mode and length, a
    column per depth, the row's mean, the mean answer margin in logits and the mean share
    of distant keys kept (``-`` where it was not measured)."""
    lines = []
    kept, margins = result.get("distant_kept", {}), result.get("answer_margin", {})
    for hay, modes in result["accuracy"].items():
        depths = _depths(row for lengths in modes.values() for row in lengths.values())
        lines += [
            f"{hay} haystack: share of needles retrieved (greedy answer, exact number)",
            "",
            "| mode | tokens | "
            + " | ".join(f"depth {d}" for d in depths)
            + " | mean | margin | distant kept |",
            "|---|---:|" + "---:|" * (len(depths) + 3),
        ]
        for mode, lengths in modes.items():
            for length, row in lengths.items():
                vals = [row[d] for d in depths if d in row]
                cells = " | ".join("-" if d not in row else f"{row[d]:.2f}" for d in depths)
                share = kept.get(hay, {}).get(mode, {}).get(length)
                margin = margins.get(hay, {}).get(mode, {}).get(length)
                share_text = "-" if share is None else f"{share:.3f}"
                margin_text = "-" if margin is None else f"{margin:+.2f}"
                lines.append(f"| {mode} | {length} | {cells} | {sum(vals) / len(vals):.2f} "
                             f"| {margin_text} | {share_text} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines).rstrip()


def _depths(rows: Any) -> list[str]:
    """The depths (keys) of every row, in numeric order: an interrupted run's last length
    may lack some."""
    return sorted({d for row in rows for d in row}, key=float)


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
        lengths, depths = list(grid), _depths(grid.values())
        values = [[grid[n].get(d, math.nan) for d in depths] for n in lengths]
        ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set(xticks=range(len(depths)), xticklabels=depths, yticks=range(len(lengths)),
               yticklabels=lengths, xlabel="needle depth", ylabel="tokens",
               title=f"{hay}: {mode}")  # fmt: skip
        for r, row in enumerate(values):
            for c, v in enumerate(row):
                ax.text(c, r, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center",
                        fontsize=8)  # fmt: skip
    fig.tight_layout()
    save_png(fig, path)
