"""The README's table: needles found and distant keys kept per mode and length, from the
``focus bench needle`` results of this study.

usage: python experiments/routing-diagnostic/summarize.py [RESULT.json ...]

Default: every ``results/diagnostic-*.json``. A mode is labelled with the adapter folder it
ran on when the files disagree (``top-1`` of a folder whose routers were not trained is not
the adapter's top-1). Cells not yet answered (an interrupted run) are left out; the counts
say how many prompts each row holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(paths: list[Path]) -> dict[tuple[str, str, int], list[dict]]:
    """``{(mode, adapter, length): [cells]}`` of every file."""
    out: dict[tuple[str, str, int], list[dict]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        adapter = result["config"]["adapter"]
        for cell in result["cells"]:
            out.setdefault((cell["mode"], adapter, cell["length"]), []).append(cell)
    return out


def table(paths: list[Path]) -> str:
    """Markdown: a row per (mode, adapter, length): found / prompts, the depths missed and
    the mean share of distant keys kept."""
    lines = ["| mode | adapter | tokens | pass keys found | missed at depth | distant keys kept |",
             "|---|---|---:|---:|---|---:|"]  # fmt: skip
    for (mode, adapter, length), cells in sorted(rows(paths).items(), key=lambda kv: kv[0][2]):
        found = sum(c["correct"] for c in cells)
        missed = ", ".join(f"{c['depth']:g}" for c in cells if not c["correct"]) or "-"
        kept = [c["distant_kept"] for c in cells if c.get("distant_kept") is not None]
        share = f"{sum(kept) / len(kept):.3f}" if kept else "-"
        lines.append(f"| {mode} | `{Path(adapter).name}` | {length} | {found} / {len(cells)} "
                     f"| {missed} | {share} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    given = [Path(p) for p in sys.argv[1:]]
    print(table(given or sorted((HERE / "results").glob("diagnostic-*.json"))))
