"""``focus bench model``: end-to-end prefill of a real model, stock ``sdpa`` attention
against Focus top-k (the README's end-to-end table)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.modeling_utils import AttentionInterface

from ..hf import FocusConfig, FocusModel, get_focus_model
from ..hf.architectures import text_config_of
from ..hf.files import weights_file_sha256
from ..settings import adapter_groups
from ..utils.checks import bad
from ..utils.env import environment, library_versions
from ..utils.io import read_json_record
from ..utils.plots import save_png
from .inputs import bench_token_ids, load_bench_model, weights_record
from .kernel import sparse_backend_name
from .settings import FRESH_WINDOW, MODEL_LENGTHS, ModelBenchConfig
from .timing import available_bytes, device_synchronize, median_seconds

__all__ = [
    "MODEL_LENGTHS",
    "ModelBenchConfig",
    "check_model_lengths",
    "model_table",
    "plot_model",
    "routers_record",
    "run_model_benchmark",
]


def check_model_lengths(model: Any, longest: int, owner: str, name: str) -> int | None:
    """Check, before the run, that a forward of ``longest`` tokens through ``model`` can
    run: a model with learned position embeddings takes at most its
    ``max_position_embeddings``; a rotary one goes beyond them (timings hold, its outputs
    there mean little: a warning on stderr); and the activations of one forward, at least
    ``longest * (2 * hidden_size + 2 * intermediate_size)`` values of the model's dtype,
    must fit in the memory free on its device.

    Returns:
        the model's ``max_position_embeddings`` (None: its config has none).

    Raises:
        ValueError: ``owner.name`` beyond the learned positions, or too long for the memory.
    """
    cfg = text_config_of(model.config)
    positions = getattr(cfg, "max_position_embeddings", None)
    rotary = any(getattr(cfg, key, None) for key in ("rope_theta", "rope_parameters", "rope_scaling"))  # fmt: skip
    if positions is not None and longest > positions and not rotary:
        raise bad(owner, name, longest, f"at most {positions} tokens (the model's learned positions)")  # fmt: skip
    hidden = getattr(cfg, "hidden_size", 0)
    per_token = (2 * hidden + 2 * (getattr(cfg, "intermediate_size", None) or 4 * hidden)) * model.dtype.itemsize  # fmt: skip
    free = available_bytes(model.device)
    if free is not None and longest * per_token > free:
        raise bad(owner, name, longest, f"at most about {free // per_token} tokens: a forward of "
                  f"{longest} needs at least {longest * per_token / 2**30:.1f} GiB of activations, "
                  f"{free / 2**30:.1f} GiB is free on {model.device}")  # fmt: skip
    if positions is not None and longest > positions:
        print(f"focus: warning: {name} {longest} is beyond the model's {positions} positions: "
              "it extrapolates them (the timings hold; its outputs there mean little)",
              file=sys.stderr)  # fmt: skip
    return positions


def _attach(model: Any, config: ModelBenchConfig, top_k: int, window: int | None) -> Any:
    """Focus on ``model`` in eval mode: the adapter (with ``window`` unless None), or fresh
    routers (window ``window`` or :data:`FRESH_WINDOW`)."""
    if config.adapter:
        runner = FocusModel.from_pretrained(model, config.adapter).set_top_k(top_k)
        if window is not None:
            runner.focus_config = runner.focus_config.replace(window=window)
    else:
        window = FRESH_WINDOW if window is None else window
        cfg = FocusConfig(num_groups=config.num_groups, window=window, top_k=top_k)
        runner = get_focus_model(model, cfg)
    # the window is this run's (``window``, one of several)
    runner.focus_config = runner.focus_config.override(**config.overrides(without=("top_k", "window")))  # fmt: skip
    return runner.eval()


def routers_record(adapter: str | None) -> dict[str, Any]:
    """Which routers a benchmark ran: ``{"adapter": None, "fresh": True}`` for freshly
    initialised ones, else the adapter directory, the SHA-256 of its weights file and, for a
    ``focus train`` output, its method and optimizer steps (``train_result.json``)."""
    if adapter is None:
        return {"adapter": None, "fresh": True}
    path = Path(adapter)
    record: dict[str, Any] = {"adapter": str(path), "fresh": False}
    digest = weights_file_sha256(path)
    if digest is not None:
        record["weights_sha256"] = digest
    result = path / "train_result.json"
    if result.is_file():
        trained = read_json_record(result, "the JSON record of a focus train run",
                                   {"steps?": int, "config?": dict})  # fmt: skip
        record["steps"] = trained.get("steps")
        record["method"] = trained.get("config", {}).get("method", "focus")
    return record


#: attention implementation of the floor rows: no attention at all (see _no_attention)
FLOOR_IMPLEMENTATION = "focus_bench_no_attention"


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function that attends nothing: the query's layout ``[B, N, H, D]``
    returned as the output (one copy), so the rest of the model runs as with attention."""
    return query.transpose(1, 2).contiguous(), None


def _floor_model(model: Any) -> Any:
    """``model`` switched to :func:`_no_attention` (registered once with transformers)."""
    AttentionInterface.register(FLOOR_IMPLEMENTATION, _no_attention)
    model.config._attn_implementation = FLOOR_IMPLEMENTATION
    return model


def _attention_speedups(rows: list[dict[str, Any]]) -> None:
    """Speed-ups against sdpa, whole and (where a floor row exists) of the attention time
    alone, ``(sdpa - floor) / (row - floor)``, and the share of the floor's speed-up a row
    reaches, ``speedup_vs_sdpa / floor's speedup_vs_sdpa`` (1: as fast as no attention)."""
    for row in rows:
        same = [r for r in rows if r["N"] == row["N"]]
        ref = next(r for r in same if r["method"] == "sdpa")
        row["speedup_vs_sdpa"] = ref["seconds"] / row["seconds"]
    for row in rows:
        same = [r for r in rows if r["N"] == row["N"]]
        ref = next(r for r in same if r["method"] == "sdpa")
        floor = next((r for r in same if r["method"] == "none"), None)
        if floor is not None and row["method"] != "none":
            spent = row["seconds"] - floor["seconds"]
            row["attention_seconds"] = spent
            row["attention_speedup"] = (ref["seconds"] - floor["seconds"]) / spent if spent > 0 else None  # fmt: skip
            row["share_of_floor_speedup"] = row["speedup_vs_sdpa"] / floor["speedup_vs_sdpa"]


def run_model_benchmark(config: ModelBenchConfig | None = None) -> dict[str, Any]:
    """End-to-end prefill of a real model (or of a ``random:PRESET`` shape with random
    weights): stock ``sdpa`` attention against Focus top-k.

    Input: the first N tokens of the corpus's test split (real text), or seeded random ids
    for a random-weight model. Each forward runs under ``torch.inference_mode()`` with
    ``use_cache=False`` and ``logits_to_keep=1`` (so the vocabulary projection does not
    dominate), on ``config.device`` in ``config.dtype`` (timings synchronised on CUDA).
    Focus uses ``config.adapter`` if given, else freshly initialised routers (speed depends
    on the group sizes, not on training). Seconds are the median of ``repeats`` runs after
    one warm-up forward of ``warmup_tokens`` tokens and ``warmup`` untimed forwards at the
    row's length. With ``config.floor`` a ``none`` row times the model with attention
    replaced by a copy of the query (the projections, MLPs and norms alone): the time no
    attention kernel can go below, from which each row's attention time follows.
    ``config.threads``, when given, sets torch's threads for the process.

    Returns:
        ``{"benchmark": "model", "config", "versions", "environment", "rows"}``
        (``versions``: :func:`library_versions`): seconds, tokens per second and speedup
        against sdpa per ``(N, method, top_k)``; with a floor also ``attention_seconds``
        (row minus floor), ``attention_speedup`` (sdpa's attention seconds over the row's)
        and ``share_of_floor_speedup`` (the row's speed-up over the floor's).

    Raises:
        ValueError: lengths the model cannot take (:func:`check_model_lengths`), before
            the corpus is read; the errors of loading the model, adapter or corpus.
    """
    config = config or ModelBenchConfig()
    if config.threads:
        torch.set_num_threads(config.threads)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_bench_model(config.model, config.dtype, device, config.seed)
    longest = max(*config.lengths, config.warmup_tokens)
    positions = check_model_lengths(model, longest, "ModelBenchConfig", "lengths")
    ids = bench_token_ids(model, tokenizer, config.corpus, config.split, longest, config.seed)
    ids = ids.to(model.device)
    methods = [("sdpa", None, None)] + ([("none", None, None)] if config.floor else [])
    methods += [("focus", k, w) for w in (config.window or (None,)) for k in config.top_k]
    cells = [(n, m) for n in config.lengths for m in methods]
    rows = []
    for n, (method, top_k, window) in tqdm(cells, desc="model", disable=not config.progress):
        model, row = _prefill_row(config, model, ids, n, (method, top_k, window))
        rows.append(row)
    _attention_speedups(rows)
    record = _record(config, rows, positions, device)
    return {"benchmark": "model", "config": record, "versions": library_versions(),
            "environment": environment(), "rows": rows}  # fmt: skip


def _prefill_row(config: ModelBenchConfig, model: Any, ids: torch.Tensor, n: int, method: tuple) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """One row: ``method`` (``(name, top_k, window)``) prefilling ``n`` tokens, timed; the
    model given back as it came (sdpa attention, no Focus)."""
    name, top_k, window = method
    if name == "focus":
        runner = _attach(model, config, top_k, window)
        window = runner.focus_config.window
    else:
        runner = _floor_model(model) if name == "none" else model

    def prefill(length: int) -> Any:
        with torch.inference_mode():
            return runner(input_ids=ids[:, :length], use_cache=False, logits_to_keep=1)

    sync = device_synchronize(ids.device)
    prefill(config.warmup_tokens)
    seconds, runs = median_seconds(lambda: prefill(n), config.repeats, warmup=config.warmup,
                                   synchronize=sync)  # fmt: skip
    if name == "focus":
        model = runner.unload()
    model.config._attn_implementation = "sdpa"
    return model, {"N": n, "method": name, "top_k": top_k, "window": window,
                   "seconds": seconds, "runs_s": runs, "tokens_per_second": n / seconds}  # fmt: skip


def _record(config: ModelBenchConfig, rows: list[dict[str, Any]], positions: int | None, device: str) -> dict[str, Any]:  # fmt: skip
    """The ``config`` record of a result: the settings, the windows the rows ran, the
    model's ``max_position_embeddings`` (``positions``) and weights, the device, and the
    routers' K (the adapter's, else ``num_groups``)."""
    groups = adapter_groups(config.adapter) or config.num_groups
    return {
        "model": config.model,
        **weights_record(config.model, config.seed),
        "adapter": config.adapter,
        "corpus": config.corpus,
        "lengths": list(config.lengths),
        "top_ks": list(config.top_k),
        "num_groups": groups,
        "windows": sorted({r["window"] for r in rows if r["window"] is not None}),
        "repeats": config.repeats,
        "warmup": config.warmup,
        "floor": config.floor,
        "warmup_tokens": config.warmup_tokens,
        "max_position_embeddings": positions,
        "dtype": config.dtype,
        "device": device,
        "batch_size": 1,
        "forward": "inference_mode, use_cache=False, logits_to_keep=1",
        "sparse_backend": sparse_backend_name(
            config.attention_backend or "auto", groups, device, config.dtype
        ),  # fmt: skip
        "routers": routers_record(config.adapter),
        "dense_layers": None if config.dense_layers is None else list(config.dense_layers),
        "sink_tokens": config.sink_tokens,
        "query_top_k": config.query_top_k,
        "dense_heads": None
        if config.dense_heads is None
        else [list(p) for p in config.dense_heads],
        "inference_routing": config.inference_routing,
    }


def model_table(result: dict[str, Any]) -> str:
    """Markdown table of an end-to-end model benchmark result."""
    lines = [
        "| N | attention | seconds | tokens/s | speedup vs sdpa | attention seconds | attention speedup | share of the floor's speed-up |",  # fmt: skip
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        name = {"sdpa": "sdpa (stock)", "none": "none (floor)"}.get(r["method"], "")
        if r["method"] == "focus":
            name = f"focus top_k={r['top_k']}"
            if r.get("window") is not None:
                name += f", window={r['window']}"
            if result["config"].get("dense_layers"):
                name += ", dense layers " + ",".join(map(str, result["config"]["dense_layers"]))
            if result["config"].get("sink_tokens") is not None:
                name += f", {result['config']['sink_tokens']} sink tokens"
            if result["config"].get("query_top_k") is not None:
                name += f", query_top_k={result['config']['query_top_k']}"
            if result["config"].get("dense_heads"):
                name += f", {len(result['config']['dense_heads'])} dense heads"
            if result["config"].get("inference_routing") == "streaming":
                name += ", streaming (no groups)"
        spent, gain = r.get("attention_seconds"), r.get("attention_speedup")
        share = r.get("share_of_floor_speedup")
        lines.append(
            f"| {r['N']} | {name} | {r['seconds']:.2f} | {r['tokens_per_second']:.0f} "
            f"| {r['speedup_vs_sdpa']:.2f}x | {'-' if spent is None else f'{spent:.2f}'} "
            f"| {'-' if gain is None else f'{gain:.2f}x'} | {'-' if share is None else f'{share:.2f}'} |"
        )  # fmt: skip
    return "\n".join(lines)


def plot_model(result: dict[str, Any], path: str | Path) -> None:
    """PNG plot of a prefill result written to ``path``: the speed-up over stock sdpa
    against the prompt length, per Focus setting, beside the no-attention floor's (the
    ideal no attention kernel can pass) and 0.85 of it
    (:func:`~focus_attention.utils.plots.save_png`)."""
    import matplotlib  # heavy: imported only to draw a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    rows, cfg = result["rows"], result["config"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    floor = sorted((r["N"], r["speedup_vs_sdpa"]) for r in rows if r["method"] == "none")
    if floor:
        ax.plot(*zip(*floor, strict=True), "k--", label="no attention (floor): ideal")
        ax.plot(
            [n for n, _ in floor], [0.85 * s for _, s in floor], "k:", label="0.85 of the floor's"
        )
    for key in sorted({(r["top_k"], r["window"]) for r in rows if r["method"] == "focus"}):
        line = sorted((r["N"], r["speedup_vs_sdpa"]) for r in rows
                      if r["method"] == "focus" and (r["top_k"], r["window"]) == key)  # fmt: skip
        ax.plot(*zip(*line, strict=True), "o-", label=f"focus top_k={key[0]}, window={key[1]}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length N (tokens)")
    ax.set_ylabel("prefill speed-up over stock sdpa")
    ax.set_title(f"prefill, {cfg['model']} ({cfg.get('weights', 'pretrained')} weights), "
                 f"{cfg.get('dtype')} on {cfg.get('device')}", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
