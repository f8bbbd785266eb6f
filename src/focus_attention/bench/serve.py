"""``focus bench serve``: a Focus model served over HTTP by ``transformers serve`` under load,
against the dense base model served the same way (docs/deploy.md). Requests go to 127.0.0.1
only, bounded in count (``requests`` per cell) and time (``cell_timeout`` per cell)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from ..assets.corpora import load_corpus
from ..deploy.export import export_adapter
from ..deploy.serve import ServedModel
from ..deploy.settings import (
    BASE_CONFIG_KEY,
    REMOTE_CODE_NAME,
    ExportConfig,
    exported_settings,
    with_settings,
)
from ..hf.files import CONFIG_NAME, WEIGHTS_NAME
from ..utils.env import environment
from ..utils.plots import save_png
from .model import routers_record
from .settings import ServeBenchConfig

__all__ = [
    "ServeBenchConfig",
    "variant_name",
    "percentile",
    "plot_serve",
    "run_serve_benchmark",
    "serve_table",
    "server_env",
    "served_variants",
    "cb_num_blocks",
    "CB_PAGE_TOKENS",
]

#: files of an exported directory that only Focus reads (left out of the dense variant)
FOCUS_ONLY = (CONFIG_NAME, WEIGHTS_NAME, REMOTE_CODE_NAME, "config.json", "README.md")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _linked_copy(export: Path, out: Path, skip: tuple[str, ...]) -> None:
    """``out`` holding symbolic links to the files of ``export`` but ``skip`` (a directory
    of that name left by an earlier run is replaced)."""
    if out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for path in export.iterdir():
        if path.is_file() and path.name not in skip:
            (out / path.name).symlink_to(path.resolve())


def served_variants(export: Path, top_ks: tuple[int | None, ...], dense: bool, work: Path,
                    settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The directories served: the export at each ``top_k`` (None: its own) with the
    inference ``settings`` (``config.json`` keys, such as ``attention_backend``) over its
    own (the export itself where nothing changes, else a directory of links to its files
    with ``config.json`` changed) and, with ``dense``, the dense base model (links to the
    same weights, ``config.json`` the base model's own).
    Returns ``[{"method": "focus" | "dense", "top_k", "directory"}]``."""
    doc = json.loads((export / "config.json").read_text(encoding="utf-8"))
    changed = with_settings(doc, settings or {})
    variants = []
    for k in top_ks:
        served = changed if k is None else with_settings(changed, {"top_k": k})
        top_k = exported_settings(served).get("top_k")
        if any(v["top_k"] == top_k for v in variants):
            continue  # each top_k once (None is the export's own)
        if served == doc:
            variants.append({"method": "focus", "top_k": top_k, "directory": export})
            continue
        out = work / f"focus-top{top_k}"
        _linked_copy(export, out, ("config.json",))
        (out / "config.json").write_text(json.dumps(served, indent=2), encoding="utf-8")
        variants.append({"method": "focus", "top_k": top_k, "directory": out})
    if dense:
        out = work / "dense"
        _linked_copy(export, out, FOCUS_ONLY)
        base = doc[BASE_CONFIG_KEY]
        (out / "config.json").write_text(json.dumps(base, indent=2), encoding="utf-8")
        variants.append({"method": "dense", "top_k": None, "directory": out})
    return variants


def prompts(config: ServeBenchConfig, tokenizer: Any, length: int, count: int) -> list[str]:
    """``count`` prompts of ``length`` tokens: consecutive, distinct stretches of the corpus
    split (repeated when it is shorter than their total), decoded to text."""
    text = "\n\n".join(load_corpus(config.corpus, quiet=True).texts(config.split))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    need = length * count
    ids = ids * (-(-need // len(ids)))
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(count)]


async def _one_request(client: Any, url: str, body: dict, start: float) -> dict[str, Any]:
    """One streaming completion: its time to first token, latency (seconds from ``start``,
    when every request of the cell was released), tokens, and error if any."""
    record: dict[str, Any] = {"ttft_s": None, "latency_s": None, "tokens": 0, "error": None}
    finished = False
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return record
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                record["error"] = str(event["error"])[:200]
                return record
            if event.get("usage"):
                record["tokens"] = event["usage"]["completion_tokens"]
                record["prompt_tokens"] = event["usage"]["prompt_tokens"]
            for choice in event.get("choices", []):
                if choice.get("text") and record["ttft_s"] is None:
                    record["ttft_s"] = time.perf_counter() - start
                finished = finished or choice.get("finish_reason") is not None
    record["latency_s"] = time.perf_counter() - start
    if not finished:
        record["error"] = "the stream ended without a finish reason"
    return record


async def _cell(server: ServedModel, texts: list[str], config: ServeBenchConfig,
                concurrency: int) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """Send ``texts`` as completion requests, ``concurrency`` at a time, within
    ``config.cell_timeout`` seconds. Returns each request's record and the wall seconds."""
    import httpx  # optional: the serve extra

    gate = asyncio.Semaphore(concurrency)
    url = server.url + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency)
    timeout = httpx.Timeout(config.cell_timeout, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def send(text: str) -> dict[str, Any]:
            body = {"model": server.model, "prompt": text, "max_tokens": config.max_new_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            async with gate:
                try:
                    return await _one_request(client, url, body, start)
                except (httpx.HTTPError, json.JSONDecodeError) as err:
                    return {"ttft_s": None, "latency_s": None, "tokens": 0,
                            "error": f"{type(err).__name__}: {err}"[:200]}  # fmt: skip

        tasks = [asyncio.ensure_future(send(t)) for t in texts]
        done, pending = await asyncio.wait(tasks, timeout=config.cell_timeout)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - start
    timed_out = {"ttft_s": None, "latency_s": None, "tokens": 0, "error": "cell timeout"}
    return [t.result() if t in done else dict(timed_out) for t in tasks], wall


def cell_row(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """The summary of one cell: answered/sent, errors by message, generated tokens per
    second of wall time, TTFT and latency p50/p99 of the answered requests (seconds)."""
    ok = [r for r in records if r["error"] is None]
    errors: dict[str, int] = {}
    for r in records:
        if r["error"] is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    latency = [r["latency_s"] for r in ok]
    prompt_tokens = [r["prompt_tokens"] for r in ok if "prompt_tokens" in r]
    return {
        "sent": len(records),
        "answered": len(ok),
        "errors": errors,
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else None,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
    }


def _export_for(config: ServeBenchConfig, work: Path) -> Path:
    """The exported directory served: ``config.export``, or ``config.model`` with
    ``config.adapter`` exported into ``work`` (with the adapter overrides of ``config``
    but ``top_k``, which each variant sets)."""
    if config.export:
        return Path(config.export)
    overrides = config.overrides(without=("top_k",))
    out = work / "export"
    export_adapter(ExportConfig(model=config.model, adapter=config.adapter, out=str(out),
                                **overrides))  # fmt: skip
    return out


def _warm_up(server: ServedModel, texts: dict[int, list[str]], config: ServeBenchConfig) -> float:
    """Send ``config.warmup`` requests of each prompt length to ``server``, one at a time,
    before any cell (not counted; the last prompts of ``texts``, which no cell sends).
    Returns the seconds it took.

    Raises:
        RuntimeError: a warm-up request was not answered (with the end of the server's log).
    """
    started = time.perf_counter()
    for length, batch in texts.items():
        for text in batch[len(batch) - config.warmup :]:
            (record,), _ = asyncio.run(_cell(server, [text], config, 1))
            if record["error"] is not None:
                raise RuntimeError(f"the warm-up request of {length} tokens failed: "
                                   f"{record['error']}\n{server.log_tail()}")  # fmt: skip
    return time.perf_counter() - started


def variant_name(variant: dict[str, Any]) -> str:
    """``focus-top{k}`` or ``dense``: a served variant's name in logs and file names."""
    return f"{variant['method']}-top{variant['top_k']}" if variant["method"] == "focus" else "dense"


def server_env() -> dict[str, str]:
    """Environment of the servers: ``USE_HUB_KERNELS=0`` unless it is set. transformers
    otherwise replaces layers of a model loaded on CUDA by kernels it fetches from the Hub
    when the ``kernels`` package is installed, which fails offline and would time
    different code than the model's own."""
    return {"USE_HUB_KERNELS": os.environ.get("USE_HUB_KERNELS", "0")}


#: tokens per block of transformers' continuous-batching KV cache (its default page size)
CB_PAGE_TOKENS = 256
#: tokens a served request may hold beyond its prompt and new tokens (special tokens)
CB_SLACK_TOKENS = 16


def cb_num_blocks(config: ServeBenchConfig) -> int:
    """``--cb-num-blocks`` of each continuous-batching server: room for the largest
    concurrency's requests at the longest prompt, all at once, and a few blocks more.
    Sized from the cells rather than from the memory free when a server starts (what
    ``transformers serve`` does by default): servers that start together each took most of
    the memory, and one that got less stalled with a full cache."""
    per_request = max(config.lengths) + config.max_new_tokens + CB_SLACK_TOKENS
    return max(config.concurrency) * math.ceil(per_request / CB_PAGE_TOKENS) + 8


def _start_servers(variants: list[dict[str, Any]], config: ServeBenchConfig, work: Path,
                   stack: contextlib.ExitStack) -> list[tuple[ServedModel, float]]:  # fmt: skip
    """Start a server per variant at once (they load together), each stopped when ``stack``
    closes; wait until each answers. Returns (server, seconds from the common start until
    it answered)."""
    extra: tuple[str, ...] = ()
    if config.continuous_batching:
        extra = ("--continuous-batching", "--cb-num-blocks", str(cb_num_blocks(config)))
    extra += ("--dtype", config.dtype) if config.dtype else ()
    servers = []
    for variant in variants:
        server = ServedModel(variant["directory"], work / f"{variant_name(variant)}.log",
                             device=config.device or "auto", extra=extra,
                             ready_timeout=config.ready_timeout, env=server_env())  # fmt: skip
        stack.callback(server.stop)
        server.start()
        servers.append(server)
    started = time.perf_counter()
    ready = []
    for server in servers:
        server.wait_ready()
        ready.append((server, time.perf_counter() - started))
    return ready


def _run_cells(variants: list[dict[str, Any]], config: ServeBenchConfig, work: Path,
               texts: dict[int, list[str]], log: Any, on_row: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Serve every variant at once and run the cells: for each concurrency and prompt
    length, each variant in turn (so every variant meets the machine in the same state and
    an interrupted run holds all of them for the cells it reached). ``on_row(rows)`` after
    each cell."""
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = _start_servers(variants, config, work, stack)
        warmups = [_warm_up(server, texts, config) for server, _ in servers]
        for concurrency in config.concurrency:
            for length in config.lengths:
                for variant, (server, ready_s), warmup_s in zip(variants, servers, warmups, strict=True):  # fmt: skip
                    count = config.requests or concurrency
                    records, wall = asyncio.run(_cell(server, texts[length][:count], config, concurrency))  # fmt: skip
                    row = {"method": variant["method"], "top_k": variant["top_k"],
                           "concurrency": concurrency, "prompt_tokens": length,
                           **cell_row(records, wall), "server_ready_s": ready_s,
                           "warmup_s": warmup_s}  # fmt: skip
                    log(f"{variant_name(variant)} concurrency={concurrency} N={length}: "
                        f"answered {row['answered']}/{row['sent']}, "
                        f"{row['tokens_per_second'] or 0:.2f} tokens/s, TTFT p50 "
                        f"{row['ttft_p50_s']}, latency p99 {row['latency_p99_s']}")  # fmt: skip
                    rows.append(row)
                    on_row(rows)
                    if not server.alive():
                        raise RuntimeError(f"the server of {variant_name(variant)} stopped:\n"
                                           f"{server.log_tail()}")  # fmt: skip
    return rows


def _record(config: ServeBenchConfig) -> dict[str, Any]:
    """The settings part of a serving result."""
    return {
        "model": config.model,
        "adapter": config.adapter,
        "export": config.export,
        "routers": routers_record(config.adapter or config.export),
        "corpus": config.corpus,
        "split": config.split,
        "lengths": list(config.lengths),
        "concurrency": list(config.concurrency),
        "requests_per_cell": config.requests,
        "max_new_tokens": config.max_new_tokens,
        "top_ks": list(config.top_k or ()),
        "overrides": config.overrides(without=("top_k",)),
        "dense": config.dense,
        "device": config.device or "auto",
        "continuous_batching": config.continuous_batching,
        "cb_num_blocks": cb_num_blocks(config) if config.continuous_batching else None,
        "dtype": config.dtype,
        "warmup_requests_per_length": config.warmup,
        "cell_timeout_s": config.cell_timeout,
        "server": "transformers serve (127.0.0.1), /v1/completions, stream, temperature 0; "
        "every variant served at once, the cells taken in turn",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "server_env": server_env(),
    }


def run_serve_benchmark(config: ServeBenchConfig, log: Any = print,
                        checkpoint: Any = None) -> dict[str, Any]:  # fmt: skip
    """Serve Focus (each ``top_k``) and, with ``config.dense``, the dense base model with
    ``transformers serve`` on 127.0.0.1, all at once, warm each up (``config.warmup``
    requests per length, not counted), then send each cell (a concurrency and a prompt
    length) to each served model in turn: streaming completions, greedy,
    ``max_new_tokens`` each, prompts of the corpus split (the same prompts for every
    variant). A server answers while the others wait idle.

    Args:
        checkpoint: called after every cell with the result so far (``"complete": False``),
            so that an interrupted run keeps the cells it finished.

    Returns:
        ``{"benchmark": "serve", "complete": True, "config", "environment", "rows"}``: per
        (method, top_k, concurrency, prompt_tokens) the requests sent and answered (errors
        by message), generated tokens per second of wall time, TTFT and latency p50/p99
        (seconds, from the cell's start: queueing included).

    Raises:
        RuntimeError: a server did not start, failed a warm-up request, or stopped during
            its cells.
        ValueError, FileNotFoundError: as ``focus export`` raises them.
    """
    work_root = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="focus-serve-"))  # fmt: skip
    work_root.mkdir(parents=True, exist_ok=True)
    record, env = _record(config), environment()

    def result(rows: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        return {"benchmark": "serve", "complete": complete, "config": record,
                "environment": env, "rows": list(rows)}  # fmt: skip

    def on_row(rows: list[dict[str, Any]]) -> None:
        if checkpoint is not None:
            checkpoint(result(rows, False))

    try:
        export = _export_for(config, work_root)
        tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
        count = (config.requests or max(config.concurrency)) + config.warmup
        texts = {n: prompts(config, tokenizer, n, count) for n in config.lengths}
        settings = {k: v for k, v in config.overrides(without=("top_k",)).items() if v is not None}  # fmt: skip
        variants = served_variants(export, config.top_k or (None,), config.dense, work_root,
                                   settings)  # fmt: skip
        rows = _run_cells(variants, config, work_root, texts, log, on_row)
    finally:
        if not config.work_dir:
            shutil.rmtree(work_root, ignore_errors=True)
    return result(rows, True)


def serve_table(result: dict[str, Any]) -> str:
    """Markdown table of a serving benchmark result."""
    lines = [
        "| served | concurrency | prompt tokens | answered | tokens/s | TTFT p50 s | TTFT p99 s | latency p50 s | latency p99 s |",  # fmt: skip
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in result["rows"]:
        name = f"focus top_k={r['top_k']}" if r["method"] == "focus" else "dense"
        lines.append(
            f"| {name} | {r['concurrency']} | {r['prompt_tokens']} | {r['answered']}/{r['sent']} "
            f"| {num(r['tokens_per_second'])} | {num(r['ttft_p50_s'])} | {num(r['ttft_p99_s'])} "
            f"| {num(r['latency_p50_s'])} | {num(r['latency_p99_s'])} |"
        )
    return "\n".join(lines)


def plot_serve(result: dict[str, Any], path: str) -> None:
    """Tokens per second, TTFT p50 and latency p99 against the prompt length, one line per
    (served model, concurrency); written to ``path`` (:func:`~focus_attention.utils.plots.save_png`)."""
    import matplotlib  # heavy: imported only to draw a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    panels = (("tokens_per_second", "generated tokens / s"), ("ttft_p50_s", "TTFT p50 (s)"),
              ("latency_p99_s", "latency p99 (s)"))  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        name = f"top_k={r['top_k']}" if r["method"] == "focus" else "dense"
        series.setdefault(f"{name}, {r['concurrency']} concurrent", []).append(r)
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        for name, rows in series.items():
            points = [(r["prompt_tokens"], r[key]) for r in rows if r[key] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set(xlabel="prompt tokens", ylabel=label, xscale="log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"transformers serve: {result['config']['model']}", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
