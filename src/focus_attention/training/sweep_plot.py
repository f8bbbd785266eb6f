"""The plots of a sweep (:mod:`.sweep`): perplexity against pairs retained per cell, and
the routing dominance of every cell over its training (from each ``log.jsonl``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..utils.io import atomic_write
from .checkpoint import LOG_NAME, read_log

__all__ = ["PAIRS_PLOT", "DOMINANCE_PLOT", "write_sweep_plots"]

#: file names of the two plots in the sweep's directory
PAIRS_PLOT = "ppl_vs_pairs.png"
DOMINANCE_PLOT = "dominance.png"


def _label(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in row["settings"].items()) or row["slug"]


def _plot_pairs(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Top-k perplexity against the share of causal pairs retained, one line per cell
    (one point per ``top_k``), and the dense base model as a dashed line."""
    for row in rows:
        ks = list(row["ppl"]["focus_topk"])
        xs = [100 * row["pairs_retained"][k] for k in ks]
        ys = [row["ppl"]["focus_topk"][k] for k in ks]
        ax.plot(xs, ys, "o-", ms=3, label=_label(row))
    if rows:
        ax.axhline(rows[0]["ppl"]["base"], color="gray", ls="--", label="base (dense)")
    ax.set_xlabel("causal pairs retained (%)")
    ax.set_ylabel("perplexity (top-k routing)")
    ax.set_title("perplexity vs pairs retained (points: top_k = 1..K)")
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
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


def write_sweep_plots(rows: list[dict[str, Any]], out: str | Path) -> list[Path]:
    """Write :data:`PAIRS_PLOT` and :data:`DOMINANCE_PLOT` into ``out`` (matplotlib Agg,
    atomically) from the sweep's cell rows (:func:`~.sweep.run_cell`); returns the paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out)
    fig, ax = plt.subplots(figsize=(8, 5))
    _plot_pairs(ax, rows)
    paths = [_save(fig, out / PAIRS_PLOT)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    _plot_dominance(axes, rows)
    paths.append(_save(fig, out / DOMINANCE_PLOT))
    return paths
