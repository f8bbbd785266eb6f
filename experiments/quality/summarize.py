"""Collect the honest-results evaluations (the sweep step of ``experiments/quality/config.toml``) into one table.

usage: python experiments/quality/summarize.py [RUNS_DIR] [--json OUT.json] [--plot OUT.png]
       python experiments/quality/summarize.py --collected honest.json [--markdown OUT.md] ...

Reads ``RUNS_DIR/*/eval-*.json`` (default ``runs/honest/cells``, where the quality study's sweep step writes them) and prints a markdown table of
perplexities (token-weighted, the eval's window scheme) and pairs retained; with ``--json``
also writes the collected evaluations (configuration, versions and hardware included);
with ``--plot`` a bar chart of perplexity per evaluation (dense base as a line). With
``--collected FILE`` the evaluations are read back from such a ``--json`` file instead of
the runs, so that the table and plot are rebuilt from the study's results alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def _row(path: str, root: str) -> tuple[str, dict]:
    with open(path) as fh:
        r = json.load(fh)
    return os.path.relpath(path, root).removesuffix(".json"), r


def table(evals: list[tuple[str, dict]]) -> str:
    head = (
        "| evaluation | steps | gate | sink_tokens | routing | base | soft | top-1 | top-2 "
        "| top-4 | pairs top-1 | pairs top-2 | dominance top-1 |"
    )
    lines = [head, "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in evals:
        cfg = r["config"]
        fc = cfg["focus"]
        steps = (cfg.get("train_config") or {}).get("steps", "?")
        ppl, topk, pairs = r["ppl"], r["ppl"]["focus_topk"], r["pairs_retained"]
        dom = r.get("dominance", {}).get("topk", {})

        def p(k, t=topk):
            return f"{t[k]:.2f}" if k in t else "-"

        def pct(k, t):
            return f"{100 * t[k]:.1f}%" if k in t else "-"

        lines.append(
            f"| {name} | {steps} | {fc['gate']} | {fc['sink_tokens']} | "
            f"{fc['inference_routing']} | {ppl['base']:.2f} | {ppl['focus_soft']:.2f} | "
            f"{p('1')} | {p('2')} | {p('4')} | {pct('1', pairs)} | {pct('2', pairs)} | "
            f"{pct('1', dom)} |"
        )
    tokens = sorted({r["tokens"] for _, r in evals})
    lines.append("")
    lines.append(f"Scored tokens per evaluation: {', '.join(map(str, tokens))}.")
    return "\n".join(lines)


def plot(evals: list[tuple[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, _ in evals]
    series = [("soft", lambda r: r["ppl"]["focus_soft"])]
    series += [
        (f"top-{k}", lambda r, k=k: r["ppl"]["focus_topk"].get(k, float("nan")))
        for k in ("1", "2", "4")
    ]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names)), 4))
    width = 0.8 / len(series)
    base = evals[0][1]["ppl"]["base"]
    top = base * 1.15  # the sink-less runs are far above: clip them and print their values
    for i, (label, get) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ys = [get(r) for _, r in evals]
        ax.bar(xs, [min(y, top) for y in ys], width, label=label)
        for x, y in zip(xs, ys, strict=True):
            if y > top:
                ax.text(x, top, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(base, color="black", linestyle="--", linewidth=1, label=f"dense base {base:.2f}")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("perplexity (clipped bars labelled)")
    ax.set_ylim(base * 0.95, top * 1.04)
    ax.legend(fontsize=8, ncol=3)
    ax.set_title(f"smollm2-135m + Focus on Persuasion ({evals[0][1]['tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _collect(runs: str) -> list[tuple[str, dict]]:
    files = sorted(glob.glob(os.path.join(runs, "*", "eval-*.json")))
    if not files:
        raise SystemExit(
            f"no {runs}/*/eval-*.json found: run focus sweep --study experiments/quality first"
        )
    return [_row(f, runs) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="?", default="runs/honest/cells")
    ap.add_argument("--json", help="also write the collected evaluations here")
    ap.add_argument("--plot", help="also write a bar chart (PNG) here")
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--collected", help="read the evaluations from this --json file")
    args = ap.parse_args()
    if args.collected:
        with open(args.collected) as fh:  # the runner's "experiment" record is not an evaluation
            evals = [(k, r) for k, r in json.load(fh).items() if k != "experiment"]
    else:
        evals = _collect(args.runs)
    print(table(evals))
    if args.markdown:
        from focus_attention.utils.io import atomic_write_text

        atomic_write_text(args.markdown, table(evals) + "\n")
    if args.json:
        from focus_attention.utils.io import write_json_atomic

        write_json_atomic(args.json, {name: r for name, r in evals})
    if args.plot:
        plot(evals, args.plot)


if __name__ == "__main__":
    main()
