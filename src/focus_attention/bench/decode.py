"""``focus bench decode``: latency of one decoding step with a KV cache, dense attention
against Focus top-k, at the op level and end to end on a real model (docs/method.md §5,
"KV-cache decoding").

* ``op``: one query against ``N`` cached keys in the model's attention shape (query heads,
  key-value heads, head_dim), dense ``scaled_dot_product_attention`` (GQA) against
  ``sparse_attention`` (``"auto"``) with seeded random top-k memberships of ``K`` groups and
  the window; the share of keys the query sees gives the ideal speed-up ``1 / share``.
* ``model``: the model prefilled once on the first ``N`` tokens of real text with Focus
  top-k (which fills the cache with the memberships of every cached key), then
  ``steps`` single-token steps through the model with that cache, each timed; dense
  decodes the same cached keys and values with the base model's own ``sdpa`` attention
  (``FocusModel.disable_focus``) twice: through
  a plain ``DynamicCache`` (what ``generate`` uses; it concatenates, copying every cached
  key and value per step) and through the same cache with
  :class:`~focus_attention.hf.BufferedDynamicLayer` layers (appends without a copy, as
  Focus layers do), so the gain of sparse attention is seen apart from that of the cache.
  The share is that of the decoded tokens' visible keys, averaged over the Focus layers.

Each latency is the median over the timed calls (seconds), after ``warmup`` untimed ones.
After them one more call of each row is counted (:func:`~.operations.count_operations`):
the operations it dispatched, views apart, and the host synchronisations among them, what
bounds a step on a GPU at this model size (the path, hence the count, depends on the
device and on ``attention_backend``).
The rows of one context are timed in turns (one call of each per round,
:func:`~focus_attention.bench.timing.interleaved_median_seconds`), so that a slow spell of a
shared machine falls on dense and Focus alike.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..hf.compat import cache_kwargs, cache_of
from ..utils.env import environment, library_versions
from .model import check_model_lengths, routers_record
from .operations import count_operations
from .settings import DECODE_CONTEXTS, DecodeBenchConfig
from .timing import device_synchronize, interleaved_median_seconds

__all__ = ["DECODE_CONTEXTS", "DecodeBenchConfig", "decode_table", "run_decode_benchmark"]


def _random_groups(n: int, k: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """bool ``[1, n, k]``: ``top_k`` distinct groups per token, uniformly at random."""
    order = torch.rand(1, n, k, generator=gen).argsort(dim=-1)[..., :top_k]
    return torch.zeros(1, n, k, dtype=torch.bool).scatter_(-1, order, True)


def _op_rows(config: DecodeBenchConfig, shape: dict[str, int], device: str) -> list[dict[str, Any]]:  # fmt: skip
    """The op level: one query against ``N`` cached keys, dense then each top_k; the inputs
    drawn in float32 on the CPU, then moved to ``device`` and ``config.dtype`` (every device
    times the same numbers)."""
    gen = torch.Generator().manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)
    rows = []
    for n in config.contexts:
        h, h_kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
        q = torch.randn(1, h, 1, d, generator=gen)
        key, value = (torch.randn(1, h_kv, n, d, generator=gen) for _ in range(2))
        q, key, value = (t.to(device=device, dtype=dtype) for t in (q, key, value))
        rows += _op_context(config, q, key, value, gen)
    return rows


def _op_context(config: DecodeBenchConfig, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gen: torch.Generator) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of one context: dense SDPA and ``sparse_attention`` at each top_k, timed in turns."""
    from ..ops import sparse_attention
    from .kernel import sparse_backend_name

    n, k = key.shape[2], config.op_groups
    backend = config.attention_backend or "auto"
    calls = {"dense": lambda: torch.nn.functional.scaled_dot_product_attention(q, key, value, enable_gqa=True)}  # fmt: skip
    groups = {}
    for top_k in config.top_k:
        kg = _random_groups(n, k, top_k, gen).to(q.device)
        groups[top_k] = (kg[:, -1:], kg)
        calls[f"focus-{top_k}"] = lambda qg=kg[:, -1:], kg=kg: sparse_attention(q, key, value, qg, kg, config.op_window, backend=backend)  # fmt: skip
    with torch.inference_mode():
        timed = interleaved_median_seconds(calls, config.steps, config.warmup, synchronize=device_synchronize(q.device))  # fmt: skip
        counts = {name: count_operations(call) for name, call in calls.items()}
    rows = [{"level": "op", "N": n, "method": "dense", "top_k": None, "seconds": timed["dense"][0], "share": 1.0,
             **_counted(counts["dense"])}]  # fmt: skip
    for top_k, (qg, kg) in groups.items():
        rows.append({"level": "op", "N": n, "method": "focus", "top_k": top_k,
                     "seconds": timed[f"focus-{top_k}"][0],
                     "share": _share(qg[0, 0], kg[0], config.op_window),
                     "backend": sparse_backend_name(backend, k, q.device.type, config.dtype, num_queries=1),
                     **_counted(counts[f"focus-{top_k}"])})  # fmt: skip
    return rows


def _counted(summary: dict[str, Any]) -> dict[str, int]:
    """A row's operation counts of one call (:func:`~.operations.count_operations`)."""
    return {"operations": summary["operations"], "host_syncs": summary["host_syncs"]}


def _share(query_groups: torch.Tensor, key_groups: torch.Tensor, window: int) -> float:
    """Share of the ``N`` keys (``key_groups [N, K]``, the query last) that the query sees."""
    n = key_groups.shape[0]
    visible = (key_groups & query_groups).any(dim=-1)
    visible[max(0, n - window) :] = True
    return float(visible.float().mean())


def _model_shape(model: Any) -> dict[str, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"heads": heads, "kv_heads": getattr(cfg, "num_key_value_heads", heads), "head_dim": head_dim}  # fmt: skip


def _input_ids(config: DecodeBenchConfig, tokenizer: Any, total: int, device: Any) -> torch.Tensor:  # fmt: skip
    """The first ``total`` tokens of the corpus split (repeated if shorter), on ``device``."""
    from ..assets.corpora import load_corpus

    text = "\n\n".join(load_corpus(config.corpus).texts(config.split))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < total:
        ids = ids.repeat(1, -(-total // ids.shape[1]))
    return ids[:, :total].to(device)


def _attach(model: Any, config: DecodeBenchConfig, top_k: int) -> Any:
    from ..hf import FocusConfig, FocusModel, get_focus_model

    if config.adapter:
        runner = FocusModel.from_pretrained(model, config.adapter).set_top_k(top_k)
    else:
        cfg = FocusConfig(num_groups=config.num_groups, window=config.op_window, top_k=top_k)
        runner = get_focus_model(model, cfg)
    runner.focus_config = runner.focus_config.override(**config.overrides(without=("top_k",)))
    return runner.eval()


#: untimed decoding steps, after the timed ones, whose routing gives a row's share of keys seen
SHARE_STEPS = 4


def _recorded_share(runner: Any, step: Any) -> float:
    """Share of the cached keys the decoded query sees, averaged over the Focus layers and
    :data:`SHARE_STEPS` more steps of ``step``, from the groups the layers routed with
    (:meth:`~focus_attention.hf.FocusModel.record_routing`: query and key groups as
    attended, sinks included, so streaming and ``query_top_k`` count right); a dense
    layer sees every key, a dense head of a routed layer every key for its share of the
    layer's key-value heads."""
    fc = runner.focus_config
    kv = _model_shape(runner.base_model)["kv_heads"]
    dense_heads = collections.Counter(layer for layer, _ in fc.dense_heads)
    with runner.record_routing() as records:
        for _ in range(SHARE_STEPS):
            step()
    shares = [1.0] * (SHARE_STEPS * sum(layer in fc.dense_layers for layer in runner.focus_layers))
    for record in records:
        dense = dense_heads[record["layer"]] / kv
        routed = _share(record["query_groups"][0, -1], record["key_groups"][0], fc.window)
        shares.append(dense + (1.0 - dense) * routed)
    return sum(shares) / len(shares)


#: the KV caches of the dense rows (``cache`` of a row): transformers' ``DynamicCache`` and
#: the same with ``BufferedDynamicLayer`` layers; Focus rows have ``"focus"``
DENSE_CACHES = ("dynamic", "buffered")


def _dense_cache(cache: Any, n: int, kind: str = "dynamic") -> Any:
    """A ``DynamicCache`` (``kind`` ``"dynamic"``) or one of ``BufferedDynamicLayer`` layers
    (``"buffered"``) over the first ``n`` cached keys and values of ``cache``."""
    from transformers import DynamicCache

    from ..hf import BufferedDynamicLayer

    dense = DynamicCache()
    if kind == "buffered":
        dense.layers = [BufferedDynamicLayer() for _ in cache.layers]
    for idx, layer in enumerate(cache.layers):
        dense.update(layer.keys[:, :, :n], layer.values[:, :, :n], idx)  # copied by update
    return dense


class _Stepper:
    """Single-token decoding steps of one row from its cache (one token further each call)."""

    def __init__(self, model: Any, ids: torch.Tensor, n: int, cache: Any) -> None:
        self.model, self.ids, self.position, self.cache = model, ids, n, cache

    def __call__(self) -> None:
        i = self.position
        self.model(input_ids=self.ids[:, i : i + 1], **cache_kwargs(self.cache), use_cache=True)
        self.position += 1


def _model_context(config: DecodeBenchConfig, model: Any, ids: torch.Tensor, n: int) -> list[dict[str, Any]]:  # fmt: skip
    """The model rows of one context: a Focus prefill per top_k, dense caches over the first
    one's keys and values, then every row's steps timed in turns."""
    runner = _attach(model, config, config.top_k[0])
    calls: dict[str, Any] = {}
    contexts: dict[str, Any] = {}
    caches = {}
    with torch.inference_mode():
        for top_k in config.top_k:
            runner.set_top_k(top_k)
            caches[top_k] = cache_of(runner(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1))
            calls[f"focus-{top_k}"] = _Stepper(runner, ids, n, caches[top_k])
            contexts[f"focus-{top_k}"] = functools.partial(_with_top_k, runner, top_k)
        for kind in DENSE_CACHES:
            calls[kind] = _Stepper(runner, ids, n, _dense_cache(caches[config.top_k[0]], n, kind))
            contexts[kind] = runner.disable_focus
        timed = interleaved_median_seconds(calls, config.steps, config.warmup, contexts,
                                           synchronize=device_synchronize(ids.device))  # fmt: skip
        counts = {name: count_operations(call, contexts[name]) for name, call in calls.items()}
        shares = {}
        for top_k in caches:
            runner.set_top_k(top_k)
            shares[top_k] = _recorded_share(runner, calls[f"focus-{top_k}"])
    routing = runner.focus_config.inference_routing
    rows = []
    for top_k in caches:
        rows.append({"level": "model", "N": n, "method": "focus", "top_k": top_k,
                     "inference_routing": routing, "cache": "focus",
                     "backend": runner.focus_config.attention_backend,
                     "seconds": timed[f"focus-{top_k}"][0], "share": shares[top_k],
                     **_counted(counts[f"focus-{top_k}"])})  # fmt: skip
    for kind in DENSE_CACHES:
        rows.append({"level": "model", "N": n, "method": "dense", "top_k": None,
                     "cache": kind, "seconds": timed[kind][0], "share": 1.0,
                     **_counted(counts[kind])})  # fmt: skip
    runner.unload()
    return rows


@contextlib.contextmanager
def _with_top_k(runner: Any, top_k: int) -> Iterator[None]:
    runner.set_top_k(top_k)
    yield


def _model_rows(config: DecodeBenchConfig, model: Any, tokenizer: Any, bar: Any) -> list[dict[str, Any]]:  # fmt: skip
    """The model level, one context after another (see :func:`_model_context`)."""
    extra = config.warmup + config.steps + SHARE_STEPS + 2  # + the counted step
    ids = _input_ids(config, tokenizer, max(config.contexts) + extra, model.device)
    rows = []
    for n in config.contexts:
        bar.set_postfix(N=n)
        rows += _model_context(config, model, ids, n)
        model.config._attn_implementation = "sdpa"
        bar.update(1)
    return rows


def _dense_seconds(rows: list[dict[str, Any]], row: dict[str, Any], cache: str) -> float | None:
    """Seconds of the dense row of ``row``'s level and context with the ``cache`` (the op
    level has one dense row, no cache), or None."""
    for r in rows:
        same = r["level"] == row["level"] and r["N"] == row["N"] and r["method"] == "dense"
        if same and r.get("cache", cache) == cache:
            return r["seconds"]
    return None


def _finish(rows: list[dict[str, Any]]) -> None:
    """Tokens per second, speed-ups against dense and the ideal ``1 / share`` per row."""
    for row in rows:
        row["tokens_per_second"] = 1.0 / row["seconds"]
        row["speedup_vs_dense"] = _dense_seconds(rows, row, "dynamic") / row["seconds"]
        same_cache = row["speedup_vs_dense"]
        if row["level"] == "model":
            row["speedup_vs_buffered_dense"] = _dense_seconds(rows, row, "buffered") / row["seconds"]  # fmt: skip
            same_cache = row["speedup_vs_buffered_dense"]
        row["ideal_speedup"] = 1.0 / row["share"]
        row["efficiency"] = same_cache / row["ideal_speedup"]


def run_decode_benchmark(config: DecodeBenchConfig | None = None) -> dict[str, Any]:
    """Decoding-step latency, dense against Focus top-k (module docstring).

    Returns:
        ``{"benchmark": "decode", "config", "versions", "environment", "rows"}``
        (``versions``: :func:`library_versions`); each row: ``level`` (``op`` or
        ``model``), ``N`` (cached tokens), ``method`` (``dense`` or ``focus``), ``top_k``,
        ``seconds`` (median per step), ``tokens_per_second``, ``share`` (keys seen),
        ``speedup_vs_dense`` (against dense with transformers' ``DynamicCache``),
        ``ideal_speedup`` (``1 / share``) and ``efficiency`` (speed-up / ideal, the speed-up
        against the dense row that appends as Focus does: the op level's dense call, the
        model level's buffered cache), ``operations`` and ``host_syncs`` (of one call, see
        the module docstring). Model rows also have ``cache`` (``dynamic`` or ``buffered``
        for dense, ``focus``) and ``speedup_vs_buffered_dense``.

    The op level runs in ``config``'s attention shape where given (the model's otherwise);
    with the op level alone and the whole shape given no model is loaded (``model`` None in
    the record).

    Raises:
        ValueError: contexts the model cannot take at the model level
            (:func:`~.model.check_model_lengths`); the errors of loading the model, the
            adapter or the corpus.
    """
    from tqdm.auto import tqdm

    from ..assets.models import load_model

    config = config or DecodeBenchConfig()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = tokenizer = None
    if config.needs_model:
        model, tokenizer = load_model(config.model, config.dtype, device=device, quiet=True)
        model.config._attn_implementation = "sdpa"
    if "model" in config.levels:
        longest = max(config.contexts) + config.warmup + config.steps + SHARE_STEPS + 2
        check_model_lengths(model, longest, "DecodeBenchConfig", "contexts")
    shape = config.shape_over({} if model is None else _model_shape(model))
    if shape["heads"] % shape["kv_heads"]:
        raise ValueError(
            f"DecodeBenchConfig: the op level's {shape['heads']} query heads are not a multiple "
            f"of its {shape['kv_heads']} key-value heads (num_heads, num_key_value_heads: the "
            "ones not given are the model's)"
        )
    rows = _op_rows(config, shape, device) if "op" in config.levels else []
    if "model" in config.levels:
        total = len(config.contexts)
        with tqdm(total=total, desc="decode", disable=not config.progress) as bar:
            rows += _model_rows(config, model, tokenizer, bar)
    _finish(rows)
    record = {
        "model": config.model if model is not None else None, "adapter": config.adapter,
        "corpus": config.corpus,
        "contexts": list(config.contexts), "top_ks": list(config.top_k),
        "levels": list(config.levels), "num_groups": config.op_groups, "window": config.op_window,
        "steps": config.steps, "warmup": config.warmup, "seed": config.seed,
        "attention_shape": shape, "dtype": config.dtype, "device": device, "batch_size": 1,
        "routers": routers_record(config.adapter),
        "dense_layers": None if config.dense_layers is None else list(config.dense_layers),
        "overrides": config.overrides(without=("top_k",)),
    }  # fmt: skip
    return {"benchmark": "decode", "config": record, "versions": library_versions(),
            "environment": environment(), "rows": rows}  # fmt: skip


def decode_table(result: dict[str, Any]) -> str:
    """Markdown table of a decoding benchmark result."""
    lines = [
        "| level | cached tokens | attention | cache | ms per step | tokens/s | keys seen | speedup vs dense | vs buffered dense | ideal | efficiency | operations | host syncs |",  # fmt: skip
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        name = "dense" if r["method"] == "dense" else f"focus top_k={r['top_k']}"
        if r.get("inference_routing") == "streaming":
            name = "focus streaming (no groups)"
        if r.get("backend") not in (None, "auto"):
            name += f" ({r['backend']})"
        buffered = r.get("speedup_vs_buffered_dense")
        buffered = "-" if buffered is None else f"{buffered:.2f}x"
        lines.append(
            f"| {r['level']} | {r['N']} | {name} | {r.get('cache', '-')} | {1e3 * r['seconds']:.2f} "
            f"| {r['tokens_per_second']:.1f} | {100 * r['share']:.1f}% | {r['speedup_vs_dense']:.2f}x "
            f"| {buffered} | {r['ideal_speedup']:.2f}x | {r['efficiency']:.2f} "
            f"| {r.get('operations', '-')} | {r.get('host_syncs', '-')} |"
        )  # fmt: skip
    return "\n".join(lines)
