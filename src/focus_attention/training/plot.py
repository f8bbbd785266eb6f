"""The training plot: loss and validation perplexity over steps, from ``log.jsonl``."""

from __future__ import annotations

import os
from pathlib import Path

from ..utils.plots import save_png
from .outputs import read_log

__all__ = ["write_plot"]


def _smoothed(values: list[float], span: int) -> list[float]:
    """Mean of the last ``span`` values at every position."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - span + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def _plot_loss(ax, rows: list[dict]) -> None:
    if rows:
        xs = [r["step"] for r in rows]
        ys = [r["loss"] for r in rows]
        ax.plot(xs, ys, lw=0.8, alpha=0.5, label="loss (soft routing)")
        span = max(1, len(ys) // 20)
        if span > 1:
            ax.plot(xs, _smoothed(ys, span), lw=1.5, label=f"mean of last {span}")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("training loss")


def _plot_validation(ax, rows: list[dict]) -> None:
    if rows:
        xs = [r["step"] for r in rows]
        ax.plot(xs, [r["val_ppl_topk"] for r in rows], "o-", label="Focus top-k")
        soft = [r for r in rows if "val_ppl_soft" in r]  # query-key routers: no soft routing
        if soft:
            ax.plot(
                [r["step"] for r in soft],
                [r["val_ppl_soft"] for r in soft],
                "s-",
                label="Focus soft",
            )
        base = [r.get("val_ppl_base") for r in rows if r.get("val_ppl_base") is not None]
        if base:
            ax.axhline(base[0], color="gray", ls="--", label="base model")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("validation perplexity")
    ax.set_title("validation perplexity")


def write_plot(log_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path | None:
    """Plot training loss and validation perplexity (top-k and soft) over steps from a
    ``log.jsonl`` into ``png_path`` (matplotlib Agg, written atomically).

    Returns:
        the path written, or ``None`` when the log has nothing to plot.
    """
    import matplotlib  # heavy, used only to draw: loaded when a plot is written

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    rows = read_log(Path(log_path))
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_ppl_topk" in r]
    if not train_rows and not val_rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _plot_loss(ax1, train_rows)
    _plot_validation(ax2, val_rows)
    fig.tight_layout()
    return save_png(fig, png_path)
