"""Seconds per step and peak memory of ``focus train`` at long blocks, per objective.

usage: python experiments/long-input-recipe/train_cost.py [--seq-lens 1024,2048,4096] [--steps 3] \\
           [--json experiments/long-input-recipe/results/train_cost.json]

Each setting runs ``focus train`` in a fresh process (so the peak resident memory is that
run's) for ``--steps`` steps without validation or intermediate checkpoints, and reports the
median seconds of the steps after the first (warm-up) and the process's peak memory, from
the run's ``train_result.json`` and ``log.jsonl``. Settings: the soft ``lm`` objective with
the whole attention at once and with ``--soft-chunk-size`` query chunks recomputed in the
backward pass, ``distill`` with chunks, and ``coverage`` (no soft attention at all). A run
that fails (out of memory, for instance) is recorded with its error instead of numbers.
Run it on a quiet machine: timings are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from focus_attention.utils.env import environment, library_versions
from focus_attention.utils.io import atomic_write_text, write_json_atomic

SETTINGS = {
    "lm": ["--objective", "lm"],
    "lm chunked": ["--objective", "lm", "--soft-chunk-size", "256"],
    "distill chunked": ["--objective", "distill", "--soft-chunk-size", "256"],
    "coverage": ["--objective", "coverage"],
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="1024,2048,4096", help="block lengths in tokens")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which settings to run")
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-unchunked", type=int, default=2048,
                   help="longest block run without --soft-chunk-size (longer: skipped; the "
                   "saved soft attention of smollm2-135m is 18 GiB per tensor at 4,096 tokens)")  # fmt: skip
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run before giving up")
    p.add_argument(
        "--json", type=Path, default=Path("experiments/long-input-recipe/results/train_cost.json")
    )
    return p.parse_args()


def _run(name: str, seq_len: int, a: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{name.replace(' ', '-')}-{seq_len}"
    cmd = [sys.executable, "-m", "focus_attention.cli", "train", "--seq-len", str(seq_len),
           "--steps", str(a.steps), "--eval-every", "-1", "--save-every", "0",
           "--threads", str(a.threads), "--out", str(out), "--no-progress", *SETTINGS[name]]  # fmt: skip
    row = {"setting": name, "seq_len": seq_len, "args": SETTINGS[name]}
    if name == "lm" and seq_len > a.max_unchunked:
        return row | {"error": f"skipped (over --max-unchunked {a.max_unchunked} tokens)"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return row | {"error": f"timeout after {a.timeout} s"}
    if proc.returncode != 0:
        return row | {"error": proc.stderr.strip().splitlines()[-1:] or [f"rc {proc.returncode}"]}
    result = json.loads((out / "train_result.json").read_text())
    secs = [r["seconds"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]
    steps = [b - a for a, b in zip(secs, secs[1:], strict=False)] or secs
    return row | {
        "seconds_per_step": statistics.median(steps),
        "first_step_seconds": secs[0],
        "peak_memory_gib": result["extra"]["peak_memory_bytes"] / 2**30,
    }


def _markdown(rows: list[dict]) -> str:
    lines = [
        "| setting | tokens per block | s / step | peak memory (GiB) |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | {r['seq_len']} | failed: {r['error']} | - |")
        else:
            lines.append(f"| {r['setting']} | {r['seq_len']} | {r['seconds_per_step']:.1f} | "
                         f"{r['peak_memory_gib']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    a = _args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in (int(s) for s in a.seq_lens.split(",")):
            for name in a.settings.split(","):
                rows.append(_run(name, seq_len, a, Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    doc = {"rows": rows, "config": vars(a) | {"json": str(a.json)},
           "versions": library_versions(), "environment": environment()}  # fmt: skip
    write_json_atomic(a.json, doc)
    atomic_write_text(a.json.with_suffix(".md"), _markdown(rows))
    print(_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
