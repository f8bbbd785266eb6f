"""Collect the retention runs (the steps of ``experiments/retention/config.toml``) into one table and one plot.

usage: python experiments/retention/summarize.py [--results DIR] [--runs DIR] [--collected FILE]

Reads, per method NAME of :data:`METHODS`, ``RESULTS/NAME-eval.json`` (``focus eval`` on
*Persuasion*), ``RESULTS/NAME-tasks.json`` and ``RESULTS/NAME-lambada.json`` (``focus bench
tasks``), ``RESULTS/NAME-instructions.json`` (``focus bench instructions``) and
``RUNS/NAME/train_result.json`` (trainable parameters), and the untouched model's tasks
(``untouched-*.json``). Missing files leave their cells empty. Writes ``retention.json``,
``retention.md`` and ``retention.png`` into ``RESULTS``. With ``--collected FILE`` the record
is read back from such a ``retention.json`` and only the table and plot are written, so that
they are rebuilt from the study's results alone.

Every difference is paired: the mean over the same examples (benchmarks) or prompts
(instructions) of the method's score minus the untouched model's, with a 95% confidence
interval of +-1.96 standard errors of that mean. The domain perplexity of a method is that
of the model as deployed: hard top-2 routing where the run has Focus routers, dense
attention otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

#: (result name, row title) in table order
METHODS = (
    ("untouched", "untouched"),
    ("focus", "Focus (routers only)"),
    ("lora-match", "LoRA r=5 q,v (matched count)"),
    ("lora-r8", "LoRA r=8 q,k,v,o"),
    ("attention", "attention fine-tuning"),
    ("full", "full fine-tuning"),
    ("focus+lora", "Focus + LoRA r=8"),
    ("two-phase", "two-phase (routers, then full)"),
)
#: (task, metric) of the benchmark columns: lm-eval's headline metric of each task
BENCHMARKS = (
    ("hellaswag", "acc_norm"),
    ("arc_easy", "acc_norm"),
    ("arc_challenge", "acc_norm"),
    ("piqa", "acc_norm"),
    ("winogrande", "acc"),
    ("lambada_openai", "acc"),
)
Z95 = 1.96
TOP_K = "2"


def _load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _paired(ref: dict, other: dict, key: str) -> dict | None:
    """Mean and standard error of the per-example differences ``other - ref``."""
    a = dict(zip(ref["per_example"]["doc_id"], ref["per_example"][key], strict=True))
    b = dict(zip(other["per_example"]["doc_id"], other["per_example"][key], strict=True))
    common = sorted(set(a) & set(b))
    if len(common) < 2:
        return None
    d = [b[i] - a[i] for i in common]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    return {"mean": mean, "stderr": se, "examples": len(common)}


def _task_entry(results: str, name: str, task: str) -> dict | None:
    for stem in ("tasks", "lambada"):
        r = _load(os.path.join(results, f"{name}-{stem}.json"))
        if r is not None and task in r["tasks"]:
            return r["tasks"][task]
    return None


def _domain(results: str, name: str) -> dict | None:
    """Perplexity of the untouched model and of the deployed tuned model on Persuasion."""
    r = _load(os.path.join(results, f"{name}-eval.json"))
    if r is None:
        return None
    ppl = r["ppl"]
    if "focus_topk" in ppl:
        deployed, mode = ppl["focus_topk"][TOP_K], f"focus top-{TOP_K}"
    else:
        deployed, mode = ppl.get("tuned", ppl["base"]), "dense"
    pairs = r.get("pairs_retained", {}).get(TOP_K) if "focus_topk" in ppl else None
    return {"untouched": ppl["base"], "ppl": deployed, "mode": mode,
            "relative": deployed / ppl["base"] - 1, "pairs_retained": pairs,
            "tokens": r["tokens"]}  # fmt: skip


def _instructions(results: str, name: str) -> dict | None:
    r = _load(os.path.join(results, f"{name}-instructions.json"))
    if r is None or not r["models"]:
        return None
    m = r["models"][0]
    return {"model": m["name"], "prompts": len(r["prompts"]),
            "untouched": r["reference"]["accuracy"], "accuracy": m["accuracy"],
            "difference": m["difference"], "kl_per_token": m["kl"]["mean_per_token"],
            "kl_tokens": m["kl"]["tokens"]}  # fmt: skip


def _untouched(results: str) -> tuple[dict | None, dict | None]:
    """The untouched model's domain perplexity and instruction scores, from the first
    method's files (every run measures the same untouched model; checked equal)."""
    domains = [d for name, _ in METHODS[1:] if (d := _domain(results, name))]
    instructions = [i for name, _ in METHODS[1:] if (i := _instructions(results, name))]
    domain = None
    if domains:
        ppl = domains[0]["untouched"]
        assert all(abs(d["untouched"] - ppl) < 1e-9 for d in domains), (
            "untouched perplexities differ"
        )
        domain = {"untouched": ppl, "ppl": ppl, "mode": "dense", "relative": 0.0,
                  "pairs_retained": None, "tokens": domains[0]["tokens"]}  # fmt: skip
    ins = None
    if instructions:
        ref = instructions[0]["untouched"]
        assert all(i["untouched"] == ref for i in instructions), (
            "untouched instruction scores differ"
        )
        ins = {"model": "untouched", "prompts": instructions[0]["prompts"], "untouched": ref,
               "accuracy": ref, "difference": None, "kl_per_token": None, "kl_tokens": None}  # fmt: skip
    return domain, ins


def collect(results: str, runs: str) -> dict:
    """The retention record: per method, its parameters, domain, benchmarks, instructions."""
    rows = []
    for name, title in METHODS:
        tr = _load(os.path.join(runs, name, "train_result.json"))
        row = {"name": name, "title": title,
               "trainable_parameters": tr.get("trainable_parameters") if tr else (0 if name == "untouched" else None),
               "domain": _domain(results, name), "instructions": _instructions(results, name),
               "benchmarks": {}}  # fmt: skip
        if name == "untouched":
            row["domain"], row["instructions"] = _untouched(results)
        for task, metric in BENCHMARKS:
            ref, got = _task_entry(results, "untouched", task), _task_entry(results, name, task)
            if got is None:
                continue
            cell = {"metric": metric, "value": got["metrics"][metric],
                    "stderr": got["metrics"].get(f"{metric}_stderr"), "examples": got["examples"],
                    "routed_share": got["tokens"].get("routed_share")}  # fmt: skip
            if ref is not None and name != "untouched":
                cell["difference"] = _paired(ref, got, metric)
            row["benchmarks"][task] = cell
        diffs = [c["difference"] for c in row["benchmarks"].values() if c.get("difference")]
        if len(diffs) == len(BENCHMARKS):
            row["mean_benchmark_difference"] = {
                "mean": sum(d["mean"] for d in diffs) / len(diffs),
                "stderr": math.sqrt(sum(d["stderr"] ** 2 for d in diffs)) / len(diffs),
            }
        rows.append(row)
    return {"methods": rows, "top_k": int(TOP_K), "confidence": 0.95}


def _pp(d: dict | None) -> str:
    """A paired difference in percentage points with its 95% interval."""
    if not d:
        return "-"
    return f"{100 * d['mean']:+.1f} ± {100 * Z95 * d['stderr']:.1f}"


def _summary_line(row: dict) -> str:
    dom, ins = row["domain"], row["instructions"]
    n = row["trainable_parameters"]
    cells = [row["title"], "-" if n is None else f"{n:,d}"]
    cells.append("-" if dom is None else f"{dom['ppl']:.2f} ({100 * dom['relative']:+.1f}%)")
    cells.append(_pp(row.get("mean_benchmark_difference")))
    cells.append(_pp(row["benchmarks"].get("lambada_openai", {}).get("difference")))
    if ins is None:
        cells += ["-", "-"]
    elif ins["difference"] is None:  # the untouched model
        acc = ins["accuracy"]
        cells += [f"{100 * acc['instruction_loose']:.1f} ± {100 * acc['instruction_loose_stderr']:.1f}", "-"]  # fmt: skip
    else:
        acc = ins["accuracy"]["instruction_loose"]
        diff = {"mean": ins["difference"]["instruction_loose"],
                "stderr": ins["difference"]["instruction_loose_stderr"]}  # fmt: skip
        cells += [f"{100 * acc:.1f} ({_pp(diff)})", f"{ins['kl_per_token']:.3f}"]
    return "| " + " | ".join(cells) + " |"


def markdown(record: dict) -> str:
    head = (
        "| method | trainable parameters | Persuasion PPL (vs untouched) | benchmarks, mean Δ pp "
        "(95% CI) | LAMBADA acc Δ pp | instructions loose % (Δ pp) | KL/token (nats) |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [_summary_line(r) for r in record["methods"]]
    lines += ["", "| method | " + " | ".join(f"{t} {m}" for t, m in BENCHMARKS) + " |",
              "|---|" + "---:|" * len(BENCHMARKS)]  # fmt: skip
    for r in record["methods"]:
        cells = []
        for task, _ in BENCHMARKS:
            c = r["benchmarks"].get(task)
            if c is None:
                cells.append("-")
                continue
            shown = f"{100 * c['value']:.1f}"
            cells.append(f"{shown} ({_pp(c['difference'])})" if c.get("difference") else
                         f"{shown} ± {100 * (c['stderr'] or 0):.1f}")  # fmt: skip
        lines.append(f"| {r['title']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(record: dict, path: str) -> None:
    """Domain gain (x: Persuasion perplexity change) against what was lost (y: mean
    benchmark and instruction-accuracy differences), one point per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharex=True)
    palette = plt.get_cmap("tab10")
    colors = {name: palette(i) for i, (name, _) in enumerate(METHODS)}
    panels = (("mean_benchmark_difference", "zero-shot benchmarks: mean Δ accuracy (pp)"),
              ("instructions", "instruction following: Δ loose accuracy (pp)"))  # fmt: skip
    for ax, (key, label) in zip(axes, panels, strict=True):
        for r in record["methods"]:
            if r["domain"] is None or r["name"] == "untouched":
                continue
            if key == "instructions":
                ins = r["instructions"]
                d = None if ins is None else {"mean": ins["difference"]["instruction_loose"],
                                               "stderr": ins["difference"]["instruction_loose_stderr"]}  # fmt: skip
            else:
                d = r.get(key)
            if d is None:
                continue
            x = 100 * r["domain"]["relative"]
            ax.errorbar(x, 100 * d["mean"], yerr=100 * Z95 * d["stderr"], fmt="o", capsize=3,
                        color=colors[r["name"]], label=r["title"])  # fmt: skip
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_xlabel("Persuasion perplexity vs untouched (%; left = domain gain)")
        ax.set_ylabel(label)
    fig.suptitle(
        "Retention at the same data and budget (smollm2-135m, 80 steps x 512 tokens; 95% CI)"
    )
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    os.replace(tmp, path)


def _write(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="experiments/retention/results")
    parser.add_argument("--runs", default="runs/retention")
    parser.add_argument("--collected", help="read the record from this retention.json")
    args = parser.parse_args()
    base = args.results
    if args.collected:
        with open(args.collected) as fh:
            record = json.load(fh)
        record.pop("experiment", None)  # the runner's record of the step, not a method
    else:
        record = collect(args.results, args.runs)
        _write(os.path.join(base, "retention.json"), json.dumps(record, indent=2) + "\n")
    text = markdown(record)
    _write(os.path.join(base, "retention.md"), text)
    plot(record, os.path.join(base, "retention.png"))
    print(text)


if __name__ == "__main__":
    main()
