"""Share of dense key-value heads against needles found at top_k = 1 (and against prefill
speed-up where it was measured), one point per dense setting.

usage: python experiments/dense-heads/pareto.py --kv-heads 3 \\
           --point LABEL NEEDLE.json ADAPTER_DIR [PREFILL.json] [--point ...] \\
           [--reference LABEL NEEDLE.json ADAPTER_DIR [PREFILL.json] ...] \\
           --out experiments/dense-heads/results/pareto

``NEEDLE.json``: a ``focus bench needle --json`` result (its ``top-1`` cells are counted, per
haystack, and its ``dense`` cells when it ran the dense model); ``ADAPTER_DIR``: the adapter
it ran (its ``focus_config.json`` gives the dense layers and heads: share = (dense layers x
kv heads + dense heads) / (Focus layers x kv heads)); ``PREFILL.json``: a ``focus bench
model --json`` result, whose top-1 row at its longest length gives the prefill speed-up
against stock sdpa. ``--reference`` points (the streaming reference: the heads that are not
dense see only their window and sinks) take the same values and are drawn hollow. Writes
``OUT.json`` (the points, references with ``"reference": true``) and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from focus_attention.utils.io import write_json_atomic


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--point", nargs="+", action="append", required=True,
                   metavar="LABEL NEEDLE ADAPTER [PREFILL]")  # fmt: skip
    p.add_argument("--reference", nargs="+", action="append", default=[],
                   metavar="LABEL NEEDLE ADAPTER [PREFILL]")  # fmt: skip
    p.add_argument("--kv-heads", type=int, required=True, help="key-value heads per layer")
    p.add_argument("--out", type=Path, required=True, help="path without suffix")
    return p.parse_args()


def _share(adapter: Path, kv: int) -> float:
    cfg = json.loads((adapter / "focus_config.json").read_text())
    dense = len(cfg.get("dense_layers") or []) * kv + len(cfg.get("dense_heads") or [])
    return dense / (len(cfg["layers"]) * kv)


def _found(needle: dict, mode: str) -> dict[str, int] | None:
    cells = [c for c in needle["cells"] if c["mode"] == mode]
    if not cells:
        return None
    out = {h: sum(c["correct"] for c in cells if c["haystack"] == h) for h in needle["config"]["haystacks"]}  # fmt: skip
    return {**out, "prompts_per_haystack": len(cells) // len(out)}


def _speedup(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("top_k") == 1]
    if not rows:
        return None
    row = max(rows, key=lambda r: r["N"])
    return {"N": row["N"], "speedup_vs_sdpa": row["speedup_vs_sdpa"]}


def _point(spec: list[str], kv: int, reference: bool = False) -> dict:
    if len(spec) not in (3, 4):
        raise SystemExit(f"--point {spec}: expected LABEL NEEDLE ADAPTER [PREFILL]")
    needle = json.loads(Path(spec[1]).read_text())
    return {"label": spec[0], "needle": spec[1], "adapter": spec[2],
            "dense_share": _share(Path(spec[2]), kv), "top1": _found(needle, "top-1"),
            "dense": _found(needle, "dense"),
            "prefill": _speedup(Path(spec[3]) if len(spec) == 4 else None),
            "reference": reference}  # fmt: skip


def _plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [p for p in points if p["prefill"]]
    fig, axes = plt.subplots(1, 2 if speed else 1, figsize=(11 if speed else 6, 5.2), squeeze=False)
    ax = axes[0][0]
    for p in points:
        x = 100 * p["dense_share"]
        for hay, marker in (("passkey", "o"), ("book", "s")):
            color = "C0" if hay == "passkey" else "C1"
            face = "none" if p["reference"] else color
            ax.scatter(x, p["top1"][hay], marker=marker, edgecolors=color, facecolors=face)
        ax.annotate(p["label"], (x, p["top1"]["passkey"]), fontsize=7, xytext=(3, -9),
                    textcoords="offset points")  # fmt: skip
    full = max(p["top1"]["prompts_per_haystack"] for p in points)
    ax.axhline(full, color="gray", ls="--", lw=0.8, label=f"dense ({full} of {full})")
    ax.scatter([], [], marker="o", color="C0", label="pass keys, top-1")
    ax.scatter([], [], marker="s", color="C1", label="book needles, top-1")
    if any(p["reference"] for p in points):
        ax.scatter([], [], marker="o", edgecolors="gray", facecolors="none",
                   label="hollow: streaming heads (window + sinks)")  # fmt: skip
    ax.set(xlabel="dense key-value heads (% of all)", ylabel="needles found (test book)",
           title="needles found at top_k = 1")  # fmt: skip
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    if speed:
        ax = axes[0][1]
        for p in speed:
            face = "none" if p["reference"] else "C2"
            ax.scatter(100 * p["dense_share"], p["prefill"]["speedup_vs_sdpa"], edgecolors="C2",
                       facecolors=face)  # fmt: skip
            ax.annotate(p["label"], (100 * p["dense_share"], p["prefill"]["speedup_vs_sdpa"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")  # fmt: skip
        ax.set(xlabel="dense key-value heads (% of all)", ylabel="prefill speed-up vs sdpa, top-1",
               title=f"prefill at {speed[0]['prefill']['N']:,} tokens")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> None:
    args = _args()
    points = [_point(spec, args.kv_heads) for spec in args.point]
    points += [_point(spec, args.kv_heads, reference=True) for spec in args.reference]
    write_json_atomic(args.out.with_suffix(".json"), {"points": points})
    _plot(points, args.out)
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
