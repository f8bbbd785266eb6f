"""The plots of a sweep (:mod:`.grid`): perplexity against pairs retained per cell, one
panel per evaluation with the Pareto points marked, and the routing dominance of every cell over its training (from each ``log.jsonl``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..training.outputs import LOG_NAME, read_log
from ..utils.plots import save_png

__all__ = ["PAIRS_PLOT", "DOMINANCE_PLOT", "write_pairs_plot", "write_sweep_plots"]

#: file names of the two plots in the sweep's directory
PAIRS_PLOT = "ppl_vs_pairs.png"
DOMINANCE_PLOT = "dominance.png"


def _label(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in row["settings"].items()) or row["slug"]


def _plot_pairs(ax: Any, name: str, points: list[dict[str, Any]], labels: dict[str, str]) -> None:
    """Top-k perplexity against the share of causal pairs retained in evaluation ``name``:
    one line per cell (one point per ``top_k``, annotated), the Pareto points
    (:func:`~.grid.sweep_points`) ringed and joined, the dense base model as a dashed
    line."""
    for slug, label in labels.items():
        mine = sorted((p for p in points if p["slug"] == slug), key=lambda p: p["top_k"])
        if not mine:
            continue
        xs = [100 * p["pairs_retained"] for p in mine]
        ax.plot(xs, [p["ppl"] for p in mine], "o-", ms=4, label=label)
        for p, x in zip(mine, xs, strict=True):
            ax.annotate(f"k={p['top_k']}", (x, p["ppl"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
    front = sorted((p for p in points if p["pareto"]), key=lambda p: p["pairs_retained"])
    ax.plot([100 * p["pairs_retained"] for p in front], [p["ppl"] for p in front], "k:",
            lw=1)  # fmt: skip
    ax.scatter([100 * p["pairs_retained"] for p in front], [p["ppl"] for p in front],
               s=90, facecolors="none", edgecolors="k", label="Pareto points")  # fmt: skip
    ax.axhline(points[0]["dense"], color="gray", ls="--", label="dense")
    ax.set_xlabel("causal pairs retained (%)")
    ax.set_ylabel("perplexity (top-k routing)")
    ax.set_title(f"evaluation {name}: perplexity vs pairs retained")
    ax.legend(fontsize=7)


def _plot_dominance(axes: Any, rows: list[dict[str, Any]]) -> None:
    """Mean soft-routing dominance and worst-layer dominance over training steps."""
    for row in rows:
        log = [r for r in read_log(Path(row["dir"]) / LOG_NAME) if "dominance" in r]
        steps = [r["step"] for r in log]
        (line,) = axes[0].plot(steps, [r["dominance"] for r in log], label=_label(row))
        axes[1].plot(steps, [r.get("dominance_max", r["dominance"]) for r in log],
                     color=line.get_color())  # fmt: skip
    for ax, what in zip(axes, ("mean over layers", "worst layer"), strict=True):
        ax.set_xlabel("training step")
        ax.set_ylabel("dominance (1 = one group holds every token)")
        ax.set_title(f"group dominance of the soft routing, {what}")
        ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=7)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    return save_png(fig, path)


def write_pairs_plot(
    rows: list[dict[str, Any]], points: dict[str, list[dict[str, Any]]], out: str | Path
) -> Path:
    """Write :data:`PAIRS_PLOT` (perplexity against pairs retained, one panel per
    evaluation) into ``out`` (matplotlib Agg, atomically) from the sweep's cell rows and
    points alone (:func:`~.grid.sweep_points`); returns its path."""
    import matplotlib  # heavy, used only to draw: loaded when a plot is written

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    labels = {row["slug"]: _label(row) for row in rows}
    names = [n for n in points if points[n]]
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(7 * max(1, len(names)), 5),
                             squeeze=False)  # fmt: skip
    for ax, name in zip(axes[0], names, strict=False):
        _plot_pairs(ax, name, points[name], labels)
    return _save(fig, Path(out) / PAIRS_PLOT)


def write_sweep_plots(
    rows: list[dict[str, Any]], points: dict[str, list[dict[str, Any]]], out: str | Path
) -> list[Path]:
    """Write :data:`PAIRS_PLOT` (:func:`write_pairs_plot`) and :data:`DOMINANCE_PLOT` (from
    each cell's ``log.jsonl``) into ``out`` (matplotlib Agg, atomically) from the sweep's
    cell rows (:func:`~.grid.run_cell`) and points (:func:`~.grid.sweep_points`);
    returns the paths."""
    import matplotlib.pyplot as plt  # heavy, used only to draw: loaded when a plot is written

    paths = [write_pairs_plot(rows, points, out)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    _plot_dominance(axes, rows)
    paths.append(_save(fig, Path(out) / DOMINANCE_PLOT))
    return paths
