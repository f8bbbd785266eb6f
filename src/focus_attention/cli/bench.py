"""``focus bench kernel|model|decode|needle|retrieval-layers|tasks|instructions|serve``: benchmarks that write JSON (:mod:`focus_attention.bench`); ``focus bench merge|plot``: their result files merged and plotted."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bench.settings import (
    DecodeBenchConfig,
    InstructionsBenchConfig,
    KernelBenchConfig,
    MergeResultsConfig,
    ModelBenchConfig,
    NeedleBenchConfig,
    PlotResultsConfig,
    RetrievalLayersConfig,
    ServeBenchConfig,
    TasksBenchConfig,
)
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _config(args: argparse.Namespace, cls: type, required: tuple[str, ...] = ()) -> Any:
    """The settings of ``focus bench NAME``: defaults, table ``[bench.NAME]`` of
    ``--config``, then the flags (``required``: fields one of them must give)."""
    return command_config(args, cls, f"bench.{args.bench_command}", required=required)


def _outputs(config: Any, plotted: bool = False) -> str | None:
    """Check, before the run, that ``config.json`` and (for a benchmark that plots) the plot
    can be written. Returns the plot's path: ``config.plot``, else the JSON path with
    ``.png``; None without either or for a benchmark that does not plot.

    Raises:
        ValueError: a path that cannot be written (a directory, a file in place of a folder,
            a folder that refuses new files), or a plot that would replace the JSON.
    """
    from ..utils.io import check_output_file

    if config.json:
        check_output_file(config.json, "--json")
    if not plotted:
        return None
    plot = config.plot or (str(Path(config.json).with_suffix(".png")) if config.json else None)
    if plot:
        check_output_file(plot, "--plot")
        if config.json and Path(plot).resolve() == Path(config.json).resolve():
            raise ValueError(f"--plot: received {plot!r}, the --json path; expected another "
                             "file (give --plot, or a --json path that does not end in .png)")  # fmt: skip
    return plot


def _write(result: dict, config: Any, plot: str | None = None, plot_fn: Callable | None = None) -> None:  # fmt: skip
    """The result to ``config.json`` and, with ``plot_fn``, a PNG plot to ``plot``
    (:func:`_outputs`)."""
    from ..utils.io import write_json_atomic

    if config.json:
        write_json_atomic(config.json, result)
        print(f"wrote {config.json}")
    if plot_fn is not None and plot:
        plot_fn(result, plot)
        print(f"wrote {plot}")


def _kernel(args: argparse.Namespace) -> int:
    from ..bench.kernel import gate_lines, kernel_table, plot_kernel, run_kernel_benchmark

    config = _config(args, KernelBenchConfig)
    plot = _outputs(config, plotted=True)
    _set_threads(config.threads)
    result = run_kernel_benchmark(config)
    print(kernel_table(result))
    for line in gate_lines(result):
        print(line)
    _write(result, config, plot, plot_kernel)
    return 0


def _model(args: argparse.Namespace) -> int:
    from ..bench.model import model_table, plot_model, run_model_benchmark

    config = _config(args, ModelBenchConfig)
    plot = _outputs(config, plotted=True)
    _set_threads(config.threads)
    result = run_model_benchmark(config)
    print(model_table(result))
    _write(result, config, plot, plot_model)
    return 0


def _decode(args: argparse.Namespace) -> int:
    from ..bench.decode import decode_table, plot_decode, run_decode_benchmark

    config = _config(args, DecodeBenchConfig)
    plot = _outputs(config, plotted=True)
    result = run_decode_benchmark(config)
    print(decode_table(result))
    _write(result, config, plot, plot_decode)
    return 0


#: the fields ``focus bench merge`` and ``focus bench plot`` need given
MERGE_REQUIRED = ("results", "json")
PLOT_REQUIRED = ("results",)


def _merge(args: argparse.Namespace) -> int:
    from ..bench.results import merge_results
    from ..utils.io import read_json_file

    config = _config(args, MergeResultsConfig, MERGE_REQUIRED)
    _outputs(config)
    merged = merge_results([read_json_file(path, "a benchmark's JSON result") for path in config.results])  # fmt: skip
    _write(merged, config)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from ..bench.results import plot_result_file

    config = _config(args, PlotResultsConfig, PLOT_REQUIRED)
    for path in config.results:
        for written in plot_result_file(path, config.out):
            print(f"wrote {written}")
    return 0


def _needle(args: argparse.Namespace) -> int:
    from ..bench.needle import needle_table, plot_needle, run_needle_benchmark

    config = _config(args, NeedleBenchConfig)
    plot = _outputs(config, plotted=True)
    result = run_needle_benchmark(config, checkpoint=_checkpoint(config))
    print(needle_table(result))
    _write(result, config, plot, plot_needle)
    return 0


def _retrieval_layers(args: argparse.Namespace) -> int:
    from ..bench.needle import rank_retrieval_layers, retrieval_layers_table

    config = _config(args, RetrievalLayersConfig)
    _outputs(config)
    result = rank_retrieval_layers(config)
    print(retrieval_layers_table(result))
    _write(result, config)
    return 0


def _tasks(args: argparse.Namespace) -> int:
    from ..bench.tasks import run_tasks_benchmark, tasks_table

    config = _config(args, TasksBenchConfig)
    _outputs(config)
    result = run_tasks_benchmark(config)
    print(tasks_table(result))
    _write(result, config)
    return 0


def _instructions(args: argparse.Namespace) -> int:
    from ..bench.instructions import instructions_table, run_instructions_benchmark

    config = _config(args, InstructionsBenchConfig)
    _outputs(config)
    result = run_instructions_benchmark(config)
    print(instructions_table(result))
    _write(result, config)
    return 0


def _checkpoint(config: Any) -> Callable[[dict], None]:
    """What a long benchmark calls with its result so far: rewrites ``config.json`` (if any),
    so that an interrupted run keeps what it measured."""
    from ..utils.io import write_json_atomic

    def checkpoint(partial: dict) -> None:
        if config.json:
            write_json_atomic(config.json, partial)

    return checkpoint


def _serve(args: argparse.Namespace) -> int:
    from ..bench.serve import plot_serve, run_serve_benchmark, serve_table

    config = _config(args, ServeBenchConfig)
    plot = _outputs(config, plotted=True)
    result = run_serve_benchmark(config, checkpoint=_checkpoint(config))
    print(serve_table(result))
    _write(result, config, plot, plot_serve)
    return 0


def _add_benchmark(sub: Any, name: str, config: type, run: Callable, required: tuple[str, ...] = (), **text: str) -> None:  # fmt: skip
    """One ``focus bench NAME`` sub-command: ``--config`` (table ``[bench.NAME]``) and the
    flags of ``config`` (those in ``required`` said to be)."""
    parser = sub.add_parser(name, **text)
    add_config_flag(parser, f"bench.{name}")
    add_flags(parser, config, required=required)
    parser.set_defaults(func=run_guarded(run))


#: the ``focus bench`` sub-commands: name -> (settings class, run function, flags that
#: must be given, help, description)
SUBCOMMANDS: dict[str, tuple[type, Callable, tuple[str, ...], str, str]] = {
    "kernel": (
        KernelBenchConfig, _kernel, (),
        "sparse_attention against dense causal SDPA (SmolLM2-135M attention shape)",
        "Times dense torch SDPA (is_causal) against focus sparse_attention in "
        "one process, fp32, B=1, and reports speedup, density, ideal speedup (1/density), "
        "efficiency and peak memory.",
    ),
    "model": (
        ModelBenchConfig, _model, (),
        "end-to-end prefill of a model: stock sdpa against Focus top-k and no attention",
        "Times a prefill forward (logits for the last token only) of the model "
        "on the first N tokens of the corpus's test split (seeded random ids for a "
        "random:PRESET model, built with random weights in that shape), with the stock sdpa "
        "attention, without attention (the floor no attention kernel can go below) and with "
        "Focus hard top-k routing, in one run on --device in --dtype; reports each row's "
        "speed-up and the share of the floor's it reaches. Needs the prepared assets (focus "
        "setup) unless the model is random:PRESET.",
    ),
    "decode": (
        DecodeBenchConfig, _decode, (),
        "one decoding step with a KV cache: dense against Focus top-k, op and model level",
        "Times single-token decoding steps of --batch-size requests with N "
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
    "needle": (
        NeedleBenchConfig, _needle, (),
        "retrieval of a number hidden in a long prompt: dense against Focus top-k",
        "Hides a 5-digit number at each depth of prompts of each length (a "
        "repeated filler paragraph, or held-out book text), asks for it at the end, and "
        "scores the greedy answer exactly, for the dense model and Focus at every top_k. "
        "Needs the prepared assets (focus setup) and a trained adapter.",
    ),
    "retrieval-layers": (
        RetrievalLayersConfig, _retrieval_layers, (),
        "rank the layers that retrieve from far back (candidates for --dense-layers)",
        "Builds needle prompts as focus bench needle does, from the validation "
        "split by default, and ranks the Focus layers by the share of attention the dense "
        "model's strongest head of the last query gives the needle. The top --count layers "
        "are the suggested FocusConfig.dense_layers (--dense-layers of focus eval and the "
        "benchmarks): layers that keep dense attention so that retrieval survives.",
    ),
    "tasks": (
        TasksBenchConfig, _tasks, (),
        "zero-shot benchmarks through lm-evaluation-harness: dense or a Focus adapter",
        "Scores HellaSwag, ARC-Easy, ARC-Challenge, PIQA, WinoGrande and LAMBADA "
        "(OpenAI) zero-shot with lm-eval's own task definitions on the local benchmark data "
        "(prepared on first use, or with `focus data prepare zero-shot`), for the dense model "
        "or a Focus adapter (optionally with another top_k or window), and reports per task "
        "the share of scored tokens whose context exceeds the window. Needs the bench extra "
        "(lm-eval).",
    ),
    "instructions": (
        InstructionsBenchConfig, _instructions, (),
        "instruction following (IFEval-style) and KL drift: untouched model or Focus",
        "Answers a fixed, seeded set of chat prompts (ARC questions and held-out "
        "book passages, each with one or two IFEval instructions) greedily with the untouched "
        "model and, with --adapter, with Focus hard top-k routing at each --top-k and "
        "--window; scores them strict and loose with IFEval's checkers (if-verifiable) and "
        "measures the KL divergence from the untouched model on its own responses. Needs "
        "the prepared assets (focus setup).",
    ),
    "serve": (
        ServeBenchConfig, _serve, (),
        "a Focus model served by transformers serve under load, against dense served alike",
        "Exports --model with --adapter (or takes an exported directory, --export), "
        "serves it with transformers serve on 127.0.0.1 at each --top-k and (--dense, the default) the "
        "dense base model the same way (all served at once), and sends each cell (a "
        "--concurrency and a prompt length of --lengths) its streaming completion requests, "
        "prompts drawn from the corpus split. Reports per cell the requests answered of those "
        "sent, generated tokens per second, time to first token and latency p50/p99; writes "
        "JSON and a plot. Needs the serve extra and the prepared assets (focus setup).",
    ),
    "merge": (
        MergeResultsConfig, _merge, MERGE_REQUIRED,
        "merge result files of one benchmark into one JSON file",
        "Reads JSON results of one benchmark (kernel, model, decode, ...) and "
        "writes them, in order, as the parts of one result file, with the versions and "
        "hardware of the first at its top; focus bench plot draws each part.",
    ),
    "plot": (
        PlotResultsConfig, _plot, PLOT_REQUIRED,
        "plot result files of focus bench kernel, model, decode, needle or serve",
        "Draws each result a JSON file holds (one, or the parts of a merged file) "
        "as a PNG beside it or in --out: speed-up against length beside the ideal for the "
        "kernel, prefill and decoding benchmarks.",
    ),
}  # fmt: skip


def register_cli(subparsers: Any) -> None:
    """Add ``focus bench`` and its sub-commands (:data:`SUBCOMMANDS`)."""
    bench = subparsers.add_parser("bench", help=summary("bench"))
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name, (config, run, required, text, description) in SUBCOMMANDS.items():
        _add_benchmark(sub, name, config, run, required, help=text, description=description)
