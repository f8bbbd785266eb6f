"""From scratch: the same small LLaMA-style model trained with Focus and with dense attention
on the same tokens, validation perplexity at every checkpoint (docs/method.md §6).

usage: python benchmarks/pretrain.py [--config configs/pretrain/linux-docs-small.toml] \\
           [--seeds 0,1] [--runs runs/pretrain-bench] [--results benchmarks/results/pretrain]

For every seed, ``focus pretrain --attention dense`` and ``--attention focus`` run one after
the other in fresh processes with the settings file, that seed, and one tokenizer (trained by
the first run on the training split, then passed to the others with ``--tokenizer``). A run
whose ``pretrain_result.json`` exists is reused; one with checkpoints but no result resumes.
The script checks that both attention types of a seed started from the same weights and saw
the same training blocks in the same order (the SHA-256 digests of ``focus pretrain``), then
writes ``pretrain.json`` (every run's result and the comparison), ``pretrain.md`` (the table)
and ``pretrain.png`` (the validation curves) into ``--results``. The paper's claim checked:
Focus at or below dense attention at every checkpoint, with soft routing (the training-time
model) and with top-k routing (what inference uses). Throughput is wall-clock: compare the
two attention types only within one machine and one run of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from focus_attention.utils.env import environment, library_versions
from focus_attention.utils.io import atomic_write, atomic_write_text, write_json_atomic

ATTENTIONS = ("dense", "focus")
#: digests that must be equal for the two attention types of a seed
SAME_DATA = ("init_weights_sha256", "train_blocks_sha256", "validation_blocks_sha256",
             "batches_sha256", "tokens_trained")  # fmt: skip


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=Path("configs/pretrain/linux-docs-small.toml"))
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    p.add_argument("--runs", type=Path, default=Path("runs/pretrain-bench"), help="run folders")
    p.add_argument("--results", type=Path, default=Path("benchmarks/results/pretrain"))
    p.add_argument("--logs", type=Path, default=Path("/tmp"), help="one pretrain-*.log per run")
    return p.parse_args()


def _run(a: argparse.Namespace, attention: str, seed: int, tokenizer: Path | None) -> dict:
    out = a.runs / f"{attention}-s{seed}"
    result = out / "pretrain_result.json"
    if not result.is_file():
        cmd = [sys.executable, "-m", "focus_attention.cli", "pretrain", "--config", str(a.config),
               "--attention", attention, "--seed", str(seed), "--out", str(out)]  # fmt: skip
        if tokenizer is not None:
            cmd += ["--tokenizer", str(tokenizer)]
        if (out / "trainer").is_dir():
            cmd.append("--resume")
        log = a.logs / f"pretrain-{attention}-s{seed}.log"
        print(f"running {' '.join(cmd[1:])} > {log}", flush=True)
        with log.open("w") as fh:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"{attention} seed {seed} failed (exit {proc.returncode}); see {log}")
    return json.loads(result.read_text())


def _check_same_data(dense: dict, focus: dict, seed: int) -> None:
    for key in SAME_DATA:
        if dense["data"][key] != focus["data"][key]:
            raise SystemExit(f"seed {seed}: {key} differs between dense and focus")


def _compare(runs: dict[int, dict[str, dict]]) -> dict:
    """Per seed and checkpoint: dense PPL, Focus soft / top-k PPL and the claim."""
    rows, claim = [], {}
    for seed, pair in runs.items():
        dense = {r["step"]: r for r in pair["dense"]["validation"]}
        for r in pair["focus"]["validation"]:
            d = dense[r["step"]]["ppl"]
            tops = {k: v for k, v in r.items() if k.startswith("ppl_top")}
            rows.append({"seed": seed, "step": r["step"], "dense": d, "focus_soft": r["ppl"],
                         **{f"focus_{k[4:]}": v for k, v in tops.items()}})  # fmt: skip
    trained = [r for r in rows if r["step"] > 0]  # step 0: random weights
    for name in [k for k in rows[0] if k.startswith("focus_")]:
        claim[name] = {
            "at_or_below_dense_every_checkpoint": all(r[name] <= r["dense"] for r in trained),
            "checkpoints_at_or_below": sum(r[name] <= r["dense"] for r in trained),
            "checkpoints": len(trained),
            "mean_ratio_to_dense": statistics.fmean(r[name] / r["dense"] for r in trained),
        }
    return {"rows": rows, "claim": claim}


def _markdown(runs: dict[int, dict[str, dict]], comparison: dict) -> str:
    cols = [k for k in comparison["rows"][0] if k.startswith("focus_")]
    lines = ["| seed | step | tokens | dense | " + " | ".join(c.replace("_", " ") for c in cols)
             + " |", "|---:|---:|---:|---:|" + "---:|" * len(cols)]  # fmt: skip
    for r in comparison["rows"]:
        per_step = runs[r["seed"]]["dense"]["data"]["tokens_per_step"]
        vals = " | ".join(f"{r[c]:.2f}" for c in cols)
        lines.append(
            f"| {r['seed']} | {r['step']} | {r['step'] * per_step:,} | {r['dense']:.2f} | {vals} |"
        )
    lines += ["", "| claim (trained checkpoints) | at or below dense | mean PPL ratio to dense |",
              "|---|---:|---:|"]  # fmt: skip
    for name, c in comparison["claim"].items():
        lines.append(f"| {name.replace('_', ' ')} | {c['checkpoints_at_or_below']} of "
                     f"{c['checkpoints']} | {c['mean_ratio_to_dense']:.3f} |")  # fmt: skip
    lines += ["", "| seed | attention | tokens/s (training steps) | step seconds | final PPL |",
              "|---:|---|---:|---:|---:|"]  # fmt: skip
    for seed, pair in runs.items():
        for att in ATTENTIONS:
            t = pair[att]["throughput"]
            lines.append(f"| {seed} | {att} | {t['tokens_per_second']:.0f} | "
                         f"{t['step_seconds'] / t['steps_timed']:.2f} | "
                         f"{pair[att]['validation'][-1]['ppl']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _plot(runs: dict[int, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (seed, pair) in enumerate(runs.items()):
        color = f"C{i}"
        per_step = pair["dense"]["data"]["tokens_per_step"]
        for att, key, style in (("dense", "ppl", "-"), ("focus", "ppl", "--"),
                                ("focus", "ppl_top2", ":"), ("focus", "ppl_top1", "-.")):  # fmt: skip
            rows = [r for r in pair[att]["validation"] if r["step"] > 0 and key in r]
            label = f"seed {seed} {att}" + ("" if att == "dense" else f" {key[4:] or 'soft'}")
            ax.plot([r["step"] * per_step / 1e3 for r in rows], [r[key] for r in rows],
                    style, color=color, marker="o", ms=3, label=label)  # fmt: skip
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("From scratch: Focus vs dense attention (linux-docs validation)")
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)


def main() -> None:
    a = _args()
    a.runs.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    runs: dict[int, dict[str, dict]] = {}
    tokenizer = None
    for seed in seeds:
        runs[seed] = {}
        for attention in ATTENTIONS:
            runs[seed][attention] = _run(a, attention, seed, tokenizer)
            tokenizer = tokenizer or a.runs / f"{attention}-s{seed}" / "tokenizer"
        _check_same_data(runs[seed]["dense"], runs[seed]["focus"], seed)
    comparison = _compare(runs)
    a.results.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.results / "pretrain.json", {
        "command": " ".join(sys.argv), "config_file": str(a.config), "seeds": seeds,
        "same_data_checked": list(SAME_DATA), "comparison": comparison,
        "runs": {str(s): p for s, p in runs.items()},
        "versions": library_versions(), "environment": environment(),
    })  # fmt: skip
    atomic_write_text(a.results / "pretrain.md", _markdown(runs, comparison))
    _plot(runs, a.results / "pretrain.png")
    print(_markdown(runs, comparison))


if __name__ == "__main__":
    main()
