"""``focus bench instructions``: instruction-following retention of an instruct model
(docs/method.md §9), for the untouched model or a Focus adapter against it, in one JSON.

The prompts are :func:`focus_attention.evaluation.instructions.build_prompts` over offline
material: the questions of ARC-Easy and ARC-Challenge (validation; the zero-shot benchmark
data, :mod:`focus_attention.assets.benchmarks`) and single paragraphs of 60-160 words of a
corpus's held-out split (default: *Persuasion*, the test split of ``austen``), each with one
or two IFEval instructions. The first ``--limit`` prompts of the fixed set are answered
greedily, in the tokenizer's chat template, by the untouched model (for an adapter: the same
base with Focus disabled) and by Focus with hard top-k routing at each ``--top-k`` and
``--window`` (default the adapter's), and scored strict and loose (IFEval). For a ``focus
train --method`` run that trained LoRA or base weights, the evaluated model is the tuned one
(with its Focus routers where the run has them, else dense attention) and the reference is
the untouched base. The drift is the
KL divergence from the untouched model, teacher-forced on its own responses. Every response
and score is in the JSON, with the share of generated and scored tokens whose context
exceeds the window (only those can differ from dense attention).
"""

from __future__ import annotations

import copy
import itertools
import re
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

import torch
from tqdm.auto import tqdm

from ..assets.benchmarks import benchmark_files
from ..assets.corpora import load_corpus
from ..assets.models import load_model
from ..evaluation.instructions import (
    EXCLUDED_INSTRUCTIONS,
    INSTRUCTION_TYPES,
    ChatModel,
    accuracy,
    build_prompts,
    chat_ids,
    focus_pair,
    generate_responses,
    paired_difference,
    probe_checkers,
    response_kl,
    score_response,
)
from ..evaluation.positions import context_statistics
from ..hf import FocusModel
from ..hf.run_folder import run_parts, tuned_model
from ..utils.env import RESULT_DISTRIBUTIONS, environment, library_versions
from .settings import InstructionsBenchConfig

__all__ = [
    "InstructionsBenchConfig",
    "instructions_table",
    "passage_pool",
    "question_pool",
    "run_instructions_benchmark",
    "token_shares",
]

#: the distributions an instructions result records on top of the usual ones
_IF_DISTRIBUTIONS = ("if-verifiable", "langdetect", "nltk", "datasets")
#: the benchmarks whose questions are prompts
QUESTION_SOURCES = ("arc_easy", "arc_challenge")
#: passage length bounds, in words
PASSAGE_WORDS = (60, 160)


# ---------------------------------------------------------------------------------------------
# offline material
# ---------------------------------------------------------------------------------------------


def question_pool(*, quiet: bool = True) -> list[tuple[str, str]]:
    """``(origin, question)`` of every ARC-Easy and ARC-Challenge validation question
    (``arc_easy:<id>``), in file order; the benchmark data are prepared first when needed.

    Raises:
        RuntimeError: the benchmark data could not be prepared.
    """
    import datasets  # optional: comes with the instruct and bench extras

    files = benchmark_files(quiet=quiet)
    out = []
    for task in QUESTION_SOURCES:
        rows = datasets.Dataset.from_file(str(files[task]))
        out += [(f"{task}:{r['id']}", r["question"].strip()) for r in rows if r["question"].strip()]
    return out


def passage_pool(texts: list[str], name: str, words: tuple[int, int] = PASSAGE_WORDS) -> list[tuple[str, str]]:  # fmt: skip
    """``(origin, paragraph)`` of every paragraph (blank-line separated, its lines joined) of
    ``texts`` with ``words[0]``-``words[1]`` words, in order; the origin is ``name:<n>``, the
    paragraph's index."""
    out, n = [], 0
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            joined = " ".join(para.split())
            if words[0] <= len(joined.split()) <= words[1]:
                out.append((f"{name}:{n}", joined))
            n += 1
    return out


def _prompt_set(config: InstructionsBenchConfig) -> list[Any]:
    texts = load_corpus(config.corpus, quiet=True).texts(config.split)
    passages = passage_pool(texts, f"{config.corpus}/{config.split}")
    prompts = build_prompts(
        question_pool(), passages, config.prompts, seed=config.seed, passage_share=config.passage_share
    )  # fmt: skip
    return prompts[: config.limit]


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


def token_shares(contexts: Counter, window: int | None, sink_tokens: int = 0) -> dict[str, Any]:
    """Summary of predictions by context length (``{keys seen: tokens}``): ``tokens``,
    ``mean_context``, ``max_context`` and, with a window, ``beyond_window_share`` (context
    longer than ``window``) and ``routed_share`` (longer than ``window + sink_tokens``:
    only those can differ from dense attention)."""
    return context_statistics(dict(contexts), window, sink_tokens)


def _generated_contexts(generations: list[Any]) -> Counter:
    return Counter(g.prompt_tokens + j for g in generations for j in range(len(g.ids)))


def _models(config: InstructionsBenchConfig) -> tuple[Any, Any, list[tuple[Any, dict]]]:
    """``(tokenizer, reference, [(evaluated, settings)])`` of the configuration.

    Raises:
        FileNotFoundError: the adapter directory holds no Focus adapter, LoRA or model.
        ValueError: ``top_k`` / ``window`` for a run without Focus routers.
    """
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    base, tokenizer = load_model(config.model, device=device, quiet=True)
    if config.adapter is None:
        return tokenizer, ChatModel("reference", base), []
    parts = run_parts(config.adapter)
    if not any(parts.values()):
        raise FileNotFoundError(
            f"{config.adapter}: no Focus adapter, LoRA adapter (lora/) or trained model (model/); "
            "expected a FocusModel.save_pretrained or focus train output"
        )
    if parts["lora"] or parts["model"]:
        return (tokenizer, *_tuned_models(config, base, parts["focus"]))
    return (tokenizer, *_focus_models(config, base, None))


def _focus_models(config: InstructionsBenchConfig, model: Any, reference: Any) -> tuple[Any, list[tuple[Any, dict]]]:  # fmt: skip
    """``(reference, [(evaluated, settings)])`` of the Focus adapter in ``config.adapter``
    attached to ``model``, one per ``top_k`` x ``window``; ``reference`` None: ``model``
    with Focus disabled."""
    fm = FocusModel.from_pretrained(model, config.adapter).eval()
    cfg = fm.focus_config
    evaluated = []
    for k, w in itertools.product(config.top_k or (cfg.top_k,), config.window or (cfg.window,)):
        chat, disabled = focus_pair(fm, top_k=k, window=w)
        reference = reference or disabled
        evaluated.append((chat, {"top_k": k, "window": w, "sink_tokens": cfg.sink_tokens}))
    return reference, evaluated


def _tuned_models(config: InstructionsBenchConfig, base: Any, focus: bool) -> tuple[Any, list[tuple[Any, dict]]]:  # fmt: skip
    """``(reference, [(evaluated, settings)])`` of a run that trained LoRA or base weights:
    the untouched ``base`` (kept apart) against the tuned model, with the run's Focus
    routers where it has them, else dense."""
    reference = ChatModel("reference", base)
    tuned = tuned_model(copy.deepcopy(base), config.adapter)
    if focus:
        return _focus_models(config, tuned, reference)
    if config.top_k is not None or config.window is not None:
        raise ValueError(
            f"top_k / window given for {config.adapter}, a run without Focus routers (dense "
            "attention); drop them"
        )
    return reference, [(ChatModel("tuned dense", tuned), {"top_k": None, "window": None, "sink_tokens": 0})]  # fmt: skip


def _bar(config: InstructionsBenchConfig, total: int, desc: str) -> Any:
    return tqdm(total=total, desc=desc, disable=not config.progress, dynamic_ncols=True)


def _answer(config: InstructionsBenchConfig, chat: Any, tokenizer: Any, prompts: list, ids: list) -> tuple[list, list]:  # fmt: skip
    """Generations and scores of one model."""
    with _bar(config, len(ids), f"generate ({chat.name})") as bar:
        gens = generate_responses(chat, tokenizer, ids, max_new_tokens=config.max_new_tokens,
                                  batch_size=config.batch_size, progress=bar)  # fmt: skip
    return gens, [score_response(p, g.text) for p, g in zip(prompts, gens, strict=True)]


def _kl_summary(kls: list[dict[str, Any]]) -> dict[str, Any]:
    scored = [k for k in kls if k["tokens"]]
    tokens = sum(k["tokens"] for k in scored)
    per_prompt = [k["kl_mean"] for k in scored]
    mean_prompt = sum(per_prompt) / len(per_prompt) if per_prompt else None
    spread = None
    if len(per_prompt) > 1:
        var = sum((x - mean_prompt) ** 2 for x in per_prompt) / (len(per_prompt) - 1)
        spread = (var / len(per_prompt)) ** 0.5
    return {
        "tokens": tokens,
        "mean_per_token": sum(k["kl_sum"] for k in scored) / tokens if tokens else None,
        "mean_per_prompt": mean_prompt,
        "mean_per_prompt_stderr": spread,
        "max": max((k["kl_max"] for k in scored), default=None),
        "unit": "nats",
    }


def _evaluated_entry(config, chat, settings, tokenizer, prompts, ids, ref) -> dict[str, Any]:  # fmt: skip
    """One evaluated model: its answers, scores, paired differences, KL and token shares."""
    gens, scores = _answer(config, chat, tokenizer, prompts, ids)
    window, sinks = settings["window"], settings["sink_tokens"]
    entry: dict[str, Any] = {
        "name": chat.name,
        "settings": settings,
        "accuracy": accuracy(scores),
        "difference": paired_difference(scores, ref["scores"]),
        "generated_tokens": token_shares(_generated_contexts(gens), window, sinks),
        "responses": [_response(g, s) for g, s in zip(gens, scores, strict=True)],
    }
    if config.kl:
        with _bar(config, len(ids), f"KL ({chat.name})") as bar:
            kls = response_kl(chat, ref["chat"], ids, [g.ids for g in ref["generations"]], progress=bar)  # fmt: skip
        contexts: Counter = Counter()
        for k in kls:
            contexts.update(k.pop("contexts"))
        entry["kl"] = {**_kl_summary(kls), "scored_tokens": token_shares(contexts, window, sinks)}
        for row, k in zip(entry["responses"], kls, strict=True):
            row["kl"] = k
    return entry


def _response(gen: Any, score: dict[str, Any]) -> dict[str, Any]:
    return {"response": gen.text, "new_tokens": len(gen.ids), "stopped": gen.stopped, **score}


def run_instructions_benchmark(config: InstructionsBenchConfig) -> dict[str, Any]:
    """Answer, score and compare (module docstring).

    Returns:
        JSON-able dict: ``config``; ``instructions`` (kept types, excluded types and why, the
        probe of every checker); ``prompts`` (per prompt: index, source, origin,
        instruction ids and arguments, text, prompt tokens); ``reference`` (accuracy with
        standard errors, generated-token summary, per-prompt ``responses``); ``models`` (one
        per evaluated setting: ``settings``, ``accuracy``, ``difference`` to the reference
        with paired standard errors, ``kl`` (per token and per prompt, nats; the scored
        tokens' shares beyond the window), ``generated_tokens`` and ``responses``);
        ``seconds``, ``versions``, ``environment``.

    Raises:
        ValueError: a tokenizer without a chat template, too little offline material, or the
            errors of loading the model or the adapter.
        RuntimeError: the benchmark data or corpus could not be prepared.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    start = time.monotonic()
    probe = probe_checkers()
    broken = {t: probe.get(t, "missing from if-verifiable's registry") for t in INSTRUCTION_TYPES if probe.get(t, "") is not None}  # fmt: skip
    if broken:
        raise RuntimeError(f"IFEval checkers that fail here: {broken}")
    tokenizer, reference, evaluated = _models(config)
    prompts = _prompt_set(config)
    ids = [chat_ids(tokenizer, p.text) for p in prompts]
    gens, scores = _answer(config, reference, tokenizer, prompts, ids)
    ref = {"chat": reference, "generations": gens, "scores": scores}
    models = [_evaluated_entry(config, chat, s, tokenizer, prompts, ids, ref) for chat, s in evaluated]  # fmt: skip
    return {
        "config": asdict(config),
        "instructions": {
            "kept": list(INSTRUCTION_TYPES),
            "excluded": EXCLUDED_INSTRUCTIONS,
            "probe": probe,
        },  # fmt: skip
        "prompts": [
            {**asdict(p), "prompt_tokens": len(i)} for p, i in zip(prompts, ids, strict=True)
        ],  # fmt: skip
        "reference": {
            "name": reference.name,
            "accuracy": accuracy(scores),
            "generated_tokens": token_shares(_generated_contexts(gens), None),
            "responses": [_response(g, s) for g, s in zip(gens, scores, strict=True)],
        },
        "models": models,
        "seconds": time.monotonic() - start,
        "versions": library_versions((*RESULT_DISTRIBUTIONS, *_IF_DISTRIBUTIONS)),
        "environment": environment(),
    }


def _pct(values: dict[str, Any], name: str, signed: bool = False) -> str:
    value, stderr = values.get(name), values.get(f"{name}_stderr")
    if value is None:
        return "-"
    text = f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}"
    return text if stderr is None else f"{text} ± {100 * stderr:.1f}"


_COLUMNS = ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose")


def instructions_table(result: dict[str, Any]) -> str:
    """A markdown table of one result: a row for the reference and one per evaluated
    setting (accuracies in percent ± standard error; for the settings, the paired
    difference to the reference), KL per token and per prompt (nats), and the shares of
    generated and KL-scored tokens routed beyond the window."""
    n = len(result["prompts"])
    lines = [
        f"{result['config']['model']}: IFEval-style instructions, {n} prompts, greedy, chat template",
        "",
        "| model | prompt strict % | prompt loose % | instr. strict % | instr. loose % | KL/token | KL/prompt | routed (generated) | routed (scored) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    acc = result["reference"]["accuracy"]
    lines.append(f"| {result['reference']['name']} | " + " | ".join(_pct(acc, c) for c in _COLUMNS) + " | - | - | - | - |")  # fmt: skip
    for m in result["models"]:
        cells = [f"{_pct(m['accuracy'], c)} (Δ {_pct(m['difference'], c, signed=True)})" for c in _COLUMNS]  # fmt: skip
        kl = m.get("kl") or {}
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        routed = [m["generated_tokens"].get("routed_share"), (kl.get("scored_tokens") or {}).get("routed_share")]  # fmt: skip
        shown = ["-" if r is None else f"{100 * r:.1f}%" for r in routed]
        lines.append(f"| {m['name']} | " + " | ".join(cells) + f" | {fmt(kl.get('mean_per_token'))} | "
                     f"{fmt(kl.get('mean_per_prompt'))} | {shown[0]} | {shown[1]} |")  # fmt: skip
    return "\n".join(lines)
