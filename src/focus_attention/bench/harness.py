"""lm-evaluation-harness integration (docs/method.md §9): a Focus model is an lm-eval model,
and the zero-shot benchmarks are lm-eval's own tasks reading the local data.

* ``focus`` model: importing this module registers :class:`FocusLM` in lm-eval's model
  registry, a subclass of lm-eval's Hugging Face model ``HFLM`` (so batching, ``--limit``,
  request caching and output files are lm-eval's) that attaches a saved Focus adapter::

      focus lm-eval --model focus \\
          --model_args pretrained=smollm2-135m,adapter=runs/austen,top_k=2 \\
          --tasks hellaswag,lambada_openai --limit 100 --batch_size 8

  ``focus lm-eval ARGS`` (:func:`main`) is lm-eval's own command line (``lm_eval ARGS``)
  with the model registered and the local tasks on its include path (lm-eval 0.4.13 has no
  plugin entry point, so the plain ``lm_eval`` command cannot see a model registered by
  another package). From Python::

      import lm_eval
      from lm_eval.tasks import TaskManager
      from focus_attention.bench.harness import task_directory  # registers "focus"
      lm_eval.simple_evaluate(model="focus", model_args="pretrained=smollm2-135m,adapter=...",
                              tasks=["piqa"], task_manager=TaskManager(include_path=str(task_directory())))

* local tasks: :func:`task_directory` writes one YAML per benchmark of
  :data:`focus_attention.assets.benchmarks.BENCHMARKS` that ``include``\\ s lm-eval's
  installed task file (prompts, choices, metrics: acc and acc_norm; perplexity and acc for
  LAMBADA) and replaces only the data source (the prepared local file: ``dataset_path:
  arrow`` or ``json`` with ``dataset_kwargs.data_files``) and the splits (only the evaluated
  split exists locally; the ARC sets are evaluated on their validation split, lm-eval's
  default task uses test). The task names are lm-eval's; with lm-eval's own tasks also on the
  path, the local ones override them (lm-eval logs a line per task).

Scored tokens: :class:`FocusLM` records, per task, how many keys each scored token's
prediction attends to (its context length in the model input, after lm-eval's left
truncation). A prediction whose context is at most the window (plus the sink tokens) sees
every key, so Focus equals dense attention there by construction; :func:`token_statistics`
gives the share of scored tokens beyond the window.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lm_eval.evaluator
import lm_eval.tasks
import lm_eval.utils
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model
from lm_eval.config.evaluate_config import EvaluatorConfig
from lm_eval.loggers.utils import get_commit_from_path
from lm_eval.models.huggingface import HFLM
from transformers import AutoConfig, PreTrainedModel

from ..assets.benchmarks import BENCHMARKS, benchmark_files
from ..assets.models import DEFAULT_MODEL, prepare_model
from ..evaluation.positions import context_statistics
from ..hf import FocusConfig, FocusModel
from ..hf.run_folder import run_parts, tuned_model
from ..utils.io import atomic_write_text, focus_home

__all__ = [
    "DOCUMENTED_MODEL_ARGS",
    "LM_EVAL_TASK_FILES",
    "LOADING_ARGUMENTS",
    "MODEL_NAME",
    "FocusLM",
    "check_model_args",
    "git_hash",
    "lm_eval_tasks_root",
    "main",
    "merge_run_arguments",
    "scored_context_lengths",
    "task_directory",
    "token_statistics",
]

#: the name the model is registered under in lm-eval (``--model focus``)
MODEL_NAME = "focus"
#: lm-eval's task file of each benchmark, relative to the installed ``lm_eval/tasks``
LM_EVAL_TASK_FILES = {
    "hellaswag": "hellaswag/hellaswag.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
}


# ---------------------------------------------------------------------------------------------
# scored tokens
# ---------------------------------------------------------------------------------------------


def scored_context_lengths(context_len: int, continuation_len: int, max_length: int) -> range:
    """Context length (number of keys attended, the query included) of the prediction of
    each continuation token of one loglikelihood request, as lm-eval's ``HFLM`` feeds it:
    the input is ``(context + continuation)[-(max_length + 1):][:-1]`` and the ``k``-th
    continuation token is predicted at input position ``n_in - continuation_len + k``.

    Args:
        context_len, continuation_len: token counts of the encoded context and
            continuation (``continuation_len >= 1``).
        max_length: the model's maximum input length in tokens.

    Returns:
        ``range`` of the ``continuation_len`` context lengths, each in ``1..max_length``.

    Raises:
        ValueError: a count below its minimum.
    """
    if context_len < 0 or continuation_len < 1 or max_length < 1:
        raise ValueError(
            f"scored_context_lengths: received context_len={context_len}, continuation_len="
            f"{continuation_len}, max_length={max_length}; expected >= 0, >= 1 and >= 1"
        )
    n_in = min(context_len + continuation_len, max_length + 1) - 1
    first = n_in - continuation_len + 1
    return range(max(first, 1), n_in + 1)


def token_statistics(
    histogram: dict[int, int], window: int | None, sink_tokens: int = 0
) -> dict[str, Any]:
    """Summary of one task's scored tokens.

    Args:
        histogram: ``{context length: scored tokens}`` (see :func:`scored_context_lengths`).
        window: the Focus local window in tokens (None for a dense model: no shares).
        sink_tokens: the Focus sink tokens (visible to every query).

    Returns:
        ``scored_tokens``, ``mean_context`` and ``max_context`` (tokens), and with a window
        ``beyond_window_share`` (share of scored tokens whose context exceeds ``window``:
        they have keys outside the local window) and ``routed_share`` (context above
        ``window + sink_tokens``: the only predictions Focus can change; the others see
        every key).
    """
    stats = context_statistics(histogram, window, sink_tokens)
    return {"scored_tokens": stats.pop("tokens"), **stats}


# ---------------------------------------------------------------------------------------------
# the lm-eval model
# ---------------------------------------------------------------------------------------------

#: the arguments of ``FocusLM`` itself
FOCUS_ARGUMENTS = ("pretrained", "adapter", "top_k", "window", "device")
#: the ``--model_args`` keys ``focus lm-eval --help`` names (each one tested): FocusLM's own
#: and the most used of HFLM's and transformers' loading arguments
DOCUMENTED_MODEL_ARGS = (*FOCUS_ARGUMENTS, "batch_size", "max_length", "dtype", "revision")
#: what lm-eval's command line passes besides ``--model_args`` (``--device``,
#: ``--batch_size``, ``--max_batch_size``), always, its own defaults included
RUN_ARGUMENTS = ("device", "batch_size", "max_batch_size")
#: what transformers' ``from_pretrained`` takes beyond its named parameters (HFLM passes
#: its unknown arguments on to it); the fields of the model's config are accepted too
LOADING_ARGUMENTS = (
    "dtype", "torch_dtype", "attn_implementation", "experts_implementation", "device_map",
    "max_memory", "offload_buffers", "quantization_config", "variant", "key_mapping",
    "low_cpu_mem_usage", "offload_state_dict", "generation_config", "adapter_kwargs",
    "adapter_name", "proxies", "use_kernels", "kernel_config", "tp_size", "distributed_config",
    "output_loading_info",
)  # fmt: skip


def _named_parameters(function: Any) -> set[str]:
    """The names ``function`` takes by keyword (not ``self``, ``*args`` or ``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(function).parameters.values()
    return {p.name for p in params if p.kind in kinds and p.name != "self"}


def check_model_args(pretrained: Any, kwargs: dict[str, Any]) -> None:
    """Check, before any loading, that every keyword of ``kwargs`` (lm-eval's
    ``--model_args`` beyond :data:`FOCUS_ARGUMENTS`) is one that ``HFLM`` or transformers'
    ``from_pretrained`` takes (:data:`LOADING_ARGUMENTS`), or a field of the model's config
    (read from ``pretrained``, a model directory, hub id or model object, only when another
    key is left).

    Raises:
        ValueError: an unknown key; the message names it and lists the accepted ones.
    """
    known = _named_parameters(HFLM.__init__) | _named_parameters(PreTrainedModel.from_pretrained)
    unknown = sorted(set(kwargs) - known - set(LOADING_ARGUMENTS) - set(FOCUS_ARGUMENTS))
    if unknown:
        config = getattr(pretrained, "config", None)
        if config is None and isinstance(pretrained, (str, os.PathLike)):
            try:
                config = AutoConfig.from_pretrained(str(pretrained), local_files_only=True)
            except (OSError, ValueError):
                config = None
        unknown = [k for k in unknown if config is None or not hasattr(config, k)]
    if unknown:
        hflm = sorted(_named_parameters(HFLM.__init__) - {"pretrained", "device"})
        raise ValueError(
            f"focus model: unknown model_args {unknown}; expected {list(FOCUS_ARGUMENTS)}, "
            f"lm-eval HFLM's {hflm}, transformers from_pretrained's (such as dtype, revision, "
            "attn_implementation, device_map) or a field of the model's config"
        )


def _run_defaults() -> dict[str, Any]:
    """The defaults of lm-eval's command line for :data:`RUN_ARGUMENTS` (it passes them
    when they are not given)."""
    return {f.name: f.default for f in dataclasses.fields(EvaluatorConfig) if f.name in RUN_ARGUMENTS}  # fmt: skip


def merge_run_arguments(model_args: dict[str, Any], additional: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """``model_args`` (the ``--model_args`` keys) with lm-eval's ``additional`` run
    arguments (``device``, ``batch_size``, ``max_batch_size``; None ones dropped) for the
    keys they do not give: a key of both is the ``--model_args`` one, which lm-eval's
    default would otherwise contradict (``device=cpu`` against its ``cuda:0``).

    Raises:
        ValueError: a key given both ways with different values, the command line's not
            lm-eval's default (the message names ``--model_args KEY`` and ``--KEY``).
    """
    defaults = _run_defaults()
    merged = dict(model_args)
    for key, value in (additional or {}).items():
        if value is None:
            continue
        if key not in merged:
            merged[key] = value
        elif str(merged[key]) != str(value) and (key not in defaults or value != defaults[key]):
            raise ValueError(
                f"focus model: {key} given twice, {merged[key]!r} in --model_args and "
                f"{value!r} by --{key}; give it once"
            )
    return merged


def git_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` (``git describe --always`` of the working folder,
    else the commit its ``.git`` names) without git's message on stderr outside a checkout;
    None when neither gives one."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip()
    return get_commit_from_path(os.getcwd())


# lm-eval records this in every result; its own lets git print "fatal: not a git
# repository" when the working folder is not in one
lm_eval.evaluator.get_git_commit_hash = git_hash


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_run(model: Any, adapter: str, overrides: dict[str, int]) -> Any:
    """``model`` with the run in ``adapter`` applied: trained weights or LoRA, then the
    Focus routers where the run has them (:func:`~focus_attention.hf.run_folder.tuned_model`)."""
    parts = run_parts(adapter)
    if not any(parts.values()):
        raise FileNotFoundError(
            f"focus model: {adapter} holds no Focus adapter, LoRA adapter (lora/) or trained "
            "model (model/); expected a FocusModel.save_pretrained or focus train output"
        )
    if parts["lora"] or parts["model"]:
        model = tuned_model(model, adapter)
    if not parts["focus"]:
        if overrides:
            raise ValueError(
                f"focus model: received {overrides} for {adapter}, a run without Focus routers "
                "(dense attention); drop top_k and window"
            )
        return model
    return FocusModel.from_pretrained(model, adapter)


@register_model(MODEL_NAME)
class FocusLM(HFLM):
    """lm-eval's ``HFLM`` with a Focus adapter attached (docs/method.md §8-§9).

    Args:
        pretrained: a registered model name (``smollm2-135m``, prepared offline like
            ``focus models prepare``), a local Hugging Face model directory or a hub id;
            or a model object (a ``PreTrainedModel``, or a :class:`FocusModel` whose
            settings ``top_k`` / ``window`` then override).
        adapter: a Focus adapter directory (``FocusModel.save_pretrained`` or a
            ``transformers.Trainer`` output) or any ``focus train --method`` run directory
            (its trained base weights or LoRA are loaded first, then its Focus routers if
            it has them: a LoRA or full fine-tuning run is evaluated dense); None: the model
            as given (dense for a plain model).
        top_k, window: override the adapter's ``top_k`` / local ``window`` (for example a
            stressed ``window=32``); None keeps the adapter's.
        device: torch device; None picks ``cuda`` when available, else ``cpu``.
        **kwargs: ``HFLM``'s arguments (``batch_size``, ``max_length``, ``dtype``, ...) and
            what it hands on to transformers' ``from_pretrained`` (:func:`check_model_args`).

    Scores do not depend on the batch size, the order of the requests or padding (up to
    float rounding): lm-eval right-pads a batch and passes no attention mask, which causal
    top-k routing and dense attention do not see; with soft routing or
    ``inference_routing="sequence"`` (the Sinkhorn columns would count the pads) each
    loglikelihood request is scored alone, whatever ``batch_size`` says.

    Attributes:
        context_lengths: ``{task name: Counter{context length: scored tokens}}`` of every
            loglikelihood request scored so far (requests answered from lm-eval's cache are
            not seen).

    Raises:
        ValueError: ``top_k`` / ``window`` without an adapter or a :class:`FocusModel` (or
            for a run without Focus routers), an adapter on a :class:`FocusModel`, an
            argument neither HFLM nor transformers takes (:func:`check_model_args`), invalid
            settings (from :class:`FocusConfig`), or the errors of loading the model or the
            adapter.
        FileNotFoundError: ``adapter`` holds neither a Focus adapter nor LoRA or trained
            weights.
    """

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> FocusLM:  # fmt: skip
        """lm-eval's constructor from ``--model_args`` (``"key=value,..."``) and the
        command line's own ``--device``, ``--batch_size`` and ``--max_batch_size``
        (``additional_config``): a key in both is taken from ``--model_args``
        (:func:`merge_run_arguments`), where lm-eval's own would pass it twice."""
        args = lm_eval.utils.simple_parse_args_string(arg_string)
        return cls(**merge_run_arguments(args, additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> FocusLM:  # fmt: skip
        """:meth:`create_from_arg_string` for ``--model_args`` given as a dict."""
        return cls(**merge_run_arguments(dict(arg_dict), additional_config))

    def __init__(
        self,
        pretrained: Any = DEFAULT_MODEL,
        adapter: str | None = None,
        top_k: int | None = None,
        window: int | None = None,
        device: str | None = None,
        **kwargs: Any,
    ) -> None:
        overrides = {k: v for k, v in (("top_k", top_k), ("window", window)) if v is not None}
        is_focus = isinstance(pretrained, FocusModel)
        if overrides and adapter is None and not is_focus:
            raise ValueError(
                f"focus model: received {overrides} without an adapter; expected adapter=DIR "
                "(top_k and window are settings of a Focus adapter)"
            )
        if adapter is not None and is_focus:
            raise ValueError("focus model: pretrained is already a FocusModel; drop adapter=")
        if isinstance(pretrained, str):
            pretrained = str(prepare_model(pretrained, quiet=True))
        check_model_args(pretrained, kwargs)
        super().__init__(pretrained=pretrained, device=device or _default_device(), **kwargs)
        self.adapter = None if adapter is None else str(adapter)
        model = self._model if adapter is None else _load_run(self._model, adapter, overrides)
        if isinstance(model, FocusModel):
            if overrides:
                model.focus_config = model.focus_config.replace(**overrides)
            model.eval()
        self._model = model
        self.context_lengths: dict[str, collections.Counter[int]] = {}
        self._pending_tasks: list[str | None] | None = None

    @property
    def focus_config(self) -> FocusConfig | None:
        """The Focus settings in use, or None for a dense model."""
        model = self._model
        return model.focus_config if isinstance(model, FocusModel) else None

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:  # fmt: skip
        """``HFLM.loglikelihood``, remembering which task each request belongs to."""
        self._pending_tasks = [getattr(r, "task_name", None) for r in requests]
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._pending_tasks = None

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False, override_bs: int | None = None) -> list[tuple[float, bool]]:  # fmt: skip
        """``HFLM._loglikelihood_tokens``, after adding each request's scored tokens to
        :attr:`context_lengths` (only requests that came through :meth:`loglikelihood`)."""
        pending = self._pending_tasks
        if pending is not None and len(pending) == len(requests):
            for task, (_, context, continuation) in zip(pending, requests, strict=True):
                if task is not None and continuation:
                    counts = self.context_lengths.setdefault(task, collections.Counter())
                    counts.update(
                        scored_context_lengths(len(context), len(continuation), self.max_length)
                    )
        if self._pads_change_routing():
            # lm-eval right-pads a batch and passes no attention mask: one request per call
            previous, self.batch_size_per_gpu = self.batch_size_per_gpu, 1
            try:
                return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm)
            finally:
                self.batch_size_per_gpu = previous
        return super()._loglikelihood_tokens(
            requests, disable_tqdm=disable_tqdm, override_bs=override_bs
        )

    def _pads_change_routing(self) -> bool:
        """Whether a padding token would change the routing of the real tokens: soft
        routing and ``inference_routing="sequence"`` balance their Sinkhorn columns over
        the whole row (docs/method.md §2, §4); causal top-k routing depends on each token
        alone, so right padding leaves the real tokens' scores unchanged."""
        model = self._model
        if not isinstance(model, FocusModel):
            return False
        return model.routing_mode == "soft" or model.focus_config.inference_routing == "sequence"

    def token_statistics(self) -> dict[str, dict[str, Any]]:
        """:func:`token_statistics` of every task seen, with this model's window and sink
        tokens (no shares for a dense model)."""
        cfg = self.focus_config
        window = None if cfg is None else cfg.window
        sinks = 0 if cfg is None else cfg.sink_tokens
        return {
            task: token_statistics(dict(counts), window, sinks)
            for task, counts in sorted(self.context_lengths.items())
        }


# ---------------------------------------------------------------------------------------------
# the local tasks
# ---------------------------------------------------------------------------------------------


def lm_eval_tasks_root() -> Path:
    """The installed ``lm_eval/tasks`` directory (where lm-eval's task YAMLs live)."""
    return Path(lm_eval.tasks.__file__).resolve().parent


def _task_yaml(name: str, include: Path, data: Path, split: str) -> str:
    """The YAML of one local task: lm-eval's task file, the local data, only ``split``."""
    builder = "json" if data.suffix == ".jsonl" else "arrow"
    splits = {"training_split": None, "validation_split": None, "test_split": None}
    splits["test_split" if split == "test" else "validation_split"] = split
    lines = [
        "# written by focus-attention: lm-eval's own task, reading the local benchmark data",
        f"include: {include.as_posix()}",
        f"task: {name}",
        "tag: null",
        f"dataset_path: {builder}",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        f"    {split}: {data.as_posix()}",
        *(f"{key}: {'null' if value is None else value}" for key, value in splits.items()),
    ]
    return "\n".join(lines) + "\n"


def task_directory(names: Iterable[str] | None = None, *, quiet: bool = False) -> Path:
    """Write the local task YAMLs (module docstring) and return their directory, to give
    lm-eval as ``include_path``. The benchmark data are prepared first when needed.

    The directory is ``focus_home()/lm-eval-tasks/<key>``, the key a hash of the paths of
    lm-eval's task files and of the data (several environments can share a cache); files
    are rewritten only when their text changes.

    Args:
        names: the benchmarks to write (default all of :data:`BENCHMARKS`).
        quiet: no progress messages while preparing the data.

    Raises:
        ValueError: an unknown benchmark name.
        FileNotFoundError: the installed lm-eval lacks a task file it should have.
        RuntimeError: the benchmark data could not be prepared.
    """
    chosen = list(BENCHMARKS) if names is None else list(names)
    unknown = [n for n in chosen if n not in LM_EVAL_TASK_FILES]
    if unknown:
        raise ValueError(f"benchmarks {unknown}: unknown; expected some of {list(BENCHMARKS)}")
    root, files = lm_eval_tasks_root(), benchmark_files(quiet=quiet)
    key = hashlib.sha256(f"{root}\n{files[chosen[0]].parent.parent}".encode()).hexdigest()[:12]
    out = focus_home() / "lm-eval-tasks" / key
    out.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        include = root / LM_EVAL_TASK_FILES[name]
        if not include.is_file():
            raise FileNotFoundError(f"lm-eval's task file {include} is missing")
        text = _task_yaml(name, include, files[name], BENCHMARKS[name].split)
        path = out / f"{name}.yaml"
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            atomic_write_text(path, text)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (``lm_eval ARGS``) with the ``focus`` model registered and,
    unless ``--include_path`` is given, the local tasks on the include path."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and "--include_path" not in args and not any(a in ("-h", "--help") for a in args):
        args += ["--include_path", str(task_directory())]
    sys.argv = ["lm_eval", *args]
    cli_evaluate()
