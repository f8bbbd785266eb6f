"""The model level of ``focus bench decode``: single-token steps of ``B`` requests through the
whole model over a KV cache of ``N`` tokens, dense against Focus top-k
(:mod:`focus_attention.bench.decode` documents the rows).

Per context the model is prefilled once per top_k with Focus, on one request (the first
``N`` tokens); every row of every batch size decodes from those keys and values, copied ``B``
times: Focus through its prefilled cache, dense (the base model's own ``sdpa`` attention,
``FocusModel.disable_focus``) through caches filled with the same keys and values.
``kv_cache="dynamic"`` gives dense transformers' ``DynamicCache`` and the same cache with
:class:`~focus_attention.hf.BufferedDynamicLayer` layers, and Focus its own dynamic cache;
``kv_cache="static"`` gives both transformers' ``StaticCache`` (what a CUDA graph captures;
Focus layers keep their groups and group buckets in it,
:class:`~focus_attention.hf.static_cache.FocusStaticLayer`).
A cell (a context and a batch size) whose caches would not fit in the memory free is
skipped, with the reason recorded.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from ..hf import BufferedDynamicLayer, FocusConfig, FocusModel, get_focus_model
from ..hf.compat import cache_kwargs, cache_of
from ..ops.sparse import GroupBuckets
from .accounting import kv_bytes, routed_reads, step_bytes, weights_bytes
from .graphs import timed_steps
from .settings import DecodeBenchConfig
from .timing import available_bytes, device_synchronize, release_cached_memory

__all__ = [
    "CELL_MARGIN_BYTES",
    "DENSE_CACHES",
    "SHARE_STEPS",
    "Stepper",
    "attention_shape",
    "model_context_rows",
    "recorded_reads",
    "recorded_share",
    "repeat_cache",
    "steps_per_row",
]

#: untimed decoding steps, after the timed ones, whose routing gives a row's share of keys
#: seen and its reads
SHARE_STEPS = 4
#: the KV caches of the dense rows with ``kv_cache="dynamic"``: transformers' ``DynamicCache``
#: and the same with ``BufferedDynamicLayer`` layers
DENSE_CACHES = ("dynamic", "buffered")
#: bytes a cell leaves free beside its caches (activations, logits, allocator slack)
CELL_MARGIN_BYTES = 2**30


def attention_shape(model: Any) -> dict[str, int]:
    """``{"heads", "kv_heads", "head_dim", "layers"}`` of a transformers model's config."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"heads": heads, "kv_heads": getattr(cfg, "num_key_value_heads", heads),
            "head_dim": head_dim, "layers": cfg.num_hidden_layers}  # fmt: skip


def steps_per_row(config: DecodeBenchConfig) -> int:
    """Steps each row takes after its prefill: the counted one, the warm-up of a graph
    capture, the untimed and timed steps, and the :data:`SHARE_STEPS`."""
    return 1 + max(1, config.warmup) + config.warmup + config.steps + SHARE_STEPS


class Stepper:
    """Single-token decoding steps of one row: ``model(input_ids=tokens)`` over ``cache``,
    ``tokens`` a fixed ``[B, 1]`` buffer (what a captured graph reads); the context
    :meth:`step` switches the model to the row's settings and puts the row's next token
    (of ``ids [B, total]``, from position ``n`` on) in the buffer."""

    def __init__(self, model: Any, ids: torch.Tensor, n: int, cache: Any, switch: Any = None) -> None:  # fmt: skip
        self.model, self.ids, self.position, self.cache = model, ids, n, cache
        self.switch = switch or contextlib.nullcontext
        self.tokens = ids[:, n : n + 1].clone()

    def __call__(self) -> None:
        self.model(input_ids=self.tokens, **cache_kwargs(self.cache), use_cache=True)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The row's settings, with its next token in the buffer."""
        with self.switch():
            self.tokens.copy_(self.ids[:, self.position : self.position + 1])
            self.position += 1
            yield


def attach(model: Any, config: DecodeBenchConfig, top_k: int) -> Any:
    """Focus on ``model`` in eval mode at ``top_k``: the adapter, or fresh routers (K
    ``num_groups``, the op level's window), with the settings' overrides."""
    if config.adapter:
        runner = FocusModel.from_pretrained(model, config.adapter).set_top_k(top_k)
    else:
        cfg = FocusConfig(num_groups=config.num_groups, window=config.op_window, top_k=top_k)
        runner = get_focus_model(model, cfg)
    runner.focus_config = runner.focus_config.override(**config.overrides(without=("top_k",)))
    return runner.eval()


def _focus_prefill(runner: Any, ids: torch.Tensor, n: int, max_len: int | None) -> Any:
    """Focus's cache prefilled on ``ids[:1, :n]``: a ``StaticCache`` of ``max_len`` where
    given, else Focus's own dynamic cache."""
    prompt = ids[:1, :n]
    if max_len is None:
        return cache_of(runner(input_ids=prompt, use_cache=True, logits_to_keep=1))
    cache = StaticCache(config=runner.base_model.config, max_cache_len=max_len)
    runner(input_ids=prompt, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache


def _dense_cache(source: Any, n: int, batch: int, kind: str, base_config: Any, max_len: int) -> Any:  # fmt: skip
    """A dense cache (``kind`` ``dynamic``, ``buffered`` or ``static`` of ``max_len``) over
    the first ``n`` keys and values of ``source`` (one request), repeated ``batch`` times."""
    if kind == "static":
        cache = StaticCache(config=base_config, max_cache_len=max_len)
    else:
        cache = DynamicCache()
        if kind == "buffered":
            cache.layers = [BufferedDynamicLayer() for _ in source.layers]
    for idx, layer in enumerate(source.layers):
        keys, values = (t[:, :, :n].expand(batch, -1, -1, -1).contiguous() for t in (layer.keys, layer.values))  # fmt: skip
        cache.update(keys, values, idx)
    return cache


def _repeat_static_layer(layer: Any, batch: int) -> None:
    """A static cache layer of one request made one of ``batch`` identical requests: its
    per-request tensors (those whose first dimension is 1: keys, values, a Focus layer's
    groups and counts) repeated, its group buckets selected ``batch`` times."""
    for name, value in list(vars(layer).items()):
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == 1:
            setattr(layer, name, value.repeat(batch, *[1] * (value.ndim - 1)))
        elif isinstance(value, GroupBuckets):
            rows = torch.zeros(batch, dtype=torch.long, device=value.device)
            setattr(layer, name, value.index_select(rows))
    if hasattr(layer, "batch_size"):
        layer.batch_size = batch


def repeat_cache(source: Any, batch: int) -> Any:
    """A copy of a prefilled cache of one request (dynamic or static, Focus's layers with
    their groups), holding ``batch`` identical requests; ``source`` is left as it was."""
    cache = copy.deepcopy(source)
    if batch == 1:
        return cache
    for layer in cache.layers:
        if isinstance(layer, StaticLayer):
            _repeat_static_layer(layer, batch)
        else:
            layer.batch_repeat_interleave(batch)
    return cache


def _cell_bytes(config: DecodeBenchConfig, shape: dict[str, int], batch: int, max_len: int, itemsize: int) -> int:  # fmt: skip
    """Memory a cell's caches take at most: every row's keys and values for ``max_len``
    tokens (an eighth more for a buffered cache's spare rows), Focus's group bookkeeping
    (memberships, bucket entries and group codes: ``5 K + 16`` bytes per cached token and
    layer at most), plus :data:`CELL_MARGIN_BYTES`."""
    rows = len(config.top_k) + (1 if config.kv_cache == "static" else len(DENSE_CACHES))
    per_cache = shape["layers"] * kv_bytes(batch, shape["kv_heads"], 1.125 * max_len, shape["head_dim"], itemsize)  # fmt: skip
    groups = shape["layers"] * batch * max_len * (5 * config.op_groups + 16)
    return int(rows * per_cache + len(config.top_k) * groups + CELL_MARGIN_BYTES)


def recorded_reads(runner: Any, step: Callable[[], Any], kv_heads: int) -> dict[int, dict[str, float]]:  # fmt: skip
    """What one request of a Focus row reads per routed layer
    (:func:`~.accounting.routed_reads`), from the groups the layers routed with in
    :data:`SHARE_STEPS` calls of ``step`` (one decoding step each), a dense head counting
    every key for its share of the ``kv_heads`` key-value heads."""
    fc = runner.focus_config
    dense_heads = collections.Counter(layer for layer, _ in fc.dense_heads)
    with runner.record_routing() as records:
        for _ in range(SHARE_STEPS):
            step()
    share = {layer: count / kv_heads for layer, count in dense_heads.items()}
    return routed_reads(records, fc.window, share)


def recorded_share(runner: Any, reads: dict[int, dict[str, float]]) -> float:
    """The share of the cached keys a decoded query sees, averaged over the Focus layers
    (:func:`recorded_reads`; a layer of ``dense_layers`` sees every key)."""
    dense = [layer for layer in runner.focus_layers if layer in runner.focus_config.dense_layers]
    shares = [1.0] * len(dense) + [r["share"] for r in reads.values()]
    return sum(shares) / len(shares)


def _focus_row_reads(runner: Any, stepper: Stepper, shape: dict[str, int], batch: int, itemsize: int) -> dict[str, float]:  # fmt: skip
    """A Focus row's share of keys seen (:func:`recorded_share`) and the bytes of its step
    (:func:`~.accounting.step_bytes`)."""

    def step() -> None:
        with stepper.step():
            stepper()

    reads = recorded_reads(runner, step, shape["kv_heads"])
    cached = sum(r["cached"] for r in reads.values()) / len(reads) if reads else stepper.position
    routers = sum(p.numel() * p.element_size() for p in runner.routers.parameters())
    counted = step_bytes(
        weights=weights_bytes(runner.base_model) + routers, batch=batch,
        kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], itemsize=itemsize,
        keys_per_layer=[reads[i]["keys"] if i in reads else cached for i in range(shape["layers"])],
        entries_per_layer=[(r["entries"], r["later"]) for r in reads.values()],
    )  # fmt: skip
    return {"share": recorded_share(runner, reads), **counted}


@contextlib.contextmanager
def _with_top_k(runner: Any, top_k: int) -> Iterator[None]:
    runner.set_top_k(top_k)
    yield


def _row_steppers(config: DecodeBenchConfig, runner: Any, ids: torch.Tensor, n: int, prefilled: dict[int, Any], max_len: int) -> tuple[dict[str, Stepper], dict[str, str]]:  # fmt: skip
    """The steppers of one cell's rows (``focus-K`` per top_k, a dense one per dense cache)
    over caches of ``ids.shape[0]`` requests, and each row's cache kind (``focus``: Focus's
    dynamic cache)."""
    batch = ids.shape[0]
    steppers, kinds = {}, {}
    focus_kind = "static" if config.kv_cache == "static" else "focus"
    for top_k, cache in prefilled.items():
        switch = functools.partial(_with_top_k, runner, top_k)
        steppers[f"focus-{top_k}"] = Stepper(runner, ids, n, repeat_cache(cache, batch), switch)
        kinds[f"focus-{top_k}"] = focus_kind
    source = prefilled[config.top_k[0]]
    for kind in ("static",) if config.kv_cache == "static" else DENSE_CACHES:
        cache = _dense_cache(source, n, batch, kind, runner.base_model.config, max_len)
        steppers[kind], kinds[kind] = Stepper(runner, ids, n, cache, runner.disable_focus), kind
    return steppers, kinds


def _cell_rows(config: DecodeBenchConfig, runner: Any, ids: torch.Tensor, n: int, prefilled: dict[int, Any], max_len: int) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of one cell: ``ids.shape[0]`` requests of ``n`` cached tokens, every row
    counted, captured where it can be (``config.cuda_graphs``) and timed in turns."""
    shape, batch = attention_shape(runner.base_model), ids.shape[0]
    itemsize = runner.base_model.dtype.itemsize
    steppers, kinds = _row_steppers(config, runner, ids, n, prefilled, max_len)
    refusals = {name: None if kind == "static" else "not captured: a dynamic cache changes "
                "shape every step" for name, kind in kinds.items()}  # fmt: skip
    timed, counts, notes = timed_steps(
        steppers, {name: s.step for name, s in steppers.items()}, steps=config.steps,
        warmup=config.warmup, graphs=config.cuda_graphs, refusals=refusals,
        synchronize=device_synchronize(ids.device),
    )  # fmt: skip
    dense_keys = max_len if config.kv_cache == "static" else n
    dense = step_bytes(weights=weights_bytes(runner.base_model), batch=batch,
                       kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], itemsize=itemsize,
                       keys_per_layer=[dense_keys] * shape["layers"])  # fmt: skip
    rows = []
    for name, stepper in steppers.items():
        focus = name.startswith("focus-")
        row = {"level": "model", "N": n, "batch_size": batch,
               "method": "focus" if focus else "dense",
               "top_k": int(name.split("-")[1]) if focus else None, "cache": kinds[name],
               "cuda_graph": config.cuda_graphs and notes[name] is None,
               "graph_note": notes[name], "seconds": timed[name][0],
               "operations": counts[name]["operations"], "host_syncs": counts[name]["host_syncs"]}  # fmt: skip
        if focus:
            fc = runner.focus_config
            row.update(inference_routing=fc.inference_routing, backend=fc.attention_backend,
                       **_focus_row_reads(runner, stepper, shape, batch, itemsize))  # fmt: skip
        else:
            row.update(share=1.0, **dense)
        rows.append(row)
    return rows


def _fitting_batches(config: DecodeBenchConfig, shape: dict[str, int], n: int, max_len: int, model: Any) -> tuple[list[int], list[dict[str, Any]]]:  # fmt: skip
    """The batch sizes whose cells fit in the memory free on the model's device beside the
    prefilled caches of one request (:func:`_cell_bytes`, checked before any prefill), and
    a skipped record for each other."""
    release_cached_memory(model.device)
    free = available_bytes(model.device)
    itemsize = model.dtype.itemsize
    fits, skipped = [], []
    for batch in config.batch_size:
        need = _cell_bytes(config, shape, batch, max_len, itemsize) + _cell_bytes(config, shape, 1, max_len, itemsize)  # fmt: skip
        if free is None or need <= free:
            fits.append(batch)
            continue
        skipped.append({"level": "model", "N": n, "batch_size": batch,
                        "reason": f"its caches need about {need / 2**30:.1f} GiB, "
                        f"{free / 2**30:.1f} GiB is free on {model.device}"})  # fmt: skip
    return fits, skipped


def model_context_rows(config: DecodeBenchConfig, model: Any, ids: torch.Tensor, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """The rows of one context ``n`` at every batch size (module docstring), and the cells
    skipped for memory.

    Args:
        config: the settings.
        model: the base model (Focus is attached, then unloaded).
        ids: token ids ``[max(batch_size), n + steps_per_row(config) + 1]`` on the device.
        n: cached tokens.

    Returns:
        ``(rows, skipped)``; a skipped cell is ``{"level", "N", "batch_size", "reason"}``.
    """
    shape = attention_shape(model)
    max_len = n + steps_per_row(config) + 8
    batches, skipped = _fitting_batches(config, shape, n, max_len, model)
    if not batches:
        return [], skipped
    runner = attach(model, config, config.top_k[0])
    rows, prefilled = [], {}
    with torch.inference_mode():
        for top_k in config.top_k:
            runner.set_top_k(top_k)
            static = max_len if config.kv_cache == "static" else None
            prefilled[top_k] = _focus_prefill(runner, ids, n, static)
        for batch in batches:
            release_cached_memory(ids.device)
            rows += _cell_rows(config, runner, ids[:batch], n, prefilled, max_len)
    prefilled.clear()
    runner.unload()
    release_cached_memory(ids.device)
    return rows, skipped
