"""Collect the honest-results evaluations (``benchmarks/honest.sh``) into one table.

usage: python benchmarks/summarize_honest.py [RUNS_DIR] [--json OUT.json]

Reads ``RUNS_DIR/*/eval-*.json`` (default ``runs/honest``) and prints a markdown table of
perplexities (token-weighted, the eval's window scheme) and pairs retained; with ``--json``
also writes the collected evaluations (configuration, versions and hardware included).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="?", default="runs/honest")
    ap.add_argument("--json", help="also write the collected evaluations here")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.runs, "*", "eval-*.json")))
    if not files:
        raise SystemExit(f"no {args.runs}/*/eval-*.json found: run benchmarks/honest.sh first")
    evals = [_row(f, args.runs) for f in files]
    print(table(evals))
    if args.json:
        from focus_attention.bench import write_json_atomic

        write_json_atomic(args.json, {name: r for name, r in evals})


if __name__ == "__main__":
    main()
