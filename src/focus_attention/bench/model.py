"""``focus bench model``: end-to-end prefill of a real model, stock ``sdpa`` attention
against Focus top-k (the README's end-to-end table)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..hf.architectures import text_config_of
from ..utils.checks import bad
from ..utils.env import environment, library_versions
from .kernel import sparse_backend_name
from .settings import FRESH_WINDOW, MODEL_LENGTHS, ModelBenchConfig
from .timing import median_seconds

__all__ = [
    "MODEL_LENGTHS",
    "ModelBenchConfig",
    "check_model_lengths",
    "model_table",
    "routers_record",
    "run_model_benchmark",
]


def _input_ids(config: ModelBenchConfig, tokenizer: Any) -> torch.Tensor:
    """The first tokens of the corpus split, repeated if shorter than the longest N."""
    from ..assets.corpora import load_corpus

    text = "\n\n".join(load_corpus(config.corpus).texts(config.split))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < max(config.lengths):
        ids = ids.repeat(1, -(-max(config.lengths) // ids.shape[1]))
    return ids


def _available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device``: the CUDA device's free memory, or the
    host's ``MemAvailable``; None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
    free = _available_bytes(model.device)
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
    from ..hf import FocusConfig, FocusModel, get_focus_model

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
    from pathlib import Path

    from ..hf.files import weights_file_sha256
    from ..utils.io import read_json_file

    if adapter is None:
        return {"adapter": None, "fresh": True}
    path = Path(adapter)
    record: dict[str, Any] = {"adapter": str(path), "fresh": False}
    digest = weights_file_sha256(path)
    if digest is not None:
        record["weights_sha256"] = digest
    result = path / "train_result.json"
    if result.is_file():
        trained = read_json_file(result, "the JSON record of a focus train run")
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
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(FLOOR_IMPLEMENTATION, _no_attention)
    model.config._attn_implementation = FLOOR_IMPLEMENTATION
    return model


def _attention_speedups(rows: list[dict[str, Any]]) -> None:
    """Speed-ups against sdpa, whole and (where a floor row exists) of the attention time
    alone: ``(sdpa - floor) / (row - floor)``."""
    for row in rows:
        same = [r for r in rows if r["N"] == row["N"]]
        ref = next(r for r in same if r["method"] == "sdpa")
        row["speedup_vs_sdpa"] = ref["seconds"] / row["seconds"]
        floor = next((r for r in same if r["method"] == "none"), None)
        if floor is not None and row["method"] != "none":
            spent = row["seconds"] - floor["seconds"]
            row["attention_seconds"] = spent
            row["attention_speedup"] = (ref["seconds"] - floor["seconds"]) / spent if spent > 0 else None  # fmt: skip


def run_model_benchmark(config: ModelBenchConfig | None = None) -> dict[str, Any]:
    """End-to-end prefill of a real model: stock ``sdpa`` attention against Focus top-k.

    Input: the first N tokens of the corpus's test split (real text). Each forward runs
    under ``torch.inference_mode()`` with ``use_cache=False`` and ``logits_to_keep=1`` (so
    the vocabulary projection does not dominate). Focus uses ``config.adapter`` if given,
    else freshly initialised routers (speed depends on the group sizes, not on training).
    Seconds are the median of ``repeats`` runs after one warm-up forward of
    ``warmup_tokens`` tokens. With ``config.floor`` a ``none`` row times the model with
    attention replaced by a copy of the query (the projections, MLPs and norms alone): the
    time no attention kernel can go below, from which each row's attention time follows.

    Returns:
        ``{"benchmark": "model", "config", "versions", "environment", "rows"}``
        (``versions``: :func:`library_versions`): seconds, tokens per second and speedup
        against sdpa per ``(N, method, top_k)``; with a floor also ``attention_seconds``
        (row minus floor) and ``attention_speedup`` (sdpa's attention seconds over the
        row's).

    Raises:
        ValueError: lengths the model cannot take (:func:`check_model_lengths`), before
            the corpus is read; the errors of loading the model, adapter or corpus.
    """
    from tqdm.auto import tqdm

    from ..assets.models import load_model

    config = config or ModelBenchConfig()
    model, tokenizer = load_model(config.model)
    longest = max(*config.lengths, config.warmup_tokens)
    positions = check_model_lengths(model, longest, "ModelBenchConfig", "lengths")
    ids = _input_ids(config, tokenizer)
    model.config._attn_implementation = "sdpa"

    def prefill(m, n):
        with torch.inference_mode():
            return m(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1)

    rows = []
    methods = [("sdpa", None, None)] + ([("none", None, None)] if config.floor else [])
    methods += [("focus", k, w) for w in (config.window or (None,)) for k in config.top_k]
    cells = [(n, m) for n in config.lengths for m in methods]
    bar = tqdm(cells, desc="model", disable=not config.progress)
    for n, (method, top_k, window) in bar:
        bar.set_postfix(N=n, method=method, top_k=top_k, window=window)
        if method == "focus":
            runner = _attach(model, config, top_k, window)
            window = runner.focus_config.window
        else:
            runner = _floor_model(model) if method == "none" else model
        prefill(runner, config.warmup_tokens)
        seconds, runs = median_seconds(lambda r=runner, n=n: prefill(r, n), config.repeats,
                                       warmup=0)  # fmt: skip
        if method == "focus":
            model = runner.unload()
        model.config._attn_implementation = "sdpa"
        rows.append({"N": n, "method": method, "top_k": top_k, "window": window,
                     "seconds": seconds,
                     "runs_s": runs, "tokens_per_second": n / seconds})  # fmt: skip
    _attention_speedups(rows)
    record = _record(config, rows, positions)
    return {"benchmark": "model", "config": record, "versions": library_versions(),
            "environment": environment(), "rows": rows}  # fmt: skip


def _record(config: ModelBenchConfig, rows: list[dict[str, Any]], positions: int | None) -> dict[str, Any]:  # fmt: skip
    """The ``config`` record of a result: the settings, the windows the rows ran and the
    model's ``max_position_embeddings`` (``positions``)."""
    return {
        "model": config.model,
        "adapter": config.adapter,
        "corpus": config.corpus,
        "lengths": list(config.lengths),
        "top_ks": list(config.top_k),
        "num_groups": config.num_groups,
        "windows": sorted({r["window"] for r in rows if r["window"] is not None}),
        "repeats": config.repeats,
        "floor": config.floor,
        "warmup_tokens": config.warmup_tokens,
        "max_position_embeddings": positions,
        "dtype": "float32",
        "forward": "inference_mode, use_cache=False, logits_to_keep=1",
        "sparse_backend": sparse_backend_name("auto"),
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
        "| N | attention | seconds | tokens/s | speedup vs sdpa | attention seconds | attention speedup |",  # fmt: skip
        "|---:|---|---:|---:|---:|---:|---:|",
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
        lines.append(
            f"| {r['N']} | {name} | {r['seconds']:.2f} | {r['tokens_per_second']:.0f} "
            f"| {r['speedup_vs_sdpa']:.2f}x | {'-' if spent is None else f'{spent:.2f}'} "
            f"| {'-' if gain is None else f'{gain:.2f}x'} |"
        )
    return "\n".join(lines)
