"""The quality / speed trade-off of window and top_k in one plot.

usage: python experiments/long-input-recipe/pareto.py --quality Q1.json [Q2.json ...] --speed MODEL.json \\
           --out experiments/long-input-recipe/results/long_context_pareto

``--quality``: results of ``experiments/long-input-recipe/compare_adapters.py`` (one per window, the same adapter),
giving the perplexity at 4,096 tokens against the dense model. ``--speed``: a
``focus bench model --window ...`` result with the same adapter, giving the prefill speed-up
against stock sdpa at each length. Writes ``OUT.json`` (the joined points) and ``OUT.png``
(one panel per prefill length: perplexity change against speed-up, one point per
``(window, top_k)``; the dense model is the point (1x, 0%)).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from focus_attention.utils.io import write_json_atomic


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quality", nargs="+", type=Path, required=True)
    p.add_argument("--speed", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="path without suffix")
    return p.parse_args()


def _points(quality: list[Path], speed: dict) -> list[dict]:
    points = []
    for path in quality:
        q = json.loads(path.read_text())
        window = q["config"]["window"]
        base = q["base"]
        (row,) = q["adapters"].values()
        for k, ppl in ((k, v) for k, v in row.items() if k.isdigit()):
            point = {"window": window, "top_k": int(k), "ppl": ppl, "ppl_change": ppl / base - 1}
            for r in speed["rows"]:
                if r["method"] == "focus" and r["top_k"] == int(k) and r["window"] == window:
                    point[f"speedup_{r['N']}"] = r["speedup_vs_sdpa"]
            points.append(point)
    return points


def _plot(points: list[dict], lengths: list[int], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    for ax, n in zip(axes[0], lengths, strict=True):
        ax.scatter([1.0], [0.0], marker="*", s=120, color="black", label="dense (sdpa)")
        for k in sorted({p["top_k"] for p in points}):
            pts = [p for p in points if p["top_k"] == k and f"speedup_{n}" in p]
            pts.sort(key=lambda p: p["window"])
            xs = [p[f"speedup_{n}"] for p in pts]
            ys = [100 * p["ppl_change"] for p in pts]
            ax.plot(xs, ys, marker="o", label=f"top_k = {k}")
            for p, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"w{p['window']}", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)  # fmt: skip
        ax.set_xlabel(f"prefill speed-up vs sdpa at {n:,} tokens")
        ax.set_ylabel("perplexity vs dense at 4,096 tokens (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Focus: window and top_k trade-off (smollm2-135m, validation book)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    a = _args()
    speed = json.loads(a.speed.read_text())
    points = _points(a.quality, speed)
    lengths = sorted({r["N"] for r in speed["rows"]})
    doc = {"points": points, "quality": [str(p) for p in a.quality], "speed": str(a.speed),
           "speed_environment": speed.get("environment")}  # fmt: skip
    write_json_atomic(a.out.with_suffix(".json"), doc)
    _plot(points, lengths, a.out.with_suffix(".png"))
    for p in points:
        print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
