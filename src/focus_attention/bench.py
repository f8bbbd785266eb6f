"""Benchmarks: ``focus bench kernel`` (attention op against dense SDPA).

Timings live here and in ``benchmarks/``, never in pass/fail tests. Every result file
records the configuration, library versions and hardware it was measured with.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .utils.io import atomic_write, write_json_atomic

KERNEL_LENGTHS = (1024, 4096, 16384, 32768)


def environment() -> dict[str, Any]:
    """Versions and hardware, for every result file (product decision)."""
    import torch

    from . import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            names = re.findall(r"model name\s*:\s*(.+)", fh.read())
        if names:
            cpu = names[0].strip()
    except OSError:
        pass
    return {
        "focus_attention": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": _git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _git_commit() -> str | None:
    """HEAD of the checkout the package runs from (``+dirty`` with uncommitted changes to
    tracked files), or None outside a git checkout."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            match = re.search(rf"{key}:\s+(\d+)", fh.read())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def peak_extra_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak resident memory (bytes) that one call of ``fn`` adds above the memory held
    before it, on Linux via ``/proc/self/clear_refs`` (resets the peak) and ``VmHWM``;
    ``None`` where that is unavailable. Measures the whole process, whose allocator may
    reuse memory freed earlier: call it in a fresh process (see :func:`kernel_peak_memory`).
    """
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    if before is None or peak is None:
        return None
    return max(0, peak - before) * 1024


def _kernel_inputs(n: int, top_k: int, cfg: dict[str, Any]):
    import torch

    gen = torch.Generator().manual_seed(cfg["seed"] + 7919 * n + top_k)
    q = torch.randn(1, cfg["num_heads"], n, cfg["head_dim"], generator=gen)
    k = torch.randn(1, cfg["num_key_value_heads"], n, cfg["head_dim"], generator=gen)
    v = torch.randn(1, cfg["num_key_value_heads"], n, cfg["head_dim"], generator=gen)
    groups = balanced_memberships(n, cfg["num_groups"], top_k, gen)
    return q, k, v, groups


def _kernel_call(method: str, q, k, v, groups, window: int, backend: str = "auto"):
    import torch

    from .ops import sparse_attention

    if method == "dense":
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
    return sparse_attention(q, k, v, groups, groups, window, backend=backend)


def _peak_child(method: str, n: int, top_k: int, cfg: dict[str, Any]) -> None:
    """Runs in a fresh process: warm the kernels on a small input, then measure one call."""
    import torch

    with torch.inference_mode():
        small = _kernel_inputs(256, top_k, cfg)
        _kernel_call(method, *small, cfg["window"], cfg.get("backend", "auto"))
        inputs = _kernel_inputs(n, top_k, cfg)
        peak = peak_extra_bytes(
            lambda: _kernel_call(method, *inputs, cfg["window"], cfg.get("backend", "auto"))
        )
    print(json.dumps({"peak_bytes": peak}))


def kernel_peak_memory(method: str, n: int, top_k: int, cfg: dict[str, Any]) -> int | None:
    """Peak extra resident bytes of one ``dense`` or ``sparse`` kernel call, measured in a
    fresh Python process (so no memory freed by earlier calls is reused)."""
    import subprocess

    code = (
        "import json, sys; from focus_attention.bench import _peak_child; "
        "_peak_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))"
    )
    env = dict(os.environ)
    import torch

    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    # a fixed mmap threshold returns every freed block >= 64 KiB to the OS, so resident
    # memory follows live tensors instead of glibc's cached arenas (same for both methods)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    out = subprocess.run(
        [sys.executable, "-c", code, method, str(n), str(top_k), json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, list]:
    """Median wall-clock seconds of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def balanced_memberships(n: int, num_groups: int, top_k: int, generator) -> Any:
    """Random memberships with exactly ``n * top_k / K`` tokens per group (up to rounding):
    token ``i`` joins groups ``(p_i + r) mod K`` for ``r`` in ``0..top_k-1``, where ``p`` is a
    random permutation of ``arange(n) mod K``. Returns bool ``[1, n, K]``."""
    import torch

    first = torch.arange(n) % num_groups
    first = first[torch.randperm(n, generator=generator)]
    groups = (first[:, None] + torch.arange(top_k)[None, :]) % num_groups
    out = torch.zeros(1, n, num_groups, dtype=torch.bool)
    out[0].scatter_(1, groups, True)
    return out


def run_kernel_benchmark(
    lengths=KERNEL_LENGTHS,
    top_ks=(1, 2),
    *,
    num_heads: int = 9,
    num_key_value_heads: int = 3,
    head_dim: int = 64,
    window: int = 128,
    num_groups: int = 8,
    repeats: int = 3,
    memory: bool = True,
    seed: int = 0,
    progress: bool = True,
    backend: str = "auto",
) -> dict[str, Any]:
    """Dense causal SDPA against :func:`focus_attention.sparse_attention`, same process.

    ``backend`` is passed to the op (``"auto"``: the fused CPU kernel where it can be built);
    the backend that ran is recorded in ``config["sparse_backend"]``.

    Returns a dict with ``config``, ``environment`` and ``rows`` (one per ``(N, top_k)``):
    seconds (median of ``repeats`` after one warm-up) of each, speedup, density (fraction
    of causal pairs kept), ideal speedup ``1 / density``, efficiency ``speedup / ideal`` and
    the peak extra resident bytes of one call of each.
    """
    import torch
    from tqdm.auto import tqdm

    from .ops import pairs_retained

    cfg = {
        "num_heads": num_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "window": window,
        "num_groups": num_groups,
        "seed": seed,
        "backend": backend,
    }
    rows = []
    combos = [(n, k) for n in lengths for k in top_ks]
    bar = tqdm(combos, desc="kernel", disable=not progress)
    for n, top_k in bar:
        bar.set_postfix(N=n, top_k=top_k)
        inputs = _kernel_inputs(n, top_k, cfg)
        groups = inputs[-1]
        with torch.inference_mode():
            dense_s, dense_all = median_seconds(
                functools.partial(_kernel_call, "dense", *inputs, window), repeats
            )
            sparse_s, sparse_all = median_seconds(
                functools.partial(_kernel_call, "sparse", *inputs, window, backend), repeats
            )
        dense_mem = kernel_peak_memory("dense", n, top_k, cfg) if memory else None
        sparse_mem = kernel_peak_memory("sparse", n, top_k, cfg) if memory else None
        density = pairs_retained(groups, groups, window)
        speedup = dense_s / sparse_s
        ideal = 1.0 / density
        rows.append(
            {
                "N": n,
                "top_k": top_k,
                "dense_s": dense_s,
                "sparse_s": sparse_s,
                "dense_runs_s": dense_all,
                "sparse_runs_s": sparse_all,
                "speedup": speedup,
                "density": density,
                "ideal_speedup": ideal,
                "efficiency": speedup / ideal,
                "dense_peak_bytes": dense_mem,
                "sparse_peak_bytes": sparse_mem,
            }
        )
    config = {
        "lengths": list(lengths),
        "top_ks": list(top_ks),
        "batch_size": 1,
        "num_heads": num_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "window": window,
        "num_groups": num_groups,
        "dtype": "float32",
        "repeats": repeats,
        "warmup": 1,
        "seed": seed,
        "memberships": "balanced random (bench.balanced_memberships)",
        "sparse_backend": _resolved_backend(backend),
        "dense": "torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True)",
        "memory": "peak extra resident bytes of one call in a fresh process (VmHWM after clear_refs; MALLOC_MMAP_THRESHOLD_=65536)",
    }
    return {"benchmark": "kernel", "config": config, "environment": environment(), "rows": rows}


def run_gate_benchmark(
    n: int = 1024,
    *,
    num_heads: int = 9,
    num_key_value_heads: int = 3,
    head_dim: int = 64,
    window: int = 128,
    num_groups: int = 8,
    repeats: int = 5,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Soft-gated attention (training path) against eager dense attention at length ``n``.

    Eager dense is what transformers' ``eager`` attention does: repeat the key/value heads,
    ``softmax(q k^T * scale + causal mask)`` in fp32, times ``v``. Forward and forward +
    backward, median seconds of ``repeats`` after a warm-up; ratio = gated / eager.
    """
    import torch

    from .ops import gated_attention, sinkhorn
    from .ops.reference import expand_kv_heads

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_heads, n, head_dim, generator=gen, requires_grad=True)
    k = torch.randn(1, num_key_value_heads, n, head_dim, generator=gen, requires_grad=True)
    v = torch.randn(1, num_key_value_heads, n, head_dim, generator=gen, requires_grad=True)
    scores = torch.randn(1, n, num_groups, generator=gen, requires_grad=True)
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    def eager():
        kk, vv = expand_kv_heads(k, num_heads), expand_kv_heads(v, num_heads)
        logits = (q @ kk.transpose(-1, -2)) * head_dim**-0.5
        logits = logits.masked_fill(~causal, float("-inf"))
        return torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype) @ vv

    def gated(gate):
        def call():
            probs = sinkhorn(scores, 10)
            return gated_attention(q, k, v, probs, probs, window, gate=gate)

        return call

    rows = []
    for name, fn in [
        ("eager_dense", eager),
        ("gate_paper", gated("paper")),
        ("gate_log", gated("log")),
    ]:
        with torch.no_grad():
            fwd, _ = median_seconds(fn, repeats)
        both, _ = median_seconds(lambda fn=fn: fn().sum().backward(), repeats)
        rows.append({"method": name, "N": n, "forward_s": fwd, "forward_backward_s": both})
    base = rows[0]
    for r in rows:
        r["forward_ratio"] = r["forward_s"] / base["forward_s"]
        r["forward_backward_ratio"] = r["forward_backward_s"] / base["forward_backward_s"]
    return rows


def kernel_table(result: dict[str, Any]) -> str:
    """Markdown table of a kernel benchmark result."""

    def mib(x):
        return "n/a" if x is None else f"{x / 2**20:.0f}"

    lines = [
        "| N | top_k | dense s | sparse s | speedup | density | ideal | efficiency "
        "| dense MiB | sparse MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['N']} | {r['top_k']} | {r['dense_s']:.3f} | {r['sparse_s']:.3f} "
            f"| {r['speedup']:.2f}x | {r['density']:.3f} | {r['ideal_speedup']:.2f}x "
            f"| {r['efficiency']:.2f} | {mib(r['dense_peak_bytes'])} "
            f"| {mib(r['sparse_peak_bytes'])} |"
        )
    return "\n".join(lines)


def plot_kernel(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG plot of measured and ideal speedup against N, one line pair per top_k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for top_k in sorted({r["top_k"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["top_k"] == top_k]
        ns = [r["N"] for r in rows]
        (line,) = ax.plot(ns, [r["speedup"] for r in rows], "o-", label=f"top_k={top_k} measured")
        ax.plot(
            ns,
            [r["ideal_speedup"] for r in rows],
            "--",
            color=line.get_color(),
            label=f"top_k={top_k} ideal (1/density)",
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("speedup over dense causal SDPA")
    cfg = result["config"]
    ax.set_title(
        f"Focus sparse attention, K={cfg['num_groups']}, window={cfg['window']}, "
        f"H={cfg['num_heads']}/{cfg['num_key_value_heads']}, D={cfg['head_dim']}, fp32",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    finally:
        plt.close(fig)


MODEL_LENGTHS = (4096, 16384)


def run_model_benchmark(
    model_name: str = "smollm2-135m",
    lengths=MODEL_LENGTHS,
    top_ks=(1, 2),
    *,
    num_groups: int = 8,
    window: int = 128,
    adapter: str | None = None,
    corpus: str = "austen",
    repeats: int = 1,
    warmup_tokens: int = 512,
    progress: bool = True,
) -> dict[str, Any]:
    """End-to-end prefill of a real model: stock ``sdpa`` attention against Focus top-k.

    Input: the first N tokens of the corpus's test split (real text). Each forward runs
    under ``torch.inference_mode()`` with ``use_cache=False`` and ``logits_to_keep=1`` (so
    the vocabulary projection does not dominate). Focus uses the adapter at ``adapter`` if
    given, else freshly initialised routers (speed does not depend on training, only on
    the group sizes). Seconds are the median of ``repeats`` runs after one warm-up forward
    of ``warmup_tokens`` tokens. Returns rows of tokens per second and speedup.
    """
    import torch
    from tqdm.auto import tqdm

    from .data import load_corpus
    from .hf import FocusConfig, FocusModel, get_focus_model
    from .models import load_model

    model, tokenizer = load_model(model_name)
    text = "\n\n".join(load_corpus(corpus).texts("test"))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < max(lengths):
        reps = -(-max(lengths) // ids.shape[1])
        ids = ids.repeat(1, reps)
    model.config._attn_implementation = "sdpa"

    def prefill(m, n):
        with torch.inference_mode():
            return m(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1)

    rows = []
    methods = [("sdpa", None)] + [("focus", k) for k in top_ks]
    bar = tqdm([(n, m) for n in lengths for m in methods], desc="model", disable=not progress)
    for n, (method, top_k) in bar:
        bar.set_postfix(N=n, method=method, top_k=top_k)
        if method == "sdpa":
            runner = model
        else:
            if adapter:
                runner = FocusModel.from_pretrained(model, adapter).set_top_k(top_k)
            else:
                cfg = FocusConfig(num_groups=num_groups, window=window, top_k=top_k)
                runner = get_focus_model(model, cfg)
            runner.eval()
        prefill(runner, warmup_tokens)
        seconds, runs = median_seconds(lambda r=runner, n=n: prefill(r, n), repeats, warmup=0)
        if method == "focus":
            model = runner.unload()
            model.config._attn_implementation = "sdpa"
        rows.append(
            {
                "N": n,
                "method": method,
                "top_k": top_k,
                "seconds": seconds,
                "runs_s": runs,
                "tokens_per_second": n / seconds,
            }
        )
    for row in rows:
        ref = next(r for r in rows if r["N"] == row["N"] and r["method"] == "sdpa")
        row["speedup_vs_sdpa"] = ref["seconds"] / row["seconds"]
    config = {
        "model": model_name,
        "adapter": adapter,
        "corpus": corpus,
        "lengths": list(lengths),
        "top_ks": list(top_ks),
        "num_groups": num_groups,
        "window": window,
        "repeats": repeats,
        "warmup_tokens": warmup_tokens,
        "dtype": "float32",
        "forward": "inference_mode, use_cache=False, logits_to_keep=1",
        "sparse_backend": _resolved_backend("auto"),
    }
    return {"benchmark": "model", "config": config, "environment": environment(), "rows": rows}


def model_table(result: dict[str, Any]) -> str:
    """Markdown table of an end-to-end model benchmark result."""
    lines = [
        "| N | attention | seconds | tokens/s | speedup vs sdpa |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        name = "sdpa (stock)" if r["method"] == "sdpa" else f"focus top_k={r['top_k']}"
        lines.append(
            f"| {r['N']} | {name} | {r['seconds']:.2f} | {r['tokens_per_second']:.0f} "
            f"| {r['speedup_vs_sdpa']:.2f}x |"
        )
    return "\n".join(lines)


def _cmd_model(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_model_benchmark(
        args.model,
        tuple(args.lengths),
        tuple(args.top_k),
        num_groups=args.num_groups,
        window=args.window,
        adapter=args.adapter,
        corpus=args.corpus,
        repeats=args.repeats,
    )
    print(model_table(result))
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    return 0


def _resolved_backend(backend: str) -> str:
    """The backend "auto" picks for the benchmark's inputs (CPU fp32, K = 8, no grad)."""
    from .ops import fused_kernel_available

    if backend != "auto":
        return backend
    return "cpu_fused" if fused_kernel_available() else "cpu_flash"


def _cmd_kernel(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_kernel_benchmark(
        lengths=tuple(args.lengths),
        top_ks=tuple(args.top_k),
        window=args.window,
        num_groups=args.num_groups,
        repeats=args.repeats,
        memory=not args.no_memory,
        seed=args.seed,
        backend=args.backend,
    )
    if not args.no_gates:
        result["gates"] = run_gate_benchmark(window=args.window, num_groups=args.num_groups)
    print(kernel_table(result))
    for r in result.get("gates", []):
        print(
            f"gates N={r['N']} {r['method']}: forward {r['forward_s'] * 1e3:.1f} ms "
            f"({r['forward_ratio']:.2f}x eager), forward+backward "
            f"{r['forward_backward_s'] * 1e3:.1f} ms ({r['forward_backward_ratio']:.2f}x)"
        )
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        plot_kernel(result, plot)
        print(f"wrote {plot}")
    return 0


def register_cli(subparsers) -> None:
    """Add ``focus bench`` and its sub-commands."""
    bench = subparsers.add_parser("bench", help="speed benchmarks (write JSON results)")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    kernel = sub.add_parser(
        "kernel",
        help="sparse_attention against dense causal SDPA (SmolLM2-135M attention shape)",
        description="Times dense torch SDPA (is_causal) against focus sparse_attention in "
        "one process, fp32, B=1, H=9, H_kv=3, D=64, and reports speedup, density, ideal "
        "speedup (1/density), efficiency and peak memory.",
    )
    kernel.add_argument("--json", help="write results to this JSON file")
    kernel.add_argument("--plot", help="PNG plot path (default: the JSON path with .png)")
    kernel.add_argument(
        "--lengths", type=int, nargs="+", default=list(KERNEL_LENGTHS), help="tokens"
    )
    kernel.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    kernel.add_argument("--num-groups", type=int, default=8)
    kernel.add_argument("--window", type=int, default=128, help="local window (tokens)")
    kernel.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    kernel.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    kernel.add_argument("--seed", type=int, default=0)
    kernel.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    kernel.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "cpu_fused", "cpu_flash", "math"],
        help="sparse_attention backend (auto: the fused CPU kernel where it can be built)",
    )
    kernel.add_argument(
        "--no-gates", action="store_true", help="skip the soft-gate vs eager timing at N=1024"
    )
    kernel.set_defaults(func=_cmd_kernel)

    model = sub.add_parser(
        "model",
        help="end-to-end prefill of a real model: stock sdpa against Focus top-k",
        description="Times a prefill forward (logits for the last token only) of the model "
        "on the first N tokens of the corpus's test split, with the stock sdpa attention and "
        "with Focus hard top-k routing, in one run. Needs the prepared assets (focus setup).",
    )
    model.add_argument("--model", default="smollm2-135m")
    model.add_argument("--adapter", help="trained Focus adapter directory (default: fresh)")
    model.add_argument("--corpus", default="austen")
    model.add_argument("--json", help="write results to this JSON file")
    model.add_argument("--lengths", type=int, nargs="+", default=list(MODEL_LENGTHS), help="tokens")
    model.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    model.add_argument("--num-groups", type=int, default=8)
    model.add_argument("--window", type=int, default=128)
    model.add_argument("--repeats", type=int, default=1, help="timed runs (median)")
    model.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    model.set_defaults(func=_cmd_model)


def main(argv: list[str] | None = None) -> int:
    """``python -m focus_attention.bench ...`` (same as ``focus bench ...``)."""
    parser = argparse.ArgumentParser(prog="python -m focus_attention.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    # reuse the `focus bench` sub-commands directly
    register_cli(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
