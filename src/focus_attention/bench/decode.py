"""``focus bench decode``: latency of one decoding step with a KV cache, dense attention
against Focus top-k, at the op level and end to end through a model, for ``B`` requests
decoding together (docs/method.md §5, "KV-cache decoding"; docs/deploy.md, "Speed on a GPU").

* ``op``: one query per request against ``N`` cached keys in the model's attention shape
  (query heads, key-value heads, head_dim), dense ``scaled_dot_product_attention`` (GQA, the
  ``dense_kernel`` asked for) against Focus's decoding op with seeded random top-k
  memberships of ``K`` groups and the window: the op the model level's cache runs
  (:func:`focus_op`: with ``kv_cache="static"`` and the ``auto`` backend the static cache's
  ``decode_attention`` over group buckets, else ``sparse_attention`` with the backend); the share of
  keys the query sees gives the ideal speed-up ``1 / share``.
* ``model``: single-token steps through the whole model over a cache of ``N`` tokens
  (:mod:`focus_attention.bench.decode_model`): Focus top-k against the base model's own
  ``sdpa`` attention on the same cached keys and values, through dynamic caches
  (transformers' ``DynamicCache`` and a buffered one for dense) or transformers'
  ``StaticCache`` (``kv_cache="static"``). The share is that of the decoded tokens' visible
  keys, averaged over the Focus layers.

Each latency is the median over the timed calls (seconds), after ``warmup`` untimed ones;
the rows of one cell (a context and a batch size) are timed in turns
(:func:`~focus_attention.bench.timing.interleaved_median_seconds`), so that a slow spell of a
shared machine falls on dense and Focus alike. Before them one call of each row is counted
(:func:`~.operations.count_operations`): the operations it dispatched, views apart, and the
host synchronisations among them, what bounds a step when launching operations costs more
than running them. With ``cuda_graphs`` each row whose step does not read back to the host
(and whose cache keeps its shape) is captured in a CUDA graph and timed as graph replays
(:mod:`~focus_attention.bench.graphs`); the others stay eager, with the reason.

Each row also has the bytes its step reads and the floor they set at the device's copy
bandwidth, measured once per run (:mod:`~focus_attention.bench.accounting`), and the ideal
speed-up over its reference dense row from those bytes; the result lists, per level, batch
size and top_k, the shortest context from which Focus is at least as fast as dense (the
crossover).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..ops import SparseRequest, resolve_backend, sparse_attention
from ..ops.sparse import GroupBuckets, decode_attention
from ..utils.env import cpu_name, environment, library_versions
from ..utils.plots import save_png
from .accounting import (
    bucket_entries,
    copy_bandwidth,
    crossovers,
    kv_bytes,
    step_bytes,
    visible_keys,
)
from .decode_model import (
    CELL_MARGIN_BYTES,
    DENSE_CACHES,
    SHARE_STEPS,
    attention_shape,
    model_context_rows,
    steps_per_row,
)
from .graphs import timed_steps
from .inputs import bench_token_ids, load_bench_model, weights_record
from .kernel import dense_sdpa_context, sparse_backend_name
from .model import check_model_lengths, routers_record
from .settings import DECODE_CONTEXTS, DecodeBenchConfig
from .timing import available_bytes, device_synchronize, release_cached_memory

__all__ = [
    "DECODE_CONTEXTS",
    "DENSE_CACHES",
    "SHARE_STEPS",
    "DecodeBenchConfig",
    "decode_table",
    "device_name",
    "focus_op",
    "plot_decode",
    "run_decode_benchmark",
]


def _random_groups(rows: int, n: int, k: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """bool ``[rows, n, k]`` on ``gen``'s device: ``top_k`` distinct groups per token,
    uniformly at random."""
    device = gen.device
    order = torch.rand(rows, n, k, generator=gen, device=device).argsort(dim=-1)[..., :top_k]
    return torch.zeros(rows, n, k, dtype=torch.bool, device=device).scatter_(-1, order, True)


def _dense_call(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dense_kernel: str) -> torch.Tensor:  # fmt: skip
    """Dense decoding attention of one query per request (SDPA with GQA, ``dense_kernel``)."""
    with dense_sdpa_context(dense_kernel):
        return torch.nn.functional.scaled_dot_product_attention(q, key, value, enable_gqa=True)


def focus_op(config: DecodeBenchConfig, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_groups: torch.Tensor) -> tuple[Callable[[], Any], str]:  # fmt: skip
    """The op level's Focus call for queries ``q [B, H, 1, D]`` (the last key's groups) over
    ``key``/``value [B, H_kv, N, D]`` with memberships ``key_groups [B, N, K]``, and its
    name (the backend that runs it): with ``kv_cache="static"`` and the ``auto`` backend what
    a static cache's layer runs, :func:`~focus_attention.ops.sparse.decode_attention` over
    group buckets; else ``sparse_attention`` with the backend.
    """
    backend = config.attention_backend or "auto"
    query_groups, window = key_groups[:, -1:], config.op_window
    if config.kv_cache == "static" and backend == "auto":
        buckets = GroupBuckets.from_groups(key_groups[:, None])
        lengths = torch.full((key.shape[0],), key.shape[2], dtype=torch.long, device=key.device)
        call = functools.partial(decode_attention, q, key, value, query_groups, buckets, lengths,
                                 window)  # fmt: skip
        request = SparseRequest(q.device, q.dtype, False, key_groups.shape[-1],
                                num_queries=q.shape[2], over_buckets=True)  # fmt: skip
        return call, resolve_backend("auto", request).name
    call = functools.partial(sparse_attention, q, key, value, query_groups, key_groups, window,
                             backend=backend)  # fmt: skip
    name = sparse_backend_name(backend, config.op_groups, q.device.type, config.dtype, num_queries=1)  # fmt: skip
    return call, name


def _op_rows(config: DecodeBenchConfig, shape: dict[str, int], device: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """The op level, every context and batch size: dense then each top_k; the inputs drawn
    on ``device`` in ``config.dtype`` from a generator seeded with ``config.seed``. A cell
    whose keys and values (three times, for the calls' copies) do not fit in the memory free
    is skipped, with the reason."""
    gen = torch.Generator(device=device).manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)
    h, h_kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    rows, skipped = [], []
    for n in config.contexts:
        for batch in config.batch_size:
            need = 3 * kv_bytes(batch, h_kv, n, d, dtype.itemsize) + CELL_MARGIN_BYTES
            release_cached_memory(device)
            free = available_bytes(device)
            if free is not None and need > free:
                skipped.append({"level": "op", "N": n, "batch_size": batch,
                                "reason": f"its keys and values need about {need / 2**30:.1f} "
                                f"GiB, {free / 2**30:.1f} GiB is free on {device}"})  # fmt: skip
                continue
            q = torch.randn(batch, h, 1, d, generator=gen, device=device, dtype=dtype)
            key, value = (torch.randn(batch, h_kv, n, d, generator=gen, device=device, dtype=dtype)
                          for _ in range(2))  # fmt: skip
            rows += _op_cell(config, q, key, value, gen)
    return rows, skipped


def _op_reads(query_groups: torch.Tensor, key_groups: torch.Tensor, window: int) -> tuple[float, float, float]:  # fmt: skip
    """``(keys, entries, later)`` one request's query reads, averaged over the requests:
    ``query_groups [B, 1, K]``, ``key_groups [B, N, K]`` (:mod:`.accounting`)."""
    total = [0.0, 0.0, 0.0]
    for q, k in zip(query_groups[:, -1], key_groups, strict=True):
        entries, later = bucket_entries(q, k, window)
        total = [total[0] + visible_keys(q, k, window), total[1] + entries, total[2] + later]
    return tuple(v / key_groups.shape[0] for v in total)


def _op_cell(config: DecodeBenchConfig, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gen: torch.Generator) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of one op cell: dense SDPA and Focus's decoding op (:func:`focus_op`) at each
    top_k, counted, captured where asked and possible, timed in turns."""
    batch, h_kv, n, d = key.shape
    calls = {"dense": functools.partial(_dense_call, q, key, value, config.dense_kernel)}
    groups, names = {}, {}
    for top_k in config.top_k:
        kg = _random_groups(batch, n, config.op_groups, top_k, gen)
        groups[top_k] = (kg[:, -1:], kg)
        calls[f"focus-{top_k}"], names[top_k] = focus_op(config, q, key, value, kg)
    with torch.inference_mode():
        timed, counts, notes = timed_steps(calls, {}, steps=config.steps, warmup=config.warmup,
                                           graphs=config.cuda_graphs,
                                           synchronize=device_synchronize(q.device))  # fmt: skip
    size = dict(weights=0, batch=batch, kv_heads=h_kv, head_dim=d, itemsize=q.element_size())
    rows = []
    for name in calls:
        row = {"level": "op", "N": n, "batch_size": batch, "method": "dense", "top_k": None,
               "seconds": timed[name][0], "share": 1.0, "cuda_graph": config.cuda_graphs and notes[name] is None,
               "graph_note": notes[name], "operations": counts[name]["operations"],
               "host_syncs": counts[name]["host_syncs"]}  # fmt: skip
        if name == "dense":
            rows.append({**row, **step_bytes(**size, keys_per_layer=[n])})
            continue
        top_k = int(name.split("-")[1])
        seen, entries, later = _op_reads(*groups[top_k], config.op_window)
        rows.append({**row, "method": "focus", "top_k": top_k, "share": seen / n, "backend": names[top_k],
                     **step_bytes(**size, keys_per_layer=[seen], entries_per_layer=[(entries, later)])})  # fmt: skip
    return rows


def _dense_row(rows: list[dict[str, Any]], row: dict[str, Any], cache: str | None) -> dict[str, Any] | None:  # fmt: skip
    """The dense row of ``row``'s level, context and batch size with ``cache`` (the op
    level's: None), or None."""
    for r in rows:
        same = (r["level"], r["N"], r["batch_size"]) == (row["level"], row["N"], row["batch_size"])
        if same and r["method"] == "dense" and r.get("cache") == cache:
            return r
    return None


def _finish(rows: list[dict[str, Any]], bytes_per_second: float, kv_cache: str) -> None:
    """Per row: tokens per second (``B`` tokens a step), the speed-ups against dense
    (``speedup_vs_dense``: transformers' ``DynamicCache`` at the model level with dynamic
    caches, its ``StaticCache`` with static ones; ``speedup_vs_buffered_dense``), the
    reference dense row's seconds (the one with the same kind of cache: the op level's
    call, the buffered or the static cache), the ideal ``1 / share`` and the efficiency
    against it, and the floor of its bytes with the ideal and efficiency they give."""
    model_caches = ("static", "static") if kv_cache == "static" else ("dynamic", "buffered")
    for row in rows:
        main, ref = (None, None) if row["level"] == "op" else model_caches
        main, ref = _dense_row(rows, row, main), _dense_row(rows, row, ref)
        row["tokens_per_second"] = row["batch_size"] / row["seconds"]
        row["speedup_vs_dense"] = main["seconds"] / row["seconds"]
        if row["level"] == "model" and kv_cache == "dynamic":
            row["speedup_vs_buffered_dense"] = ref["seconds"] / row["seconds"]
        row["reference_seconds"] = ref["seconds"]
        same = ref["seconds"] / row["seconds"]
        row["ideal_speedup"] = 1.0 / row["share"]
        row["efficiency"] = same / row["ideal_speedup"]
        row["floor_seconds"] = row["bytes_read"] / bytes_per_second
        row["bandwidth_share"] = row["floor_seconds"] / row["seconds"]
        row["ideal_speedup_from_bytes"] = ref["bytes_read"] / row["bytes_read"]
        row["efficiency_from_bytes"] = same / row["ideal_speedup_from_bytes"]


def _model_rows(config: DecodeBenchConfig, model: Any, tokenizer: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """The model level, one context after another (:func:`~.decode_model.model_context_rows`)."""
    total = max(config.contexts) + steps_per_row(config) + 1
    ids = bench_token_ids(model, tokenizer, config.corpus, config.split, total, config.seed,
                          rows=max(config.batch_size)).to(model.device)  # fmt: skip
    rows, skipped = [], []
    with tqdm(total=len(config.contexts), desc="decode", disable=not config.progress) as bar:
        for n in config.contexts:
            bar.set_postfix(N=n)
            done, left_out = model_context_rows(config, model, ids, n)
            rows, skipped = rows + done, skipped + left_out
            model.config._attn_implementation = "sdpa"
            bar.update(1)
    return rows, skipped


def device_name(device: str | torch.device) -> str:
    """The name of ``device``: the CUDA device's, or the CPU model's."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def run_decode_benchmark(config: DecodeBenchConfig | None = None) -> dict[str, Any]:
    """Decoding-step latency, dense against Focus top-k (module docstring).

    Returns:
        ``{"benchmark": "decode", "config", "versions", "environment", "bandwidth",
        "rows", "skipped", "crossover"}`` (``versions``: :func:`library_versions`;
        ``bandwidth``: :func:`~.accounting.copy_bandwidth`; ``skipped``: the cells left out
        for memory, with the reason; ``crossover``: :func:`~.accounting.crossovers`). Each
        row: ``level`` (``op`` or ``model``), ``N`` (cached tokens), ``batch_size``,
        ``method`` (``dense`` or ``focus``), ``top_k``, ``seconds`` (median per step),
        ``tokens_per_second`` (``B`` per step), ``share`` (keys seen),
        ``speedup_vs_dense``, ``reference_seconds`` (the dense row with the same kind of
        cache: the op level's call, the buffered or the static cache), ``ideal_speedup``
        (``1 / share``) and ``efficiency`` (speed-up over the reference / ideal),
        ``operations`` and ``host_syncs`` (of one eager call), ``cuda_graph`` (timed as
        graph replays) and ``graph_note`` (why not, when graphs were asked for), and the
        bytes of a step: ``weights_bytes``, ``kv_bytes``, ``index_bytes``, ``bytes_read``,
        ``floor_seconds`` (bytes over the copy bandwidth), ``bandwidth_share`` (floor over
        seconds), ``ideal_speedup_from_bytes`` (the reference's bytes over the row's) and
        ``efficiency_from_bytes``. Model rows also have ``cache`` (``dynamic``,
        ``buffered`` or ``static`` for dense; ``focus``, Focus's dynamic cache, or
        ``static``) and, with dynamic caches, ``speedup_vs_buffered_dense``.

    The op level runs in ``config``'s attention shape where given (the model's otherwise);
    with the op level alone and the whole shape given no model is loaded (``model`` None in
    the record).

    Raises:
        ValueError: contexts the model cannot take at the model level
            (:func:`~.model.check_model_lengths`); the errors of loading the model, the
            adapter or the corpus.
    """
    config = config or DecodeBenchConfig()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = config.resolved_device
    model = tokenizer = None
    if config.needs_model:
        model, tokenizer = load_bench_model(config.model, config.dtype, device, config.seed)
    if "model" in config.levels:
        longest = max(config.contexts) + steps_per_row(config) + 1
        check_model_lengths(model, longest, "DecodeBenchConfig", "contexts")
    shape = config.shape_over({} if model is None else attention_shape(model))
    if shape["heads"] % shape["kv_heads"]:
        raise ValueError(
            f"DecodeBenchConfig: the op level's {shape['heads']} query heads are not a multiple "
            f"of its {shape['kv_heads']} key-value heads (num_heads, num_key_value_heads: the "
            "ones not given are the model's)"
        )
    bandwidth = copy_bandwidth(device)
    rows, skipped = _op_rows(config, shape, device) if "op" in config.levels else ([], [])
    if "model" in config.levels:
        done, left_out = _model_rows(config, model, tokenizer)
        rows, skipped = rows + done, skipped + left_out
    _finish(rows, bandwidth["bytes_per_second"], config.kv_cache)
    return {"benchmark": "decode", "config": _record(config, model, shape, device),
            "versions": library_versions(), "environment": environment(),
            "bandwidth": bandwidth, "rows": rows, "skipped": skipped,
            "crossover": crossovers(rows, device_name(device))}  # fmt: skip


def _record(config: DecodeBenchConfig, model: Any, shape: dict[str, int], device: str) -> dict[str, Any]:  # fmt: skip
    """The ``config`` record of a result."""
    return {
        "model": config.model if model is not None else None,
        **(weights_record(config.model, config.seed) if model is not None else {}),
        "adapter": config.adapter, "corpus": config.corpus,
        "contexts": list(config.contexts), "top_ks": list(config.top_k),
        "batch_sizes": list(config.batch_size), "levels": list(config.levels),
        "num_groups": config.op_groups, "window": config.op_window,
        "steps": config.steps, "warmup": config.warmup, "seed": config.seed,
        "attention_shape": {k: shape[k] for k in ("heads", "kv_heads", "head_dim")},
        "dtype": config.dtype, "device": device, "kv_cache": config.kv_cache,
        "cuda_graphs": config.cuda_graphs, "dense_kernel": config.dense_kernel,
        "routers": routers_record(config.adapter),
        "dense_layers": None if config.dense_layers is None else list(config.dense_layers),
        "overrides": config.overrides(without=("top_k",)),
    }  # fmt: skip


def _times(value: float | None, unit: str = "x") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def _row_name(row: dict[str, Any]) -> str:
    """How the table names a row's attention."""
    name = "dense" if row["method"] == "dense" else f"focus top_k={row['top_k']}"
    if row.get("inference_routing") == "streaming":
        name = "focus streaming (no groups)"
    if row.get("backend") not in (None, "auto"):
        name += f" ({row['backend']})"
    return name


def decode_table(result: dict[str, Any]) -> str:
    """Markdown table of a decoding benchmark result (one written before the batch, graph
    and bytes columns existed shows ``-`` there)."""
    lines = [
        "| level | cached tokens | batch | attention | cache | graph | ms per step | tokens/s | keys seen | speedup vs dense | vs buffered dense | ideal | efficiency | floor ms | ideal from bytes | efficiency from bytes | operations | host syncs |",  # fmt: skip
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    graphs = result["config"].get("cuda_graphs", False)
    for r in result["rows"]:
        graph = ("yes" if r.get("cuda_graph") else "no") if graphs else "-"
        floor = r.get("floor_seconds")
        lines.append(
            f"| {r['level']} | {r['N']} | {r.get('batch_size', 1)} | {_row_name(r)} | {r.get('cache', '-')} "
            f"| {graph} | {1e3 * r['seconds']:.2f} | {r['tokens_per_second']:.1f} | {100 * r['share']:.1f}% "
            f"| {r['speedup_vs_dense']:.2f}x | {_times(r.get('speedup_vs_buffered_dense'))} "
            f"| {r['ideal_speedup']:.2f}x | {r['efficiency']:.2f} "
            f"| {_times(None if floor is None else 1e3 * floor, '')} "
            f"| {_times(r.get('ideal_speedup_from_bytes'))} | {_times(r.get('efficiency_from_bytes'), '')} "
            f"| {r.get('operations', '-')} | {r.get('host_syncs', '-')} |"
        )  # fmt: skip
    for cell in result.get("skipped", []):
        lines.append(f"\nskipped: {cell['level']} N={cell['N']} batch {cell['batch_size']}: {cell['reason']}")  # fmt: skip
    return "\n".join(lines)


def _reference_speedup(row: dict[str, Any]) -> float:
    """A row's speed-up over its reference dense row (a result written before
    ``reference_seconds`` existed: over the buffered cache where measured, else dense)."""
    if row.get("reference_seconds") is not None:
        return row["reference_seconds"] / row["seconds"]
    return row.get("speedup_vs_buffered_dense") or row["speedup_vs_dense"]


def plot_decode(result: dict[str, Any], path: str | Path) -> None:
    """PNG plot of a decoding result written to ``path``: one panel per level, the
    speed-up of Focus's step over its reference dense step against the cached tokens, per
    batch size and top_k, beside the ideal its bytes give (dashed)
    (:func:`~focus_attention.utils.plots.save_png`)."""
    import matplotlib  # heavy: imported only to draw a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    levels = [lv for lv in ("op", "model") if any(r["level"] == lv for r in result["rows"])]
    fig, axes = plt.subplots(1, max(1, len(levels)), figsize=(6.0 * max(1, len(levels)), 4.2), squeeze=False)  # fmt: skip
    for ax, level in zip(axes[0], levels, strict=False):
        focus = [r for r in result["rows"] if r["level"] == level and r["method"] == "focus"]
        for key in sorted({(r.get("batch_size", 1), r["top_k"]) for r in focus}):
            line = sorted((r["N"], _reference_speedup(r), r.get("ideal_speedup_from_bytes"))
                          for r in focus if (r.get("batch_size", 1), r["top_k"]) == key)  # fmt: skip
            ns = [p[0] for p in line]
            (drawn,) = ax.plot(ns, [p[1] for p in line], "o-", label=f"B={key[0]} top_k={key[1]}")
            if all(p[2] is not None for p in line):
                ax.plot(ns, [p[2] for p in line], "--", color=drawn.get_color())
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens N")
        ax.set_ylabel("speed-up over dense (dashed: ideal from bytes)")
        ax.set_title(f"{level} level", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    cfg = result["config"]
    fig.suptitle(f"decoding step, {cfg.get('model') or 'op shape'} ({cfg.get('weights', 'pretrained')}), "
                 f"{cfg.get('dtype')} on {cfg.get('device')}, graphs {'on' if cfg.get('cuda_graphs') else 'off'}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    save_png(fig, path, dpi=120)
