"""From scratch: the same small LLaMA-style model trained with Focus and with dense attention
on the same tokens, validation perplexity at every checkpoint (docs/method.md §6).

usage: python experiments/pretrain/pretrain.py [--config configs/pretrain/linux-docs-small.toml] \\
           [--seeds 0,1] [--runs runs/pretrain-bench] [--results experiments/pretrain/results]

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
    p.add_argument("--results", type=Path, default=Path("experiments/pretrain/results"))
    p.add_argument("--logs", type=Path, default=Path("/tmp"), help="one pretrain-*.log per run")
    p.add_argument("--paired-steps", type=int, default=6,
                   help="steps of the paired throughput measurement per attention type (0: keep "
                        "the one in --results/pretrain.json, if any)")  # fmt: skip
    return p.parse_args()


def _read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def _paired_throughput(a: argparse.Namespace, tokenizer: Path) -> dict:
    """Seconds per training step of both attention types measured in one process, steps
    alternating (dense, focus, dense, ...) on the same batches, so that both see the same
    machine load; the first step of each is warm-up and not counted."""
    import time

    import torch
    from transformers import AutoTokenizer

    from focus_attention.hf import get_focus_model
    from focus_attention.training.pretrain import ROUTERS_MODULE, PretrainConfig
    from focus_attention.training.scratch_model import build_llama

    settings = dict(_read_toml(a.config)["pretrain"])
    focus_settings = settings.pop("focus", {})
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer)))
    models, optims = {}, {}
    for att in ATTENTIONS:
        cfg = PretrainConfig.from_dict({**settings, "attention": att, "focus": focus_settings})
        torch.set_num_threads(cfg.threads or 1)
        models[att] = build_llama(cfg.model_size(), vocab, cfg.seq_len, cfg.seed)
        if att == "focus":  # as focus pretrain builds it: every weight and the routers train
            focus = get_focus_model(models[att], cfg.focus)
            models[att].requires_grad_(True)
            models[att].add_module(ROUTERS_MODULE, focus.routers)
            focus.train()
        optims[att] = torch.optim.AdamW(models[att].parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {att: [] for att in ATTENTIONS}
    for _ in range(a.paired_steps + 1):
        x = torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len), generator=gen)
        for att in ATTENTIONS:
            start = time.perf_counter()
            models[att](input_ids=x, labels=x).loss.backward()
            optims[att].step()
            optims[att].zero_grad()
            seconds[att].append(time.perf_counter() - start)
    tokens = cfg.batch_size * cfg.seq_len
    out = {"steps": a.paired_steps, "tokens_per_step": tokens, "threads": torch.get_num_threads()}
    for att in ATTENTIONS:
        med = statistics.median(seconds[att][1:])
        out[att] = {"median_step_seconds": med, "tokens_per_second": tokens / med,
                    "step_seconds": seconds[att]}  # fmt: skip
    out["focus_over_dense_step_time"] = (
        out["focus"]["median_step_seconds"] / out["dense"]["median_step_seconds"]
    )
    return out


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
    paired = comparison.get("paired_throughput")
    if paired:
        lines += ["", f"Paired throughput ({paired['steps']} alternating steps each, one process, "
                  f"{paired['threads']} thread): dense {paired['dense']['tokens_per_second']:.0f} "
                  f"tokens/s, focus {paired['focus']['tokens_per_second']:.0f} tokens/s (focus "
                  f"step time {paired['focus_over_dense_step_time']:.2f}x dense)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _plot(runs: dict[int, dict[str, dict]], path: Path) -> None:
    """Left: validation perplexity against training tokens; right: Focus / dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ratio) = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = (("dense", "ppl", "-"), ("focus", "ppl", "--"), ("focus", "ppl_top2", ":"),
              ("focus", "ppl_top1", "-."))  # fmt: skip
    for i, (seed, pair) in enumerate(runs.items()):
        per_step = pair["dense"]["data"]["tokens_per_step"]
        dense = {r["step"]: r["ppl"] for r in pair["dense"]["validation"]}
        for att, key, style in styles:
            rows = [r for r in pair[att]["validation"] if r["step"] > 0 and key in r]
            label = f"seed {seed} {att}" + ("" if att == "dense" else f" {key[4:] or 'soft'}")
            x = [r["step"] * per_step / 1e3 for r in rows]
            kw = {"color": f"C{i}", "marker": "o", "ms": 3, "label": label}
            ax.plot(x, [r[key] for r in rows], style, **kw)
            if att == "focus":
                ratio.plot(x, [r[key] / dense[r["step"]] for r in rows], style, **kw)
    ratio.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("validation perplexity")
    ratio.set_ylabel("Focus PPL / dense PPL (below 1: Focus better)")
    for a_ in (ax, ratio):
        a_.set_xlabel("training tokens (thousands)")
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7)
    fig.suptitle(
        "From scratch: Focus vs dense attention, same model, init and tokens (validation split)"
    )
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)


def _previous_paired(path: Path) -> dict | None:
    """The paired throughput of an earlier ``pretrain.json`` (``--paired-steps 0`` keeps
    it, marked with the date it was measured), or None."""
    if not path.is_file():
        return None
    old = json.loads(path.read_text())
    paired = old.get("comparison", {}).get("paired_throughput")
    if paired is not None:
        paired = {**paired, "measured": paired.get("measured", old["environment"].get("date"))}
    return paired


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
    if a.paired_steps > 0:
        comparison["paired_throughput"] = _paired_throughput(a, tokenizer)
    elif (previous := _previous_paired(a.results / "pretrain.json")) is not None:
        comparison["paired_throughput"] = previous  # kept from the run that measured it
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
