"""``focus bench kernel``: the sparse attention op against dense causal SDPA, and the soft
gates against eager attention (docs/method.md §5; the README's kernel table)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from ..ops import (
    SparseRequest,
    gated_attention,
    pairs_retained,
    resolve_backend,
    sinkhorn,
    sparse_attention,
)
from ..ops.reference import expand_kv_heads
from ..utils.env import environment, library_versions
from ..utils.plots import save_png
from .settings import DTYPE_NAMES, KERNEL_LENGTHS, KernelBenchConfig
from .timing import cuda_peak_extra_bytes, device_synchronize, median_seconds, peak_extra_bytes

__all__ = [
    "KERNEL_LENGTHS",
    "KernelBenchConfig",
    "balanced_memberships",
    "random_memberships",
    "dense_sdpa_context",
    "kernel_peak_memory",
    "kernel_table",
    "plot_kernel",
    "run_gate_benchmark",
    "run_kernel_benchmark",
    "sparse_backend_name",
]

#: input dtypes the benchmark can time
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def balanced_memberships(n: int, num_groups: int, top_k: int, generator) -> torch.Tensor:
    """Random memberships with exactly ``n * top_k / K`` tokens per group (up to rounding):
    token ``i`` joins groups ``(p_i + r) mod K`` for ``r`` in ``0..top_k-1``, where ``p`` is a
    random permutation of ``arange(n) mod K``. Returns bool ``[1, n, K]``."""
    first = torch.arange(n) % num_groups
    first = first[torch.randperm(n, generator=generator)]
    groups = (first[:, None] + torch.arange(top_k)[None, :]) % num_groups
    out = torch.zeros(1, n, num_groups, dtype=torch.bool)
    out[0].scatter_(1, groups, True)
    return out


def random_memberships(n: int, num_groups: int, top_k: int, generator) -> torch.Tensor:
    """Memberships of ``top_k`` groups per token, each token's drawn uniformly among all
    ``C(K, top_k)`` sets (the ``top_k`` largest of K uniform scores), so that a prompt has
    about as many distinct sets as tokens where ``C(K, top_k)`` is large, as learned routing
    of queries makes. Returns bool ``[1, n, K]``."""
    picked = torch.rand(n, num_groups, generator=generator).topk(top_k, dim=-1).indices
    return torch.zeros(1, n, num_groups, dtype=torch.bool).scatter_(2, picked[None], True)


def kernel_inputs(n: int, top_k: int, cfg: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """Seeded query, key, value ``[1, H(_kv), n, D]`` and balanced memberships of the
    queries and of the keys, bool ``[1, n, K]`` (with ``cfg["per_head_groups"]``: ``[1, n,
    H_kv, K]``, one balanced draw per key-value head), on ``cfg["device"]`` (default cpu)
    in ``cfg["dtype"]`` (default float32): ``(q, k, v, query_groups, key_groups)``. Keys
    join ``top_k`` groups; queries the same groups, or with ``cfg["query_top_k"]`` their own
    draw of that many (``cfg["query_draw"]``: ``balanced``, the default, or ``random``,
    :func:`random_memberships`).
    On the CPU the values are drawn in fp32, then cast, so every dtype times the same
    numbers; on CUDA they are drawn on the device (a 128K-token input of Llama-3-8B's shape is
    800M values: seconds there, tens of seconds on the CPU), the same on every CUDA device."""
    seed = cfg["seed"] + 7919 * n + top_k
    gen = torch.Generator().manual_seed(seed)
    device, dtype = cfg.get("device", "cpu"), DTYPES[cfg.get("dtype", "float32")]
    on_cuda = torch.device(device).type == "cuda"
    draw = torch.Generator(device=device).manual_seed(seed) if on_cuda else gen
    place = {"device": device, "dtype": dtype} if on_cuda else {}
    heads = (cfg["num_heads"], cfg["num_key_value_heads"], cfg["num_key_value_heads"])
    q, k, v = (torch.randn(1, h, n, cfg["head_dim"], generator=draw, **place) for h in heads)
    key_groups = _memberships(n, top_k, cfg, gen)
    query_top_k = cfg.get("query_top_k")
    query_draw = cfg.get("query_draw", "balanced")
    own = query_top_k is not None and (query_top_k != top_k or query_draw != "balanced")
    query_groups = _memberships(n, query_top_k, cfg, gen, query_draw) if own else key_groups
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return q, k, v, query_groups.to(device), key_groups.to(device)


def _memberships(n: int, top_k: int, cfg: dict[str, Any], gen: torch.Generator,
                 kind: str = "balanced") -> torch.Tensor:  # fmt: skip
    """:func:`balanced_memberships` (or with ``kind="random"`` :func:`random_memberships`)
    ``[1, n, K]``, or one draw per key-value head ``[1, n, H_kv, K]`` with
    ``cfg["per_head_groups"]`` (the first head's draw is the shared one)."""
    draw = random_memberships if kind == "random" else balanced_memberships
    groups = draw(n, cfg["num_groups"], top_k, gen)
    if not cfg.get("per_head_groups", False):
        return groups
    draws = [groups] + [draw(n, cfg["num_groups"], top_k, gen)
                        for _ in range(1, cfg["num_key_value_heads"])]  # fmt: skip
    return torch.stack(draws, dim=2)


def dense_sdpa_context(dense_kernel: str):
    """The SDPA backend context of ``dense_kernel``, one of :data:`DENSE_KERNELS` (a null
    context for ``auto``): SDPA calls inside it run that kernel or raise ``RuntimeError``."""
    if dense_kernel == "auto":
        return contextlib.nullcontext()
    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}  # fmt: skip
    return sdpa_kernel([getattr(SDPBackend, names[dense_kernel])])


def kernel_call(
    method: str, q, k, v, query_groups, key_groups, window: int, backend: str = "auto",
    dense_kernel: str = "auto",
):  # fmt: skip
    """One ``dense`` (causal SDPA, with the ``dense_kernel`` of :data:`DENSE_KERNELS`) or
    ``sparse`` (:func:`sparse_attention` with ``backend``) call.

    Raises:
        RuntimeError: a forced ``dense_kernel`` that cannot run these inputs (SDPA's error).
    """
    if method == "dense":
        with dense_sdpa_context(dense_kernel):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
    return sparse_attention(q, k, v, query_groups, key_groups, window, backend=backend)


def measure_peak_here(method: str, n: int, top_k: int, cfg: dict[str, Any]) -> None:
    """In a fresh process: warm the kernels on a small input, measure one call, print
    ``{"peak_bytes": ...}`` as JSON."""
    backend, dense_kernel = cfg.get("backend", "auto"), cfg.get("dense_kernel", "auto")
    with torch.inference_mode():
        kernel_call(method, *kernel_inputs(256, top_k, cfg), cfg["window"], backend, dense_kernel)
        inputs = kernel_inputs(n, top_k, cfg)
        peak = peak_extra_bytes(
            lambda: kernel_call(method, *inputs, cfg["window"], backend, dense_kernel)
        )
    print(json.dumps({"peak_bytes": peak}))


def kernel_peak_memory(method: str, n: int, top_k: int, cfg: dict[str, Any]) -> int | None:
    """Peak extra resident bytes of one ``dense`` or ``sparse`` kernel call, measured in a
    fresh Python process (so no memory freed by earlier calls is reused)."""
    code = (
        "import json, sys; from focus_attention.bench.kernel import measure_peak_here; "
        "measure_peak_here(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "
        "json.loads(sys.argv[4]))"
    )
    env = dict(os.environ)
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


def sparse_backend_name(
    backend: str, num_groups: int = 8, device: str = "cpu", dtype: str = "float32",
    num_queries: int = 0,
) -> str:  # fmt: skip
    """The backend that runs the benchmark's sparse calls (on ``device`` in ``dtype``,
    ``num_groups`` groups, no grad, ``num_queries`` queries per call, 0: not said) when
    ``backend`` is asked, by the op's own resolver
    (:func:`focus_attention.ops.resolve_backend`). Raises ``ValueError`` as the op would."""
    request = SparseRequest(torch.device(device), DTYPES[dtype], False, num_groups,
                            num_queries=num_queries)  # fmt: skip
    return resolve_backend(backend, request).name


def _peak_bytes(method: str, n: int, top_k: int, cfg: dict[str, Any], inputs) -> int | None:
    """Peak extra bytes of one call: CUDA allocator statistics in this process on CUDA,
    resident memory in a fresh process on the CPU."""
    if torch.device(cfg["device"]).type != "cuda":
        return kernel_peak_memory(method, n, top_k, cfg)
    call = functools.partial(kernel_call, method, *inputs, cfg["window"], cfg["backend"],
                             cfg["dense_kernel"])  # fmt: skip
    with torch.inference_mode():
        return cuda_peak_extra_bytes(call)


def _kernel_row(n: int, top_k: int, cfg: dict[str, Any], config: KernelBenchConfig) -> dict:
    """Time, density and (optionally) peak memory of one ``(N, top_k)``."""
    inputs = kernel_inputs(n, top_k, cfg)
    window = config.window
    sync = device_synchronize(config.device)
    with torch.inference_mode():
        dense_s, dense_all = median_seconds(
            functools.partial(kernel_call, "dense", *inputs, window, "auto", config.dense_kernel),
            config.repeats,
            synchronize=sync,
        )
        sparse_s, sparse_all = median_seconds(
            functools.partial(kernel_call, "sparse", *inputs, window, config.attention_backend),
            config.repeats,
            synchronize=sync,
        )
    memory = config.memory
    density = pairs_retained(inputs[3].cpu(), inputs[4].cpu(), window)
    speedup, ideal = dense_s / sparse_s, 1.0 / density
    return {
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
        "dense_peak_bytes": _peak_bytes("dense", n, top_k, cfg, inputs) if memory else None,
        "sparse_peak_bytes": _peak_bytes("sparse", n, top_k, cfg, inputs) if memory else None,
    }


def run_kernel_benchmark(config: KernelBenchConfig | None = None) -> dict[str, Any]:
    """Dense causal SDPA against :func:`focus_attention.sparse_attention`, same process.

    ``config.attention_backend`` is passed to the op; the backend that ran is recorded in
    ``config["sparse_backend"]`` of the result; ``config.threads``, when given, sets torch's
    threads for the process.

    Returns:
        ``{"benchmark": "kernel", "config", "versions", "environment", "rows"}`` (and
        ``"gates"`` when ``config.gates``; ``versions``: :func:`library_versions`), one row
        per ``(N, top_k)``: seconds (median of ``repeats`` after one warm-up) of each,
        speedup, density (share of causal pairs kept), ideal speedup ``1 / density``,
        efficiency ``speedup / ideal`` and the peak extra resident bytes of one call of
        each.
    """
    config = config or KernelBenchConfig()
    if config.threads:
        torch.set_num_threads(config.threads)
    cfg = {k: getattr(config, k) for k in ("num_heads", "num_key_value_heads", "head_dim",
                                           "window", "num_groups", "seed", "device", "dtype",
                                           "dense_kernel", "per_head_groups", "query_top_k",
                                           "query_draw")}  # fmt: skip
    cfg["backend"] = config.attention_backend
    combos = [(n, k) for n in config.lengths for k in config.top_k]
    bar = tqdm(combos, desc="kernel", disable=not config.progress)
    rows = []
    for n, top_k in bar:
        bar.set_postfix(N=n, top_k=top_k)
        rows.append(_kernel_row(n, top_k, cfg, config))
    record = {
        "lengths": list(config.lengths),
        "top_ks": list(config.top_k),
        "batch_size": 1,
        **{
            k: cfg[k]
            for k in ("num_heads", "num_key_value_heads", "head_dim", "window", "num_groups")
        },  # fmt: skip
        "dtype": config.dtype,
        "device": config.device,
        "repeats": config.repeats,
        "warmup": 1,
        "seed": config.seed,
        "memberships": "balanced random (bench.kernel.balanced_memberships)",
        "per_head_groups": config.per_head_groups,
        "query_top_k": config.query_top_k,
        "query_draw": config.query_draw if config.query_top_k is not None else None,
        "sparse_backend": sparse_backend_name(
            config.attention_backend, config.num_groups, config.device, config.dtype
        ),  # fmt: skip
        "dense": "torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True)",
        "dense_kernel": config.dense_kernel,
        "memory": _memory_note(config) if config.memory else None,
    }
    result = {"benchmark": "kernel", "config": record, "versions": library_versions(),
              "environment": environment(), "rows": rows}  # fmt: skip
    if config.gates:
        result["gates"] = run_gate_benchmark(
            window=config.window, num_groups=config.num_groups, device=config.device
        )
    return result


def _memory_note(config: KernelBenchConfig) -> str:
    """How the peak memory of a call was measured on ``config.device``."""
    if torch.device(config.device).type == "cuda":
        return "peak extra CUDA bytes allocated by one call (max_memory_allocated)"
    return ("peak extra resident bytes of one call in a fresh process (VmHWM after "
            "clear_refs; MALLOC_MMAP_THRESHOLD_=65536)")  # fmt: skip


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
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Soft-gated attention (training path, docs/method.md §3) against eager dense attention
    at length ``n``.

    Eager dense is what transformers' ``eager`` attention does: repeat the key/value heads,
    ``softmax(q k^T * scale + causal mask)`` in fp32, times ``v``. Forward and forward +
    backward, median seconds of ``repeats`` after a warm-up; ratio = gated / eager. Inputs
    are fp32 on ``device``.
    """
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_()

    q = leaf(1, num_heads, n, head_dim)
    k, v = leaf(1, num_key_value_heads, n, head_dim), leaf(1, num_key_value_heads, n, head_dim)
    scores = leaf(1, n, num_groups)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    sync = device_synchronize(device)

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
    for name, fn in [("eager_dense", eager), ("gate_paper", gated("paper")),
                     ("gate_log", gated("log"))]:  # fmt: skip
        with torch.no_grad():
            fwd, _ = median_seconds(fn, repeats, synchronize=sync)
        both, _ = median_seconds(lambda fn=fn: fn().sum().backward(), repeats, synchronize=sync)
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


def gate_lines(result: dict[str, Any]) -> list[str]:
    """One line per soft-gate timing row of a kernel benchmark result."""
    return [
        f"gates N={r['N']} {r['method']}: forward {r['forward_s'] * 1e3:.1f} ms "
        f"({r['forward_ratio']:.2f}x eager), forward+backward "
        f"{r['forward_backward_s'] * 1e3:.1f} ms ({r['forward_backward_ratio']:.2f}x)"
        for r in result.get("gates", [])
    ]


def plot_kernel(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG plot of measured and ideal speedup against N, one line pair per top_k, written
    to ``path`` (:func:`~focus_attention.utils.plots.save_png`)."""
    import matplotlib  # heavy: imported only to draw a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for top_k in sorted({r["top_k"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["top_k"] == top_k]
        ns = [r["N"] for r in rows]
        (line,) = ax.plot(ns, [r["speedup"] for r in rows], "o-", label=f"top_k={top_k} measured")
        ax.plot(ns, [r["ideal_speedup"] for r in rows], "--", color=line.get_color(),
                label=f"top_k={top_k} ideal (1/density)")  # fmt: skip
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("speedup over dense causal SDPA")
    cfg = result["config"]
    ax.set_title(
        f"Focus sparse attention, K={cfg['num_groups']}, window={cfg['window']}, "
        f"H={cfg['num_heads']}/{cfg['num_key_value_heads']}, D={cfg['head_dim']}, "
        f"{cfg.get('dtype', 'float32')} on {cfg.get('device', 'cpu')}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
