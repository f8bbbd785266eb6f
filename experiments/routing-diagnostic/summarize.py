"""The README's table: needles found and distant keys kept per mode and length, from the
``focus bench needle`` results of this study.

usage: python experiments/routing-diagnostic/summarize.py [RESULT.json ...]
       python experiments/routing-diagnostic/summarize.py --budget [RESULT.json ...]
       python experiments/routing-diagnostic/summarize.py --seen RESULT.json ...
       python experiments/routing-diagnostic/summarize.py --margins RESULT.json ...

Default: every ``results/diagnostic-*.json``; with ``--budget``, the smallest-budget table
of ``results/budget-seed*.json`` and the seed-2 dense and top-1 answers of the dense-heads study
(the same prompts: a needle benchmark's prompts depend on its seed, haystacks and lengths);
with ``--seen``, per mode and length of the files given, the pass keys found and how much of
the needle the prompt's last query sees in the routed layers (``needle_seen``); with
``--margins``, per mode and length of the files given (the same prompts, one of them with
dense), the pass keys found, those dense finds that the mode loses, the mean answer margin
(``answer_margin``, in logits) and dense's own margin on the prompts the mode loses and on
those it keeps. A mode is labelled with the adapter folder it
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


BUDGET_EXTRA = [
    HERE.parent / "dense-heads" / "results" / name
    for name in ("needle-attn-25-seed2.json", "needle-recipe-seed2.json")
]
#: the modes of the budget table; top-1 of a file other than this study's is kept (seed 2)
BUDGET_MODES = ("dense", "top-1", "top-2", "top-3")


def answers(paths: list[Path]) -> dict[tuple[int, int], dict[tuple, dict[str, bool]]]:
    """``{(seed, length): {(depth, trial, answer): {mode: correct}}}`` of the pass-key cells
    of every file (the first file that answers a (prompt, mode) wins: the dense-heads
    study's ``top-1`` of another adapter is dropped where it is not a budget mode)."""
    out: dict[tuple[int, int], dict[tuple, dict[str, bool]]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        seed = result["config"]["seed"]
        own = "attn-25" not in path.name  # that file's top-1 routes 25 dense heads: not ours
        for c in result["cells"]:
            if c["haystack"] != "passkey" or (c["mode"] != "dense" and not own):
                continue
            prompt = (c["depth"], c["trial"], c["answer"])
            modes = out.setdefault((seed, c["length"]), {}).setdefault(prompt, {})
            modes.setdefault(c["mode"], bool(c["correct"]))
    return out


def budget(paths: list[Path]) -> str:
    """Markdown: per seed and length, the pass keys each mode finds, and in brackets those
    dense finds that it misses."""
    lines = ["| seed | tokens | prompts | " + " | ".join(BUDGET_MODES) + " |",
             "|---:|---:|---:|" + "---:|" * len(BUDGET_MODES)]  # fmt: skip
    for (seed, length), prompts in sorted(answers(paths).items()):
        cells = []
        for mode in BUDGET_MODES:
            got = [m for m in prompts.values() if mode in m]
            if not got:
                cells.append("-")
                continue
            lost = sum(m.get("dense", False) and not m[mode] for m in got)
            found = sum(m[mode] for m in got)
            cells.append(f"{found} / {len(got)}" + (f" ({lost} lost)" if lost else ""))
        lines.append(f"| {seed} | {length} | {len(prompts)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seen(paths: list[Path]) -> str:
    """Markdown: per (mode, length), pass keys found, the mean share of distant keys kept,
    the mean share of the needle's tokens the last query sees (over routed layers and
    prompts) and the mean number of routed layers that see all of it."""
    lines = ["| mode | tokens | pass keys found | distant keys kept | needle tokens seen | "
             "layers seeing all of it |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (mode, _, length), cells in sorted(
        rows(paths).items(), key=lambda kv: (kv[0][2], kv[0][0])
    ):
        cells = [c for c in cells if c.get("needle_seen")]
        if not cells:
            continue
        layers = [list(c["needle_seen"].values()) for c in cells]
        share = sum(sum(v) / len(v) for v in layers) / len(layers)
        whole = sum(sum(x == 1.0 for x in v) for v in layers) / len(layers)
        kept = sum(c["distant_kept"] for c in cells) / len(cells)
        lines.append(f"| {mode} | {length} | {sum(c['correct'] for c in cells)} / {len(cells)} "
                     f"| {kept:.3f} | {share:.3f} | {whole:.1f} of {len(layers[0])} |")  # fmt: skip
    return "\n".join(lines)


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):+.2f}" if values else "-"


def margins(paths: list[Path]) -> str:
    """Markdown: per (mode, adapter, length), found / prompts, lost (of those dense finds),
    the mode's mean answer margin, and the mean dense margin of the prompts it loses and of
    those it keeps (prompts matched by length, depth, trial and needle)."""
    by_mode = rows(paths)
    dense = {(c["length"], c["depth"], c["trial"], c["answer"]): c
             for (mode, _, _), cells in by_mode.items() if mode == "dense" for c in cells}  # fmt: skip
    lines = ["| mode | adapter | tokens | distant keys kept | pass keys found | lost (dense finds) "
             "| margin | dense margin where lost | dense margin where kept |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def order(item):  # by length, then the most distant keys kept first (dense)
        (_, _, length), cells = item
        kept = [c["distant_kept"] for c in cells if c.get("distant_kept") is not None]
        return length, -(sum(kept) / len(kept) if kept else 0.0)

    for (mode, adapter, length), cells in sorted(by_mode.items(), key=order):
        kept_share = [c["distant_kept"] for c in cells if c.get("distant_kept") is not None]
        ref = [dense.get((c["length"], c["depth"], c["trial"], c["answer"])) for c in cells]
        lost = [d for c, d in zip(cells, ref, strict=True) if d and d["correct"] and not c["correct"]]  # fmt: skip
        kept = [d for c, d in zip(cells, ref, strict=True) if d and d["correct"] and c["correct"]]  # fmt: skip
        own = [c["answer_margin"] for c in cells if c.get("answer_margin") is not None]
        share = f"{sum(kept_share) / len(kept_share):.3f}" if kept_share else "-"
        lines.append(f"| {mode} | `{Path(adapter).name}` | {length} | {share} | "
                     f"{sum(c['correct'] for c in cells)} / {len(cells)} | {len(lost)} | {_mean(own)} | "
                     f"{_mean([d['answer_margin'] for d in lost])} | "
                     f"{_mean([d['answer_margin'] for d in kept])} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--seen"]:
        print(seen([Path(p) for p in args[1:]]))
    elif args[:1] == ["--margins"]:
        print(margins([Path(p) for p in args[1:]]))
    elif args[:1] == ["--budget"]:
        given = [Path(p) for p in args[1:]]
        print(
            budget(given or [*sorted((HERE / "results").glob("budget-seed*.json")), *BUDGET_EXTRA])
        )
    else:
        given = [Path(p) for p in args]
        print(table(given or sorted((HERE / "results").glob("diagnostic-*.json"))))
