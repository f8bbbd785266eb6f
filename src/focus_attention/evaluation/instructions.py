"""Instruction-following retention (docs/method.md §9): IFEval-style verifiable instructions
and the drift of next-token distributions from an untouched reference model.

* Prompts (:func:`build_prompts`): a fixed, seeded set of chat requests, each a task (an
  offline question, or a passage of held-out prose to summarise or describe) followed by the
  descriptions of one or two IFEval instructions with seeded arguments, drawn from
  :data:`INSTRUCTION_TYPES` without the pairs IFEval marks as conflicting. The descriptions
  and the checkers are IFEval's, from ``if-verifiable`` (Zhou et al., 2023, "Instruction-
  Following Evaluation for Large Language Models"); only its checkers are used (its data
  loader needs the hub).
* Scores (:func:`score_response`): strict (the response as it is) and loose (IFEval's
  response transformations: without the first line, the last line or both, and without
  ``*``; an instruction passes loose when any variant passes), at prompt level (every
  instruction of the prompt followed) and instruction level (:func:`accuracy`).
* Drift (:func:`response_kl`): KL(reference || model) of the next-token distributions,
  teacher-forced on the chat-formatted prompt and the reference model's own response.

Any Hugging Face causal LM plugs in as a :class:`ChatModel` (a model object and the
context it runs in): a :class:`~focus_attention.hf.FocusModel` with hard top-k routing
against itself under :meth:`~focus_attention.hf.FocusModel.disable_focus`
(:func:`focus_pair`), a peft model against itself under ``disable_adapter``, or two separate
models.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "EXCLUDED_INSTRUCTIONS",
    "INSTRUCTION_TYPES",
    "PASSAGE_TASKS",
    "QUESTION_TASKS",
    "ChatModel",
    "Generation",
    "InstructionPrompt",
    "accuracy",
    "build_prompts",
    "chat_ids",
    "describe_instruction",
    "focus_pair",
    "generate_responses",
    "instruction_arguments",
    "paired_difference",
    "probe_checkers",
    "ratio_mean",
    "response_kl",
    "score_response",
]

#: the IFEval instruction types whose checkers run offline, in IFEval's registry order
INSTRUCTION_TYPES = (
    "keywords:existence",
    "keywords:frequency",
    "keywords:forbidden_words",
    "keywords:letter_frequency",
    "language:response_language",
    "length_constraints:number_paragraphs",
    "length_constraints:number_words",
    "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders",
    "detectable_content:postscript",
    "detectable_format:number_bullet_lists",
    "detectable_format:constrained_response",
    "detectable_format:number_highlighted_sections",
    "detectable_format:multiple_sections",
    "detectable_format:json_format",
    "detectable_format:title",
    "combination:two_responses",
    "combination:repeat_prompt",
    "startend:end_checker",
    "change_case:english_capital",
    "change_case:english_lowercase",
    "punctuation:no_comma",
    "startend:quotation",
)
#: the IFEval instruction types left out, and why
EXCLUDED_INSTRUCTIONS = {
    "length_constraints:number_sentences": "its checker counts sentences with nltk's punkt "
    "sentence tokenizer, whose data (punkt / punkt_tab) is not installable offline",
    "change_case:capital_word_frequency": "its checker splits words with nltk.word_tokenize, "
    "which needs nltk's punkt_tab data (not installable offline)",
}
#: task framings of a question (``{q}``) and of a passage (``{p}``)
QUESTION_TASKS = (
    "{q}",
    "Answer the following question and explain why: {q}",
    "Write a short explanation for a curious student: {q}",
)
PASSAGE_TASKS = (
    "Summarize the following passage from a novel.\n\n{p}",
    "Here is a passage from a novel:\n\n{p}\n\nDescribe what happens in it and who is involved.",
    "Read this passage from a novel and write a short letter from one of its characters to a "
    "friend about it.\n\n{p}",
)
#: instruction types asked only of question prompts (repeating a whole passage would not fit
#: the response length)
_QUESTION_ONLY = ("combination:repeat_prompt",)
#: IFEval's argument options (the values its own generator draws from)
_RELATIONS = ("less than", "at least")
_ENDINGS = ("Any other questions?", "Is there anything else I can help with?")
_POSTSCRIPTS = ("P.S.", "P.P.S")
_SECTION_WORDS = ("Section", "SECTION")


def _registry() -> tuple[dict[str, Any], dict[str, set[str]], Any]:
    """if-verifiable's IFEval registry, conflicts and word/language lists (langdetect seeded,
    so that the language checkers are deterministic).

    Raises:
        RuntimeError: if-verifiable is not installed (the message says how to install it).
    """
    try:
        import langdetect  # optional: the instruct extra (if-verifiable's own dependency)
        from if_verifiable.ifeval import instructions_util  # optional: the instruct extra
        from if_verifiable.ifeval.instructions_registry import (  # optional: the instruct extra
            INSTRUCTION_CONFLICTS,
            INSTRUCTION_DICT,
        )
    except ImportError as err:
        raise RuntimeError(
            "instruction following needs IFEval's checkers: pip install 'focus-attention[instruct]' "
            f"(installs if-verifiable==0.1.2); {err}"
        ) from err

    langdetect.DetectorFactory.seed = 0
    return INSTRUCTION_DICT, INSTRUCTION_CONFLICTS, instructions_util


def instruction_arguments(instruction_id: str, rng: random.Random, request: str) -> dict[str, Any]:  # fmt: skip
    """Seeded arguments of one IFEval instruction, from IFEval's options; the counts are
    bounded so that a response of a few hundred tokens can satisfy them (word counts 20-150,
    IFEval's are 100-500).

    Args:
        instruction_id: one of :data:`INSTRUCTION_TYPES`.
        rng: the generator the arguments are drawn from.
        request: the text a ``combination:repeat_prompt`` response must repeat.

    Raises:
        ValueError: an instruction type not in :data:`INSTRUCTION_TYPES`.
    """
    _, _, util = _registry()
    words = util.WORD_LIST
    kind = instruction_id.split(":", 1)[-1]
    choices: dict[str, Callable[[], dict[str, Any]]] = {
        "existence": lambda: {"keywords": rng.sample(words, 2)},
        "frequency": lambda: {
            "keyword": rng.choice(words),
            "frequency": rng.randint(1, 3),
            "relation": rng.choice(_RELATIONS),
        },  # fmt: skip
        "forbidden_words": lambda: {"forbidden_words": rng.sample(words, 2)},
        "letter_frequency": lambda: {
            "letter": rng.choice("abcdefghijklmnopqrstuvwxyz"),
            "let_frequency": rng.randint(1, 10),
            "let_relation": rng.choice(_RELATIONS),
        },  # fmt: skip
        "response_language": lambda: {
            "language": rng.choice(sorted(c for c in util.LANGUAGE_CODES if c != "en"))
        },  # fmt: skip
        "number_paragraphs": lambda: {"num_paragraphs": rng.randint(1, 5)},
        "number_words": lambda: {
            "num_words": rng.randint(20, 150),
            "relation": rng.choice(_RELATIONS),
        },  # fmt: skip
        "nth_paragraph_first_word": lambda: _nth_paragraph(rng, words),
        "number_placeholders": lambda: {"num_placeholders": rng.randint(1, 4)},
        "postscript": lambda: {"postscript_marker": rng.choice(_POSTSCRIPTS)},
        "number_bullet_lists": lambda: {"num_bullets": rng.randint(1, 5)},
        "number_highlighted_sections": lambda: {"num_highlights": rng.randint(1, 4)},
        "multiple_sections": lambda: {
            "section_spliter": rng.choice(_SECTION_WORDS),
            "num_sections": rng.randint(1, 5),
        },  # fmt: skip
        "repeat_prompt": lambda: {"prompt_to_repeat": request},
        "end_checker": lambda: {"end_phrase": rng.choice(_ENDINGS)},
    }
    if instruction_id not in INSTRUCTION_TYPES:
        raise ValueError(
            f"instruction {instruction_id!r}: not one of the offline IFEval types {INSTRUCTION_TYPES}"
        )  # fmt: skip
    return choices[kind]() if kind in choices else {}


def _nth_paragraph(rng: random.Random, words: Sequence[str]) -> dict[str, Any]:
    n = rng.randint(1, 5)
    return {"num_paragraphs": n, "nth_paragraph": rng.randint(1, n), "first_word": rng.choice(words)}  # fmt: skip


def _checker(instruction_id: str, kwargs: dict[str, Any]) -> tuple[Any, str]:
    """IFEval's checker of ``instruction_id`` built with ``kwargs``, and its description."""
    registry, _, _ = _registry()
    if instruction_id not in registry:
        raise ValueError(f"instruction {instruction_id!r}: not in if-verifiable's IFEval registry")
    checker = registry[instruction_id](instruction_id)
    description = checker.build_description(**kwargs)
    return checker, description


def describe_instruction(instruction_id: str, kwargs: dict[str, Any]) -> str:
    """IFEval's description of one instruction with its arguments (the text put in the
    prompt).

    Raises:
        ValueError: an unknown instruction type, or arguments its checker refuses.
    """
    return _checker(instruction_id, kwargs)[1]


def probe_checkers() -> dict[str, str | None]:
    """Run every checker of if-verifiable's IFEval registry once on a sample response, with
    seeded arguments; ``{instruction id: None when it ran, else "ErrorType: message"}``.
    Checkers that need data not present here (nltk's punkt) fail with ``LookupError``."""
    registry, _, _ = _registry()
    rng, out = random.Random(0), {}
    sample = "A short answer.\n\nIt has two paragraphs, and a comma."
    for instruction_id in registry:
        try:
            if instruction_id in INSTRUCTION_TYPES:
                kwargs = instruction_arguments(instruction_id, rng, "A short answer.")
            else:
                kwargs = {}
            checker, _ = _checker(instruction_id, kwargs)
            checker.check_following(sample)
            out[instruction_id] = None
        except Exception as err:  # the probe reports every failure of a third-party checker
            lines = [x.strip() for x in str(err).splitlines() if any(c.isalnum() for c in x)]
            out[instruction_id] = f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
    return out


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InstructionPrompt:
    """One chat request of the set.

    Attributes:
        index: position in the set (0-based).
        source: ``"question"`` or ``"passage"``.
        origin: where the question or passage comes from (for example ``arc_easy:<id>``).
        task: the request before the instructions.
        instruction_ids: the IFEval instruction types (one or two).
        kwargs: their arguments, one dict each.
        text: the user message: the task, a blank line, the instructions' descriptions.
    """

    index: int
    source: str
    origin: str
    task: str
    instruction_ids: tuple[str, ...]
    kwargs: tuple[dict[str, Any], ...]
    text: str


def _conflicts(a: str, b: str) -> bool:
    _, conflicts, _ = _registry()
    return a == b or b in conflicts.get(a, set()) or a in conflicts.get(b, set())


def _pick_instructions(rng: random.Random, source: str, max_instructions: int) -> list[str]:
    """One or up to ``max_instructions`` non-conflicting types; ``repeat_prompt`` last."""
    allowed = [t for t in INSTRUCTION_TYPES if source == "question" or t not in _QUESTION_ONLY]
    chosen = [rng.choice(allowed)]
    for _ in range(rng.randint(1, max_instructions) - 1):
        rest = [t for t in allowed if not any(_conflicts(t, c) for c in chosen)]
        if rest:
            chosen.append(rng.choice(rest))
    return sorted(chosen, key=lambda t: t in _QUESTION_ONLY)


def _prompt(index: int, source: str, origin: str, task: str, ids: list[str], rng: random.Random) -> InstructionPrompt:  # fmt: skip
    """Assemble one prompt: each description in turn; the request a ``repeat_prompt``
    response must repeat is the text before its own description."""
    text, kwargs = task + "\n\n", []
    for i, instruction_id in enumerate(ids):
        args = instruction_arguments(instruction_id, rng, text.strip())
        kwargs.append(args)
        text += ("" if i == 0 else " ") + describe_instruction(instruction_id, args)
    return InstructionPrompt(index, source, origin, task, tuple(ids), tuple(kwargs), text)


def build_prompts(
    questions: Sequence[tuple[str, str]],
    passages: Sequence[tuple[str, str]],
    count: int,
    *,
    seed: int = 0,
    passage_share: float = 0.5,
    max_instructions: int = 2,
) -> list[InstructionPrompt]:
    """A deterministic set of ``count`` prompts (module docstring): ``round(count *
    passage_share)`` passage prompts and the rest question prompts, in a seeded order, each
    with a seeded task framing (:data:`QUESTION_TASKS`, :data:`PASSAGE_TASKS`) and one to
    ``max_instructions`` instructions with seeded arguments. The same inputs and seed give
    the same prompts.

    Args:
        questions, passages: ``(origin, text)`` pairs, drawn without replacement.
        count: number of prompts (>= 1).
        seed: seed of every choice.
        passage_share: share of passage prompts, in [0, 1].
        max_instructions: 1 or 2.

    Raises:
        ValueError: a count or share out of range, or fewer questions or passages than needed.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"build_prompts: count {count!r}, expected an int >= 1")
    if not 0.0 <= passage_share <= 1.0 or max_instructions not in (1, 2):
        raise ValueError(f"build_prompts: passage_share {passage_share!r} (expected in [0, 1]), "
                         f"max_instructions {max_instructions!r} (expected 1 or 2)")  # fmt: skip
    n_passages = round(count * passage_share)
    need = {"question": (questions, count - n_passages), "passage": (passages, n_passages)}
    for name, (pool, n) in need.items():
        if len(pool) < n:
            raise ValueError(f"build_prompts: {n} {name} prompts need {n} {name}s, received {len(pool)}")  # fmt: skip
    rng = random.Random(seed)
    drawn = {name: iter(rng.sample(list(pool), n)) for name, (pool, n) in need.items()}
    kinds = ["passage"] * n_passages + ["question"] * (count - n_passages)
    rng.shuffle(kinds)
    out = []
    for index, kind in enumerate(kinds):
        origin, body = next(drawn[kind])
        template = rng.choice(PASSAGE_TASKS if kind == "passage" else QUESTION_TASKS)
        task = template.format(p=body, q=body)
        out.append(_prompt(index, kind, origin, task, _pick_instructions(rng, kind, max_instructions), rng))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# scores
# ---------------------------------------------------------------------------------------------


def score_response(prompt: InstructionPrompt, response: str) -> dict[str, Any]:
    """IFEval's strict and loose verdicts of one response (module docstring), with
    if-verifiable's checkers and its loose transformations (an empty response follows no
    instruction).

    Returns:
        ``strict`` and ``loose``: one bool per instruction of the prompt;
        ``prompt_strict`` / ``prompt_loose``: every instruction followed.
    """
    from if_verifiable.common import evaluate_instructions  # optional: the instruct extra

    registry, _, _ = _registry()
    results, _ = evaluate_instructions(
        response=response,
        instruction_id_list=list(prompt.instruction_ids),
        kwargs_list=[dict(k) for k in prompt.kwargs],
        prompt=prompt.text,
        instruction_registry=registry,
    )
    n = len(prompt.instruction_ids)
    strict = [r.strict_pass for r in results] if len(results) == n else [False] * n
    loose = [r.loose_pass for r in results] if len(results) == n else [False] * n
    return {"strict": strict, "loose": loose, "prompt_strict": all(strict), "prompt_loose": all(loose)}  # fmt: skip


def ratio_mean(numerators: Sequence[float], denominators: Sequence[float]) -> tuple[float, float | None]:  # fmt: skip
    """``sum(num) / sum(den)`` and its standard error clustered by item (the ratio
    estimator's linearised variance; with unit denominators, the sample standard deviation
    over ``sqrt(n)``); the error is None for fewer than two items.

    Raises:
        ValueError: lengths differ, no items, or the denominators sum to zero.
    """
    m = len(numerators)
    total = float(sum(denominators))
    if m != len(denominators) or m == 0 or total == 0:
        raise ValueError(f"ratio_mean: {m} numerators and {len(denominators)} denominators "
                         "(expected equal, non-empty, with a non-zero sum)")  # fmt: skip
    value = float(sum(numerators)) / total
    if m < 2:
        return value, None
    spread = sum((x - value * d) ** 2 for x, d in zip(numerators, denominators, strict=True))
    return value, math.sqrt(spread / (m * (m - 1))) / (total / m)


def accuracy(scores: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """IFEval's four accuracies of scored responses (:func:`score_response`), each with its
    standard error (``<name>_stderr``): ``prompt_strict``, ``prompt_loose`` (share of
    prompts with every instruction followed), ``instruction_strict``,
    ``instruction_loose`` (share of all instructions followed; errors clustered by prompt).

    Raises:
        ValueError: no scores.
    """
    out: dict[str, float | None] = {}
    for mode in ("strict", "loose"):
        for level, num, den in (
            ("prompt", [float(s[f"prompt_{mode}"]) for s in scores], [1.0] * len(scores)),
            ("instruction", [float(sum(s[mode])) for s in scores], [float(len(s[mode])) for s in scores]),
        ):  # fmt: skip
            value, stderr = ratio_mean(num, den)
            out[f"{level}_{mode}"], out[f"{level}_{mode}_stderr"] = value, stderr
    return out


def paired_difference(scores: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> dict[str, float | None]:  # fmt: skip
    """Model minus reference for each accuracy of :func:`accuracy`, over the same prompts,
    with the paired standard error (``<name>_stderr``, clustered by prompt).

    Raises:
        ValueError: different numbers of scores, or none.
    """
    if len(scores) != len(reference):
        raise ValueError(f"paired_difference: {len(scores)} scores against {len(reference)} reference scores")  # fmt: skip
    out: dict[str, float | None] = {}
    for mode in ("strict", "loose"):
        prompt = [float(a[f"prompt_{mode}"]) - float(b[f"prompt_{mode}"]) for a, b in zip(scores, reference, strict=True)]  # fmt: skip
        inst = [float(sum(a[mode])) - float(sum(b[mode])) for a, b in zip(scores, reference, strict=True)]  # fmt: skip
        for level, num, den in (
            ("prompt", prompt, [1.0] * len(scores)),
            ("instruction", inst, [float(len(s[mode])) for s in scores]),
        ):
            out[f"{level}_{mode}"], out[f"{level}_{mode}_stderr"] = ratio_mean(num, den)
    return out


# ---------------------------------------------------------------------------------------------
# models: generation and drift
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatModel:
    """A causal LM as evaluated: ``model`` (any Hugging Face causal LM object with
    ``generate`` and ``forward``), run inside ``context()`` (for example a FocusModel's
    ``disable_focus`` or a peft model's ``disable_adapter``), named ``name`` in results."""

    name: str
    model: Any
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)  # fmt: skip


def focus_pair(fm: Any, *, top_k: int | None = None, window: int | None = None) -> tuple[ChatModel, ChatModel]:  # fmt: skip
    """``(evaluated, reference)`` of a :class:`~focus_attention.hf.FocusModel`: Focus with
    hard top-k routing (``top_k`` / ``window`` overriding the adapter's for the duration,
    None keeps them), and the same base model with Focus disabled (the untouched model).

    Raises:
        ValueError: invalid settings (from the FocusModel's config), on entering the context.
    """

    @contextlib.contextmanager
    def focus_on() -> Iterator[None]:
        previous = fm.focus_config
        fm.focus_config = previous.override(top_k=top_k, window=window)
        try:
            yield
        finally:
            fm.focus_config = previous

    cfg = fm.focus_config
    name = f"focus top-{top_k or cfg.top_k} window {window or cfg.window}"
    return ChatModel(name, fm, focus_on), ChatModel("reference", fm, fm.disable_focus)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one user message in the tokenizer's chat template, with the generation
    prompt (the assistant's turn) appended.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_ids: the tokenizer has no chat template (an instruct model's tokenizer is needed)")  # fmt: skip
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)  # fmt: skip
    return list(tokenizer(chat, add_special_tokens=False).input_ids)


def _stop_ids(model: Any, tokenizer: Any) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


@dataclass(frozen=True)
class Generation:
    """One greedy response: its ``text`` (special tokens dropped), the generated ``ids``
    (up to and including the first stop token), ``prompt_tokens`` and whether it
    ``stopped`` (a stop token came before ``max_new_tokens``)."""

    text: str
    ids: tuple[int, ...]
    prompt_tokens: int
    stopped: bool


def _left_padded(rows: list[list[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def generate_responses(
    chat: ChatModel,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    progress: Any = None,
) -> list[Generation]:
    """Greedy responses to chat-formatted prompts (:func:`chat_ids`), in batches of
    ``batch_size`` left-padded prompts of similar length (sorted by length; the results in
    the input order). Padded batches agree with one prompt at a time up to float rounding.

    Args:
        chat: the model and its context.
        tokenizer: its tokenizer (pad id: ``pad_token_id``, else ``eos_token_id``).
        prompt_ids: token ids of each prompt.
        max_new_tokens: bound on each response's length in tokens (>= 1).
        batch_size: prompts per ``generate`` call (>= 1).
        progress: a tqdm bar advanced by one per prompt, or None.

    Raises:
        ValueError: ``max_new_tokens`` or ``batch_size`` below 1, or an empty prompt.
    """
    if max_new_tokens < 1 or batch_size < 1 or any(len(p) == 0 for p in prompt_ids):
        raise ValueError(f"generate_responses: max_new_tokens {max_new_tokens}, batch_size {batch_size} "
                         "(expected >= 1) and non-empty prompts")  # fmt: skip
    stop = _stop_ids(chat.model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(chat.model.parameters()).device
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    out: dict[int, Generation] = {}
    with chat.context(), torch.no_grad():
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            ids, mask = _left_padded([list(prompt_ids[i]) for i in batch], pad, device)
            new = chat.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=pad)[:, ids.shape[1] :]  # fmt: skip
            for row, i in enumerate(batch):
                tokens = new[row].tolist()
                cut = next((j + 1 for j, t in enumerate(tokens) if t in stop), None)
                kept = tokens if cut is None else tokens[:cut]
                text = tokenizer.decode(kept, skip_special_tokens=True)
                out[i] = Generation(text, tuple(kept), len(prompt_ids[i]), cut is not None)
            if progress is not None:
                progress.update(len(batch))
    return [out[i] for i in range(len(prompt_ids))]


def _log_probs(chat: ChatModel, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
    """Log-probabilities ``[len(response), vocab]`` (float32) of the predictions of each
    response token, teacher-forced on ``prompt + response``."""
    device = next(chat.model.parameters()).device
    ids = torch.tensor([list(prompt) + list(response[:-1])], dtype=torch.long, device=device)
    with chat.context(), torch.no_grad():
        logits = chat.model(input_ids=ids, use_cache=False, logits_to_keep=len(response)).logits
    return torch.log_softmax(logits[0, -len(response) :].float(), dim=-1)


def response_kl(
    chat: ChatModel,
    reference: ChatModel,
    prompt_ids: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """KL(reference || model) of the next-token distributions at each response token,
    teacher-forced on the chat-formatted prompt and the reference model's own response (one
    prompt at a time, no padding), in nats.

    Args:
        chat, reference: the evaluated model and the untouched one (same vocabulary).
        prompt_ids: each prompt's token ids.
        responses: each response's token ids (the reference's generated ids).
        progress: a tqdm bar advanced by one per prompt, or None.

    Returns:
        One dict per prompt: ``tokens`` (scored), ``kl_sum``, ``kl_mean``, ``kl_max`` (nats)
        and ``contexts``: ``{context length: tokens}`` (keys seen by each scored prediction,
        the query included).

    Raises:
        ValueError: lengths differ, or the two models' vocabularies differ.
    """
    if len(prompt_ids) != len(responses):
        raise ValueError(f"response_kl: {len(prompt_ids)} prompts and {len(responses)} responses")
    out = []
    for prompt, response in zip(prompt_ids, responses, strict=True):
        out.append(_kl_of(chat, reference, prompt, response))
        if progress is not None:
            progress.update(1)
    return out


def _kl_of(chat: ChatModel, reference: ChatModel, prompt: Sequence[int], response: Sequence[int]) -> dict[str, Any]:  # fmt: skip
    """:func:`response_kl` of one prompt."""
    if not response:
        return {"tokens": 0, "kl_sum": 0.0, "kl_mean": None, "kl_max": None, "contexts": {}}
    ref, got = _log_probs(reference, prompt, response), _log_probs(chat, prompt, response)
    if ref.shape != got.shape:
        raise ValueError(f"response_kl: vocabularies differ ({ref.shape[-1]} against {got.shape[-1]})")  # fmt: skip
    kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0.0)  # rounding can dip below 0
    contexts = Counter(len(prompt) + j for j in range(len(response)))
    return {"tokens": len(response), "kl_sum": float(kl.sum()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "contexts": dict(contexts)}  # fmt: skip
