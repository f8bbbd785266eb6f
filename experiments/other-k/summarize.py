"""One markdown table of long-context candidates: validation perplexity (``focus eval``
JSON) beside the pass keys found (``focus bench needle`` JSON), per adapter and top_k.

    python experiments/other-k/summarize.py LABEL=EVAL.json[,NEEDLE.json] ... [--out FILE.md]

Each row is one Focus mode of one adapter: perplexity and its change against the same file's
dense row, the causal pairs kept, and the needles found out of those asked (modes named as
``focus bench needle`` names them: ``top-1``, ``top-1/q2``). A needle file may hold fewer
modes than the eval file; the missing cells read "-".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _needles(path: str | None) -> dict[str, tuple[int, int]]:
    """``{mode: (found, asked)}`` over every cell of a needle JSON."""
    if not path:
        return {}
    out: dict[str, list[int]] = {}
    for cell in json.loads(Path(path).read_text())["cells"]:
        found = out.setdefault(cell["mode"], [0, 0])
        found[0] += bool(cell["correct"])
        found[1] += 1
    return {mode: (a, b) for mode, (a, b) in out.items()}


def _mode(top_k: str, query_top_k: int | None) -> str:
    return f"top-{top_k}" if query_top_k in (None, int(top_k)) else f"top-{top_k}/q{query_top_k}"


def rows(label: str, eval_path: str, needle_path: str | None) -> list[str]:
    """Markdown rows of one adapter: dense first, then each top_k of the eval file."""
    doc = json.loads(Path(eval_path).read_text())
    needles = _needles(needle_path)
    base = doc["ppl"]["base"]
    query_top_k = doc["config"]["overrides"].get("query_top_k")
    k = doc["config"]["focus"]["num_groups"]

    def found(mode: str) -> str:
        return "{} of {}".format(*needles[mode]) if mode in needles else "-"

    out = [f"| {label} | K={k} | dense | {base:.3f} | - | 100% | {found('dense')} |"]
    for top_k, ppl in doc["ppl"]["focus_topk"].items():
        mode = _mode(top_k, query_top_k)
        pairs = doc["pairs_retained"][top_k]
        change = 100 * (ppl / base - 1)
        out.append(f"| {label} | K={k} | {mode} | {ppl:.3f} | {change:+.2f}% | {100 * pairs:.1f}% | {found(mode)} |")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=EVAL.json[,NEEDLE.json]")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    lines = ["| adapter | groups | routing | PPL | change | pairs kept | pass keys found |",
             "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for run in args.runs:
        label, sep, files = run.partition("=")
        if not sep:
            parser.error(f"{run!r}: expected LABEL=EVAL.json[,NEEDLE.json]")
        eval_path, _, needle_path = files.partition(",")
        lines += rows(label, eval_path, needle_path or None)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
