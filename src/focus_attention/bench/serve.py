"""``focus bench serve``: a Focus model served over HTTP by ``transformers serve`` under load,
against the dense base model served the same way (docs/deploy.md). Requests go to 127.0.0.1
only, bounded in count (``requests`` per cell) and time (``cell_timeout`` per cell)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..deploy.serve import ServedModel
from ..deploy.settings import BASE_CONFIG_KEY, REMOTE_CODE_NAME
from ..hf.files import CONFIG_NAME, WEIGHTS_NAME
from ..utils.env import environment
from .model import routers_record
from .settings import ServeBenchConfig

__all__ = [
    "ServeBenchConfig",
    "percentile",
    "plot_serve",
    "run_serve_benchmark",
    "serve_table",
    "served_variants",
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
    """``out`` holding symbolic links to the files of ``export`` but ``skip``."""
    out.mkdir(parents=True)
    for path in export.iterdir():
        if path.is_file() and path.name not in skip:
            (out / path.name).symlink_to(path.resolve())


def served_variants(export: Path, top_ks: tuple[int | None, ...], dense: bool,
                    work: Path) -> list[dict[str, Any]]:  # fmt: skip
    """The directories served: the export at each ``top_k`` (None: its own; a directory of
    links to its files with ``config.json``'s ``top_k`` changed) and, with ``dense``, the
    dense base model (links to the same weights, ``config.json`` the base model's own).
    Returns ``[{"method": "focus" | "dense", "top_k", "directory"}]``."""
    doc = json.loads((export / "config.json").read_text(encoding="utf-8"))
    variants = []
    for k in top_ks:
        if k is None or k == doc.get("top_k"):
            variants.append({"method": "focus", "top_k": doc.get("top_k"), "directory": export})
            continue
        out = work / f"focus-top{k}"
        _linked_copy(export, out, ("config.json",))
        (out / "config.json").write_text(json.dumps({**doc, "top_k": k}, indent=2), encoding="utf-8")  # fmt: skip
        variants.append({"method": "focus", "top_k": k, "directory": out})
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
    from ..assets.corpora import load_corpus

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
    import httpx

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
    from ..deploy.export import export_adapter
    from ..deploy.settings import ExportConfig

    overrides = {k: v for k, v in config.overrides().items() if k != "top_k"}
    out = work / "export"
    export_adapter(ExportConfig(model=config.model, adapter=config.adapter, out=str(out),
                                **overrides))  # fmt: skip
    return out


def _serve_variant(variant: dict[str, Any], config: ServeBenchConfig, work: Path,
                   texts: dict[int, list[str]], log: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Serve one variant and run its cells (every concurrency and length)."""
    name = f"{variant['method']}-top{variant['top_k']}" if variant["method"] == "focus" else "dense"
    extra = ("--continuous-batching",) if config.continuous_batching else ()
    device = config.device or "auto"
    rows = []
    started = time.perf_counter()
    with ServedModel(variant["directory"], work / f"{name}.log", device=device, extra=extra,
                     ready_timeout=config.ready_timeout) as server:  # fmt: skip
        ready_s = time.perf_counter() - started
        for concurrency in config.concurrency:
            for length in config.lengths:
                count = config.requests or concurrency
                records, wall = asyncio.run(_cell(server, texts[length][:count], config, concurrency))  # fmt: skip
                row = {"method": variant["method"], "top_k": variant["top_k"],
                       "concurrency": concurrency, "prompt_tokens": length,
                       **cell_row(records, wall), "server_ready_s": ready_s}  # fmt: skip
                log(f"{name} concurrency={concurrency} N={length}: answered {row['answered']}"
                    f"/{row['sent']}, {row['tokens_per_second'] or 0:.2f} tokens/s, "
                    f"TTFT p50 {row['ttft_p50_s']}, latency p99 {row['latency_p99_s']}")  # fmt: skip
                rows.append(row)
            if not server.alive():
                raise RuntimeError(f"the server of {name} stopped:\n{server.log_tail()}")
    return rows


def run_serve_benchmark(config: ServeBenchConfig, log: Any = print) -> dict[str, Any]:
    """Serve Focus (each ``top_k``) and, with ``config.dense``, the dense base model with
    ``transformers serve`` on 127.0.0.1, one at a time, and send each cell (a concurrency
    and a prompt length) its requests: streaming completions, greedy, ``max_new_tokens``
    each, prompts of the corpus split (the same prompts for every variant).

    Returns:
        ``{"benchmark": "serve", "config", "environment", "rows"}``: per (method, top_k,
        concurrency, prompt_tokens) the requests sent and answered (errors by message),
        generated tokens per second of wall time, TTFT and latency p50/p99 (seconds, from
        the cell's start: queueing included).

    Raises:
        RuntimeError: a server did not start, or stopped during its cells.
        ValueError, FileNotFoundError: as ``focus export`` raises them.
    """
    from transformers import AutoTokenizer

    work_root = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="focus-serve-"))  # fmt: skip
    work_root.mkdir(parents=True, exist_ok=True)
    try:
        export = _export_for(config, work_root)
        tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
        count = config.requests or max(config.concurrency)
        texts = {n: prompts(config, tokenizer, n, count) for n in config.lengths}
        rows = []
        for variant in served_variants(export, config.top_k or (None,), config.dense, work_root):
            rows += _serve_variant(variant, config, work_root, texts, log)
    finally:
        if not config.work_dir:
            shutil.rmtree(work_root, ignore_errors=True)
    record = {
        "model": config.model,
        "adapter": config.adapter,
        "export": config.export,
        "routers": routers_record(config.adapter),
        "corpus": config.corpus,
        "split": config.split,
        "lengths": list(config.lengths),
        "concurrency": list(config.concurrency),
        "requests_per_cell": config.requests,
        "max_new_tokens": config.max_new_tokens,
        "top_ks": list(config.top_k or ()),
        "dense": config.dense,
        "device": config.device or "auto",
        "continuous_batching": config.continuous_batching,
        "cell_timeout_s": config.cell_timeout,
        "server": "transformers serve (127.0.0.1), /v1/completions, stream, temperature 0",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    return {"benchmark": "serve", "config": record, "environment": environment(), "rows": rows}


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
    (served model, concurrency); written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=110)
    plt.close(fig)
