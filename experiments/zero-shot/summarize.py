"""Collect the zero-shot benchmark results (the steps of ``experiments/zero-shot/config.toml``) into markdown tables.

usage: python experiments/zero-shot/summarize.py [RESULTS_DIR] [--out README.md]

Reads ``RESULTS_DIR/{dense,top2-w128,top1-w128,top2-w32,top1-w32}.json`` (default
``experiments/zero-shot/results/tasks``; missing files are left out), and the same with the prefix
``lambada500-`` (LAMBADA alone on more examples), and writes one table per window setting: for every task and metric, the dense model's value with its standard error, each
Focus setting's value and its paired difference to the dense model over the same examples
(mean of the per-example differences, ± its standard error), and the share of scored tokens
whose context exceeds window + sink tokens ("routed": the only predictions Focus can change).
"""

from __future__ import annotations

import argparse
import json
import math
import os

#: (file stem, column title) of the Focus settings, per window
SETTINGS = {
    128: [("top2-w128", "top-2"), ("top1-w128", "top-1")],
    32: [("top2-w32", "top-2, window 32"), ("top1-w32", "top-1, window 32")],
}
#: metrics shown per task (percent for accuracies)
METRICS = ("acc", "acc_norm", "perplexity")


def _load(root: str, stem: str) -> dict | None:
    path = os.path.join(root, f"{stem}.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _paired(dense: dict, other: dict, key: str) -> tuple[float, float] | None:
    """Mean and standard error of the per-example differences ``other - dense``."""
    a = dict(zip(dense["per_example"]["doc_id"], dense["per_example"].get(key, []), strict=False))
    b = dict(zip(other["per_example"]["doc_id"], other["per_example"].get(key, []), strict=False))
    common = sorted(set(a) & set(b))
    if not common:
        return None
    d = [b[i] - a[i] for i in common]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1) if len(d) > 1 else 0.0
    return mean, math.sqrt(var / len(d))


def _value(entry: dict, metric: str) -> str:
    m = entry["metrics"]
    scale, digits = (1.0, 2) if metric == "perplexity" else (100.0, 1)
    text = f"{m[metric] * scale:.{digits}f}"
    se = m.get(f"{metric}_stderr")
    return text if se is None else f"{text} ± {se * scale:.{digits}f}"


def _focus_cell(dense: dict, entry: dict, metric: str) -> str:
    if metric == "perplexity":
        rel = entry["metrics"][metric] / dense["metrics"][metric] - 1
        return f"{entry['metrics'][metric]:.2f} ({100 * rel:+.1f}%)"
    diff = _paired(dense, entry, metric)
    shown = f"{100 * entry['metrics'][metric]:.1f}"
    return shown if diff is None else f"{shown} (Δ {100 * diff[0]:+.1f} ± {100 * diff[1]:.1f})"


def table(root: str, window: int, prefix: str = "") -> str | None:
    dense = _load(root, prefix + "dense")
    settings = [(title, r) for stem, title in SETTINGS[window] if (r := _load(root, prefix + stem))]
    if dense is None or not settings:
        return None
    focus = settings[0][1]["model"]["focus"]
    sinks = focus["sink_tokens"]
    head = ["task", "examples", "metric", "dense"] + [t for t, _ in settings] + [f"routed (context > {window} + {sinks})"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (len(head) - 3)]
    for task in settings[0][1]["tasks"]:
        d = dense["tasks"][task]
        routed = settings[0][1]["tasks"][task]["tokens"]["routed_share"]
        for metric in METRICS:
            if metric not in d["metrics"]:
                continue
            cells = [_focus_cell(d, r["tasks"][task], metric) for _, r in settings]
            lines.append(f"| {task} | {d['examples']} | {metric} | {_value(d, metric)} | "
                         + " | ".join(cells) + f" | {100 * routed:.1f}% |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="experiments/zero-shot/results/tasks")
    parser.add_argument(
        "--out", default=None, help="write the tables here (default ROOT/README.md)"
    )
    args = parser.parse_args()
    parts = []
    for prefix, what in (("", ""), ("lambada500-", "LAMBADA alone, more examples, ")):
        for window in SETTINGS:
            t = table(args.root, window, prefix)
            if t is not None:
                parts += [f"{what}window {window}:", "", t, ""]
    text = "\n".join(parts)
    out = args.out or os.path.join(args.root, "README.md")
    with open(out, "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
