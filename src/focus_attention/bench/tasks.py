"""``focus bench tasks``: zero-shot benchmarks through lm-evaluation-harness (docs/method.md
§9), for a dense model or a Focus adapter, in one JSON.

The model is :class:`focus_attention.bench.harness.FocusLM` (lm-eval's ``HFLM`` with the
adapter attached) and the tasks are lm-eval's own task definitions reading the local data
(:func:`focus_attention.bench.harness.task_directory`): HellaSwag, ARC-Easy, ARC-Challenge
(validation splits), PIQA, WinoGrande (acc and acc_norm where lm-eval reports it) and
LAMBADA OpenAI (perplexity and acc), zero-shot. ``--limit N`` scores the first N examples
of each task (lm-eval's ``limit``). Besides lm-eval's metrics the result records, per task,
the scored tokens and the share of them whose context exceeds the local window (only those
can differ from dense attention). Needs the ``bench`` extra (lm-eval).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch

from ..assets.benchmarks import BENCHMARK_SOURCE, BENCHMARKS
from ..hf.run_folder import run_parts
from ..utils.env import RESULT_DISTRIBUTIONS, environment, library_versions
from .settings import TasksBenchConfig

__all__ = ["TASK_METRICS", "TasksBenchConfig", "load_harness", "run_tasks_benchmark", "tasks_table"]

#: the metrics reported per task, in table order (lm-eval's names)
TASK_METRICS = ("acc", "acc_norm", "perplexity")
#: the distributions a tasks result records on top of the usual ones
_HARNESS_DISTRIBUTIONS = ("lm_eval", "datasets")


def load_harness() -> Any:
    """The :mod:`focus_attention.bench.harness` module (which registers the lm-eval model).

    Raises:
        RuntimeError: lm-eval is not installed (the message says how to install it).
    """
    try:
        from . import harness  # optional: needs lm-eval, the bench extra
    except ImportError as err:
        if "lm_eval" not in str(err):
            raise
        raise RuntimeError(
            "focus bench tasks needs lm-evaluation-harness: pip install 'focus-attention[bench]' "
            "(installs lm-eval==0.4.13)"
        ) from err
    return harness


def run_tasks_benchmark(config: TasksBenchConfig) -> dict[str, Any]:
    """Evaluate the model on ``config.tasks`` with lm-eval (module docstring).

    Returns:
        JSON-able dict: ``config``; ``model`` (base, adapter, the Focus settings used or None
        for dense); ``tasks`` (per task: lm-eval's metrics and stderrs, examples scored and
        in the split, the split, lm-eval's task version, and ``tokens``: scored tokens,
        mean / max context, ``beyond_window_share`` and ``routed_share``);
        ``per_example``: each scored example's ``doc_id`` and metric values, for paired
        comparisons between models); ``data`` (source package); ``seconds``; ``versions``;
        ``environment``; with ``log_samples``, lm-eval's full ``samples``.

    Raises:
        RuntimeError: lm-eval is not installed, or the data could not be prepared.
        ValueError: the errors of loading the model or the adapter.
    """
    harness = load_harness()
    import lm_eval  # optional: the bench extra, found installed by load_harness
    from lm_eval.tasks import TaskManager  # optional: as lm_eval

    if config.threads:
        torch.set_num_threads(config.threads)
    lm = harness.FocusLM(
        pretrained=config.model,
        adapter=config.adapter,
        top_k=config.top_k,
        window=config.window,
        batch_size=config.batch_size,
        device=config.device,
    )
    manager = TaskManager(
        include_path=str(harness.task_directory(config.tasks)), include_defaults=False
    )
    start = time.monotonic()
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(config.tasks),
        limit=config.limit,
        task_manager=manager,
        bootstrap_iters=config.bootstrap_iters,
        log_samples=True,  # the per-example scores of the result come from the samples
    )
    seconds = time.monotonic() - start
    return _result(config, lm, out, seconds)


def _task_entry(name: str, out: dict[str, Any], tokens: dict[str, Any]) -> dict[str, Any]:
    """One task of the result: metrics (``name`` and ``name_stderr``), counts, version."""
    raw = out["results"][name]
    metrics = {}
    for metric in TASK_METRICS:
        if f"{metric},none" in raw:
            metrics[metric] = raw[f"{metric},none"]
            stderr = raw.get(f"{metric}_stderr,none")
            metrics[f"{metric}_stderr"] = stderr if isinstance(stderr, (int, float)) else None
    counts = out.get("n-samples", {}).get(name, {})
    samples = sorted(out.get("samples", {}).get(name, []), key=lambda x: x["doc_id"])
    per_example: dict[str, list] = {"doc_id": [x["doc_id"] for x in samples]}
    for metric in TASK_METRICS:  # lm-eval's per-example value of "perplexity" is a loglikelihood
        key = "loglikelihood" if metric == "perplexity" else metric
        if samples and metric in samples[0]:
            per_example[key] = [float(x[metric]) for x in samples]
    return {
        "metrics": metrics,
        "examples": counts.get("effective"),
        "examples_in_split": counts.get("original"),
        "split": BENCHMARKS[name].split,
        "lm_eval_task_version": out.get("versions", {}).get(name),
        "tokens": tokens.get(name),
        "per_example": per_example,
    }


def _result(config: TasksBenchConfig, lm: Any, out: dict[str, Any], seconds: float) -> dict[str, Any]:  # fmt: skip
    """The JSON-able result of one evaluation (see :func:`run_tasks_benchmark`)."""
    focus = lm.focus_config
    tokens = lm.token_statistics()
    result = {
        "config": asdict(config),
        "model": {
            "base": config.model,
            "adapter": config.adapter,
            "parts": None if config.adapter is None else run_parts(config.adapter),
            "mode": "dense" if focus is None else f"focus top-{focus.top_k}",
            "focus": None
            if focus is None
            else {**asdict(focus), "layers": len(focus.layers or ())},
            "max_length": lm.max_length,
            "batch_size": config.batch_size,
        },  # fmt: skip
        "tasks": {name: _task_entry(name, out, tokens) for name in config.tasks},
        "data": {"package": "{}=={}".format(*BENCHMARK_SOURCE), "num_fewshot": 0},
        "seconds": seconds,
        "versions": library_versions((*RESULT_DISTRIBUTIONS, *_HARNESS_DISTRIBUTIONS)),
        "environment": environment(),
    }
    if config.log_samples:
        result["samples"] = out.get("samples", {})
    return result


def _cell(metrics: dict[str, Any], name: str) -> str:
    if name not in metrics:
        return "-"
    value, stderr = metrics[name], metrics.get(f"{name}_stderr")
    scale, digits = (1.0, 2) if name == "perplexity" else (100.0, 1)
    text = f"{value * scale:.{digits}f}"
    return text if stderr is None else f"{text} ± {stderr * scale:.{digits}f}"


def tasks_table(result: dict[str, Any]) -> str:
    """A markdown table of one result: a row per task with accuracy and normalised accuracy
    in percent and LAMBADA's perplexity (each ± its standard error), the scored tokens, their
    mean context and the shares beyond the window (``-`` for a dense model)."""
    model = result["model"]
    focus = model["focus"]
    where = "" if focus is None else f" (window {focus['window']}, {focus['sink_tokens']} sink tokens)"  # fmt: skip
    lines = [
        f"{model['base']} {model['mode']}{where}, zero-shot, lm-eval",
        "",
        "| task | examples | acc % | acc_norm % | perplexity | scored tokens | mean context | beyond window | routed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, entry in result["tasks"].items():
        m, tok = entry["metrics"], entry["tokens"] or {}
        shares = [tok.get(k) for k in ("beyond_window_share", "routed_share")]
        shown = ["-" if s is None else f"{100 * s:.1f}%" for s in shares]
        lines.append(
            f"| {name} | {entry['examples']} | {_cell(m, 'acc')} | {_cell(m, 'acc_norm')} | "
            f"{_cell(m, 'perplexity')} | {tok.get('scored_tokens', 0)} | "
            f"{tok.get('mean_context', 0):.1f} | {shown[0]} | {shown[1]} |"
        )
    return "\n".join(lines)
