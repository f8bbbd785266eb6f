"""The needle prompts (docs/method.md §9): a number (the needle) hidden at a chosen depth
of a long prompt (the haystack) and asked for at its end, and how an answer is read back.
Two haystacks (:data:`~focus_attention.evaluation.settings.HAYSTACKS`): ``passkey`` (a short
filler paragraph repeated, the synthetic pass-key test) and ``book`` (held-out prose of a
corpus, a different stretch per prompt). ``focus bench needle`` answers them
(:mod:`focus_attention.bench.needle`), the retrieval ranking scores the attention they draw
(:func:`focus_attention.evaluation.retrieval.rank_retrieval_layers`), and ``focus train
--method head-gates`` trains on them."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..assets.corpora import load_corpus
from ..assets.models import auto_prepend_bos, load_model
from ..hf import FocusModel
from ..utils.checks import bad
from .settings import HAYSTACKS

__all__ = [
    "ANSWER_NUMBER",
    "FILLER",
    "PROMPTS",
    "NeedleCase",
    "answer_margin",
    "answer_of",
    "build_case",
    "haystack_tokens",
    "load_needle_model",
    "needle_blocks",
    "needle_cases",
]

#: the synthetic haystack: one paragraph, repeated
FILLER = (
    "The river runs past the old mill. The baker opens his shop at dawn. Children walk "
    "to school along the lane. Rain falls on the hills and the fields turn green. "
)
#: needle and question of each haystack; ``{n}`` is the number
PROMPTS = {
    "passkey": (
        "\nThe pass key is {n}. Remember it. {n} is the pass key.\n",
        "\nWhat is the pass key? The pass key is",
    ),
    "book": (
        "\nThe magic number mentioned in this book is {n}.\n",
        "\n\nQuestion: what is the magic number mentioned in this book?\nAnswer: The magic "
        "number mentioned in this book is",
    ),
}


@dataclass(frozen=True)
class NeedleCase:
    """One prompt: ``input_ids`` ``[1, length]`` long, the needle's number ``answer`` and the
    token indices where the needle starts and ends (excluded)."""

    haystack: str
    length: int
    depth: float
    trial: int
    input_ids: torch.Tensor
    answer: str
    needle_start: int
    needle_end: int


#: a whole number: ASCII digits with an optional sign and decimal part, not part of a longer
#: word, number or hyphenated token (a full stop or comma after it ends a sentence or clause)
ANSWER_NUMBER = re.compile(r"(?<![\w.+-])[-+]?[0-9]+(?:\.[0-9]+)?(?!\w)")


def answer_of(text: str) -> str | None:
    """The model's answer: the first whole number in ``text`` (:data:`ANSWER_NUMBER`), or
    None. A cell is correct when it equals the needle exactly, so ``" 57291."`` finds
    57291 but ``" 572910."``, ``" 57291.5"``, ``" -57291"``, ``" x57291"`` and
    ``" 12 then 57291"`` (whose answer is 12) do not."""
    match = ANSWER_NUMBER.search(text)
    return None if match is None else match.group(0)


def answer_margin(step_logits: list[torch.Tensor], generated: list[int], answer: list[int]) -> float:  # fmt: skip
    """How far greedy decoding was from losing (or finding) the needle, in logits: along the
    answer's tokens ``answer`` (the needle's number after a space, as the tokenizer encodes
    it), the logit of the answer's token minus the largest other logit at each generated
    step, ``step_logits[t]`` ``[V]`` the raw logits before generating ``generated[t]``; the
    smallest of them up to and including the first step whose generated token is not the
    answer's (where greedy decoding left the answer: a negative margin), else over the whole
    answer. Positive when greedy decoding wrote the answer's tokens; ``nan`` with no step.
    Read from the logits the generation already computed: no extra forward pass."""
    worst = math.nan
    for logits, got, want in zip(step_logits, generated, answer):  # noqa: B905 (the shorter)
        row = logits.detach().float().flatten()
        best_other = torch.cat([row[:want], row[want + 1 :]]).max()
        margin = float(row[want] - best_other)
        worst = margin if math.isnan(worst) else min(worst, margin)
        if got != want:
            break
    return worst


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def build_case(
    tokenizer: Any,
    haystack_ids: list[int],
    kind: str,
    length: int,
    depth: float,
    trial: int,
    rng: random.Random,
    *,
    bos_id: int | None = None,
) -> NeedleCase:
    """Assemble one prompt of exactly ``length`` tokens: ``[bos] filler[:a] needle
    filler[a:] question``, where ``filler`` is the stretch of ``haystack_ids`` that fills the
    length (from a random offset) and ``a = round(depth * len(filler))``; the offset and the
    5-digit number are drawn from ``rng``.

    Raises:
        ValueError: ``haystack_ids`` too short, or ``length`` too short for the needle and
            the question.
    """
    number = str(rng.randrange(10_000, 100_000))
    needle_text, question_text = PROMPTS[kind]
    needle, question = _ids(tokenizer, needle_text.format(n=number)), _ids(tokenizer, question_text)
    head = [] if bos_id is None else [bos_id]
    room = length - len(head) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"needle prompt: length {length} leaves no room for the haystack")
    if len(haystack_ids) < room:
        raise ValueError(
            f"needle prompt: the {kind} haystack has {len(haystack_ids)} tokens, {room} needed"
        )
    start = rng.randrange(0, len(haystack_ids) - room + 1)
    filler = haystack_ids[start : start + room]
    cut = round(depth * room)
    ids = head + filler[:cut] + needle + filler[cut:] + question
    at = len(head) + cut
    return NeedleCase(
        kind, length, float(depth), trial, torch.tensor([ids]), number, at, at + len(needle)
    )


def haystack_tokens(tokenizer: Any, kind: str, corpus: str, split: str, length: int) -> list[int]:
    """Token ids the haystack of ``kind`` is cut from, long enough for prompts of ``length``
    tokens: the filler paragraph repeated (``passkey``), or the texts of ``split`` of
    ``corpus`` joined by blank lines (``book``)."""
    if kind == "passkey":
        ids = _ids(tokenizer, FILLER)
        return ids * (length // len(ids) + 2)
    text = "\n\n".join(load_corpus(corpus, quiet=True).texts(split))
    return _ids(tokenizer, text)


def needle_blocks(tokenizer: Any, corpus: str, split: str, length: int, count: int, seed: int,
                  bos_id: int | None = None) -> torch.Tensor:  # fmt: skip
    """``count`` needle prompts of ``length`` tokens as training blocks, long ``[count,
    length]``: the benchmark's prompts (:func:`build_case`), the haystacks alternating
    ``passkey`` and ``book`` (``split`` of ``corpus``), each needle at a depth drawn
    uniformly from [0.05, 0.95]; deterministic in ``seed``.

    Raises:
        ValueError: as :func:`build_case` (a split too short for ``length``).
    """
    rng = random.Random(seed)
    sources = {kind: haystack_tokens(tokenizer, kind, corpus, split, length) for kind in HAYSTACKS}
    kinds = list(HAYSTACKS)
    rows = [build_case(tokenizer, sources[kinds[i % len(kinds)]], kinds[i % len(kinds)], length,
                       rng.uniform(0.05, 0.95), i, rng, bos_id=bos_id).input_ids[0]
            for i in range(count)]  # fmt: skip
    return torch.stack(rows)


def needle_cases(config: Any, tokenizer: Any, bos_id: int | None) -> list[NeedleCase]:
    """Every prompt of a needle config (``haystacks``, ``lengths``, ``depths``, ``trials``,
    ``corpus``, ``split``, ``seed``: :class:`~.settings.RetrievalLayersConfig`,
    :class:`focus_attention.bench.settings.NeedleBenchConfig`), in the order haystack,
    length, depth, trial; deterministic in ``config.seed``.

    Raises:
        ValueError: as :func:`build_case` (a haystack too short for a length).
    """
    rng = random.Random(config.seed)
    cases = []
    for kind in config.haystacks:
        source = haystack_tokens(tokenizer, kind, config.corpus, config.split, max(config.lengths))
        for length in config.lengths:
            for depth in config.depths:
                for trial in range(config.trials):
                    cases.append(
                        build_case(
                            tokenizer, source, kind, length, depth, trial, rng, bos_id=bos_id
                        )  # fmt: skip
                    )
    return cases


def load_needle_model(config: Any) -> tuple[Any, Any, int | None]:
    """``(Focus model in eval mode, tokenizer, BOS id or None)`` that answers the prompts of a
    needle config (``model``, ``adapter``, ``lengths``, ``threads``, ``progress``), with
    ``threads`` CPU threads when set.

    Raises:
        ValueError: a length above the model's ``max_position_embeddings``, or the errors of
            loading the model or adapter.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    base, tokenizer = load_model(config.model, quiet=not config.progress)
    limit = getattr(base.config, "max_position_embeddings", None)
    if limit is not None and max(config.lengths) > limit:
        raise bad(type(config).__name__, "lengths", config.lengths, f"at most {limit} tokens")
    fm = FocusModel.from_pretrained(base, config.adapter).eval()
    return fm, tokenizer, tokenizer.bos_token_id if auto_prepend_bos(base) else None
