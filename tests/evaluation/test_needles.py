"""The needle prompts: a prompt has its exact length with the needle at its depth, prompts
that cannot fit are errors, answers are scored exactly, and training blocks of needle
prompts are deterministic."""

from __future__ import annotations

import math
import random

import pytest
import torch

from focus_attention.assets.models import load_model
from focus_attention.bench.settings import HAYSTACKS as BENCH_HAYSTACKS
from focus_attention.evaluation.needles import (
    PROMPTS,
    answer_margin,
    answer_of,
    build_case,
    needle_blocks,
)
from focus_attention.evaluation.settings import HAYSTACKS


def test_every_haystack_has_its_prompts_and_the_benchmark_offers_them():
    assert tuple(PROMPTS) == HAYSTACKS and BENCH_HAYSTACKS is HAYSTACKS


class _Digits:
    """A tokenizer stand-in: one token per character (so lengths are easy to check)."""

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})()


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("bos", [None, 1])
def test_a_prompt_has_the_exact_length_and_the_needle_at_its_depth(depth, bos):
    tok = _Digits()
    hay = [ord("x")] * 5000
    case = build_case(tok, hay, "passkey", 400, depth, 0, random.Random(3), bos_id=bos)
    ids = case.input_ids[0].tolist()
    assert case.input_ids.shape == (1, 400)
    text = "".join(chr(i) for i in ids[(bos is not None) :])
    needle_text = PROMPTS["passkey"][0].format(n=case.answer)
    question = PROMPTS["passkey"][1]
    assert text.endswith(question) and text.count(needle_text) == 1
    filler = 400 - (bos is not None) - len(needle_text) - len(question)
    assert case.needle_start == (bos is not None) + round(depth * filler)
    assert text.index(needle_text) == round(depth * filler)
    assert len(case.answer) == 5 and case.answer.isdigit()


def test_prompts_that_cannot_fit_are_errors():
    tok = _Digits()
    with pytest.raises(ValueError, match="no room"):
        build_case(tok, [1] * 100, "book", 20, 0.5, 0, random.Random(0))
    with pytest.raises(ValueError, match="haystack has 100 tokens"):
        build_case(tok, [1] * 100, "book", 400, 0.5, 0, random.Random(0))


#: generated texts for the needle ``{n}`` and whether each finds it: only the first whole
#: number of the text counts, and only when it is the needle exactly
SCORED = [
    (" {n}. Remember", True),
    ("{n}", True),
    (" The pass key is {n}.", True),
    (" ({n}), then 12", True),
    (" {n}...", True),
    (" {n}0.", False),  # a longer number
    (" 1{n}", False),
    (" 12 then {n}", False),  # the answer is 12
    (" {n}.5", False),  # a decimal
    (" -{n}", False),  # a negative number
    (" x{n}", False),  # inside a word
    (" {n}th", False),
    (" key-{n}", False),  # inside a hyphenated token
    (" five seven", False),
    ("", False),
]


@pytest.mark.parametrize("text, found", SCORED)
def test_answers_are_scored_exactly(text, found):
    assert (answer_of(text.format(n="57291")) == "57291") is found


def test_needle_blocks_are_prompts_of_the_length(assets):
    _, tokenizer = load_model(str(assets["model"]), quiet=True)
    blocks = needle_blocks(tokenizer, str(assets["corpus"]), "validation", 64, 4, seed=0, bos_id=1)
    assert blocks.shape == (4, 64) and blocks.dtype == torch.long and (blocks[:, 0] == 1).all()
    again = needle_blocks(tokenizer, str(assets["corpus"]), "validation", 64, 4, seed=0, bos_id=1)
    assert torch.equal(blocks, again) and not torch.equal(blocks[0], blocks[1])


def _logits(*rows):
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


@pytest.mark.parametrize(
    ("rows", "generated", "answer", "want"),
    [
        # every step writes the answer: the smallest lead over the best other token
        ([[0.0, 3.0, 1.0], [2.5, 0.0, 0.5]], [1, 0], [1, 0], 2.0),
        # the second step leaves the answer (token 2 wins by 1.5): negative, and later steps
        # are not read
        ([[0.0, 3.0, 1.0], [0.5, 0.0, 2.0], [9.0, -9.0, -9.0]], [1, 2, 0], [1, 0, 1], -1.5),
        # a tie: greedy decoding picked the other token, the margin is 0 and not positive
        ([[1.0, 1.0]], [0], [1], 0.0),
        # a generation shorter than the answer: the steps it has
        ([[0.0, 4.0]], [1], [1, 1, 1], 4.0),
        # an answer shorter than the generation: its own tokens only
        ([[0.0, 4.0], [5.0, 0.0]], [1, 0], [1], 4.0),
    ],
)  # fmt: skip
def test_the_answer_margin_follows_greedy_decoding_along_the_answer(rows, generated, answer, want):  # fmt: skip
    assert answer_margin(_logits(*rows), generated, answer) == pytest.approx(want)


def test_the_answer_margin_of_no_step_is_nan():
    assert math.isnan(answer_margin([], [], [1, 2]))
