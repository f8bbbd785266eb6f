"""Instruction-following retention on tiny offline models: the prompt set is deterministic
and of the requested size, each kept IFEval checker accepts a known-good response and
rejects a known-bad one, strict and loose differ where only loose accepts, the accuracies
and their standard errors, batched greedy generation, KL of a model against itself (0) and
against a perturbed one (> 0), and ``focus bench instructions`` end to end."""

from __future__ import annotations

import copy
import json
import math
import statistics

import pytest
import torch
from tiny import arrow_stream, tiny_llama, tuned_run, word_tokenizer
from tiny_assets import WORDS, make_model_dir

from focus_attention import cli
from focus_attention.bench.instructions import InstructionsBenchConfig, passage_pool, token_shares
from focus_attention.evaluation.instructions import (
    EXCLUDED_INSTRUCTIONS,
    INSTRUCTION_TYPES,
    ChatModel,
    InstructionPrompt,
    accuracy,
    build_prompts,
    chat_ids,
    focus_pair,
    generate_responses,
    paired_difference,
    probe_checkers,
    ratio_mean,
    response_kl,
    score_response,
)
from focus_attention.hf import FocusConfig, get_focus_model

pytest.importorskip("if_verifiable")

#: a chat template for the word-level tokenizers (unknown words become [UNK])
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> {% endif %}"
)


def _pools(n: int = 300):
    questions = [(f"q:{i}", f"What is the answer to question number {i}?") for i in range(n)]
    passages = [(f"p:{i}", f"Passage {i}: she walked to the house in the morning.") for i in range(n)]  # fmt: skip
    return questions, passages


# --------------------------------------------------------------------------------------------
# the prompt set
# --------------------------------------------------------------------------------------------


def test_prompt_set_is_deterministic_and_of_the_requested_size():
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS as conflicts

    questions, passages = _pools()
    prompts = build_prompts(questions, passages, 150, seed=3)
    assert len(prompts) == 150 and prompts == build_prompts(questions, passages, 150, seed=3)
    assert [p.index for p in prompts] == list(range(150))
    assert prompts != build_prompts(questions, passages, 150, seed=4)
    assert sum(p.source == "passage" for p in prompts) == 75
    assert len({p.origin for p in prompts}) == 150  # drawn without replacement
    for p in prompts:
        assert 1 <= len(p.instruction_ids) <= 2 and len(p.kwargs) == len(p.instruction_ids)
        assert set(p.instruction_ids) <= set(INSTRUCTION_TYPES) and p.text.startswith(p.task)
        if len(p.instruction_ids) == 2:
            a, b = p.instruction_ids
            assert a != b and b not in conflicts[a] and a not in conflicts[b]
        if "combination:repeat_prompt" in p.instruction_ids:
            assert p.source == "question" and p.instruction_ids[-1] == "combination:repeat_prompt"
            request = p.kwargs[-1]["prompt_to_repeat"]
            assert p.text.startswith(request) and request.startswith(p.task)
    used = {t for p in prompts for t in p.instruction_ids}
    assert len(used) >= 20  # nearly every kept type appears in 150 prompts
    only_questions = build_prompts(questions, passages, 10, passage_share=0.0, max_instructions=1)
    assert all(p.source == "question" and len(p.instruction_ids) == 1 for p in only_questions)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(count=0), "count 0"),
        (dict(count=5, passage_share=1.5), "passage_share 1.5"),
        (dict(count=5, max_instructions=3), "max_instructions 3"),
        (dict(count=700), "need 350 questions, received 300"),
    ],
)
def test_build_prompts_bad_arguments(kwargs, match):
    questions, passages = _pools()
    with pytest.raises(ValueError, match=match):
        build_prompts(questions, passages, **kwargs)


def test_passage_pool_keeps_paragraphs_of_the_word_bounds():
    text = "one two three\nfour five\n\n" + "word " * 70 + "\n\n" + "long " * 200
    pool = passage_pool([text], "book", (10, 100))
    assert pool == [("book:1", " ".join(["word"] * 70))]


# --------------------------------------------------------------------------------------------
# the checkers
# --------------------------------------------------------------------------------------------

#: per kept type: arguments, a response that follows it and one that does not
CASES = {
    "keywords:existence": (
        {"keywords": ["apple", "river"]},
        "An apple fell into the river.",
        "Nothing here.",
    ),  # fmt: skip
    "keywords:frequency": (
        {"keyword": "cat", "frequency": 2, "relation": "at least"},
        "A cat met a cat.",
        "One cat.",
    ),  # fmt: skip
    "keywords:forbidden_words": (
        {"forbidden_words": ["apple"]},
        "I like pears.",
        "I like apple pie.",
    ),  # fmt: skip
    "keywords:letter_frequency": (
        {"letter": "z", "let_frequency": 3, "let_relation": "at least"},
        "Zoe saw a buzzing bee.",
        "No such letter.",
    ),  # fmt: skip
    "language:response_language": (
        {"language": "fr"},
        "Bonjour, je suis très heureux de vous voir aujourd'hui. Nous allons au marché ensemble.",
        "Hello, I am very happy to see you today. We are going to the market together.",
    ),  # fmt: skip
    "length_constraints:number_paragraphs": (
        {"num_paragraphs": 2},
        "First part.\n***\nSecond part.",
        "Only one part.",
    ),  # fmt: skip
    "length_constraints:number_words": (
        {"num_words": 5, "relation": "less than"},
        "Two words.",
        "This answer has far too many words in it.",
    ),  # fmt: skip
    "length_constraints:nth_paragraph_first_word": (
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\nThen second.",
        "First.\n\nSecond.",
    ),  # fmt: skip
    "detectable_content:number_placeholders": (
        {"num_placeholders": 2},
        "Send it to [name] at [address].",
        "Send it.",
    ),  # fmt: skip
    "detectable_content:postscript": (
        {"postscript_marker": "P.S."},
        "Hello.\nP.S. See you.",
        "Hello.",
    ),  # fmt: skip
    "detectable_format:number_bullet_lists": ({"num_bullets": 2}, "* one\n* two", "* one"),
    "detectable_format:constrained_response": ({}, "My answer is yes.", "Sure."),
    "detectable_format:number_highlighted_sections": (
        {"num_highlights": 2},
        "*one* and *two*",
        "*one* only",
    ),  # fmt: skip
    "detectable_format:multiple_sections": (
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nA\nSection 2\nB",
        "Section 1\nA",
    ),  # fmt: skip
    "detectable_format:json_format": ({}, '{"answer": 1}', "not json"),
    "detectable_format:title": ({}, "<<My title>>\nText.", "My title"),
    "combination:two_responses": ({}, "First answer.\n******\nSecond answer.", "Only one."),
    "combination:repeat_prompt": (
        {"prompt_to_repeat": "What is the sky?"},
        "What is the sky? It is blue.",
        "It is blue.",
    ),  # fmt: skip
    "startend:end_checker": (
        {"end_phrase": "Any other questions?"},
        "Done. Any other questions?",
        "Any other questions? Done.",
    ),  # fmt: skip
    "change_case:english_capital": (
        {},
        "THIS IS ALL CAPITAL ENGLISH TEXT ABOUT THE WEATHER TODAY.",
        "This is not all capital.",
    ),  # fmt: skip
    "change_case:english_lowercase": (
        {},
        "this is all lowercase english text about the weather today.",
        "This Has Capitals.",
    ),  # fmt: skip
    "punctuation:no_comma": ({}, "No commas here.", "Yes, a comma."),
    "startend:quotation": ({}, '"Quoted answer."', "Not quoted."),
}


def _prompt(ids, kwargs):
    return InstructionPrompt(0, "question", "test", "Task.", tuple(ids), tuple(kwargs), "Task.")


def test_every_kept_type_has_a_case_and_runs_offline():
    assert set(CASES) == set(INSTRUCTION_TYPES)
    probe = probe_checkers()
    assert {t: probe[t] for t in INSTRUCTION_TYPES} == dict.fromkeys(INSTRUCTION_TYPES)
    assert set(probe) == set(INSTRUCTION_TYPES) | set(EXCLUDED_INSTRUCTIONS)  # the whole registry
    assert not set(INSTRUCTION_TYPES) & set(EXCLUDED_INSTRUCTIONS)


@pytest.mark.parametrize("instruction_id", INSTRUCTION_TYPES)
def test_checker_accepts_good_and_rejects_bad(instruction_id):
    kwargs, good, bad = CASES[instruction_id]
    prompt = _prompt([instruction_id], [kwargs])
    assert score_response(prompt, good) == {"strict": [True], "loose": [True], "prompt_strict": True, "prompt_loose": True}  # fmt: skip
    assert score_response(prompt, bad) == {"strict": [False], "loose": [False], "prompt_strict": False, "prompt_loose": False}  # fmt: skip


def test_strict_and_loose_differ_where_only_loose_accepts():
    prompt = _prompt(["startend:quotation", "punctuation:no_comma"], [{}, {}])
    # a chatty first line breaks the quotation strictly; loose drops the first line
    chatty = 'Sure here it is:\n"Quoted answer."'
    score = score_response(prompt, chatty)
    assert score == {"strict": [False, True], "loose": [True, True], "prompt_strict": False, "prompt_loose": True}  # fmt: skip
    stars = _prompt(["startend:quotation"], [{}])
    assert score_response(stars, '**"Bold quote."**')["loose"] == [True]  # asterisks removed
    assert score_response(stars, '**"Bold quote."**')["strict"] == [False]
    assert score_response(prompt, "") == {"strict": [False, False], "loose": [False, False], "prompt_strict": False, "prompt_loose": False}  # fmt: skip
    acc = accuracy([score, score_response(prompt, '"No comma."')])
    assert (acc["prompt_strict"], acc["prompt_loose"]) == (0.5, 1.0)
    assert (acc["instruction_strict"], acc["instruction_loose"]) == (0.75, 1.0)


def test_accuracy_standard_errors_and_paired_differences():
    values = [1.0, 0.0, 1.0, 1.0, 0.0]
    mean, stderr = ratio_mean(values, [1.0] * 5)
    assert mean == pytest.approx(0.6)
    assert stderr == pytest.approx(statistics.stdev(values) / math.sqrt(5))
    # clustered ratio: instructions passed over instructions asked, per prompt
    num, den = [2.0, 0.0, 1.0], [2.0, 1.0, 2.0]
    value, err = ratio_mean(num, den)
    resid = [n - 0.6 * d for n, d in zip(num, den, strict=True)]
    assert value == pytest.approx(0.6)
    assert err == pytest.approx(math.sqrt(sum(r * r for r in resid) / 6) / (5 / 3))
    assert ratio_mean([1.0], [1.0]) == (1.0, None)
    with pytest.raises(ValueError, match="non-zero sum"):
        ratio_mean([], [])
    a = [{"strict": [True, True], "loose": [True, True], "prompt_strict": True, "prompt_loose": True}] * 2  # fmt: skip
    b = [{"strict": [True, False], "loose": [True, True], "prompt_strict": False, "prompt_loose": True}] * 2  # fmt: skip
    diff = paired_difference(a, b)
    assert (diff["prompt_strict"], diff["instruction_strict"], diff["prompt_loose"]) == (
        1.0,
        0.5,
        0.0,
    )
    assert diff["prompt_strict_stderr"] == 0.0
    with pytest.raises(ValueError, match="2 scores against 1"):
        paired_difference(a, b[:1])


def test_token_shares():
    stats = token_shares({3: 2, 5: 3, 9: 5}, window=4, sink_tokens=1)
    assert (stats["tokens"], stats["max_context"]) == (10, 9)
    assert stats["beyond_window_share"] == pytest.approx(0.8) and stats["routed_share"] == pytest.approx(0.5)  # fmt: skip
    assert "routed_share" not in token_shares({3: 1}, None)


# --------------------------------------------------------------------------------------------
# models: generation and KL
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_lm():
    """A tiny random LLaMA and a word-level tokenizer with a chat template."""
    tok = word_tokenizer(WORDS + [".", "?", ","], bos=True)
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_llama(len(tok), 0, max_positions=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    return model, tok


def _prompt_ids(tok, n=5):
    texts = [" ".join(WORDS[i : i + 4 + 5 * i]) for i in range(n)]  # 4 to 24 words
    return [chat_ids(tok, t) for t in texts]


def test_chat_ids_need_a_chat_template(chat_lm):
    model, tok = chat_lm
    ids = chat_ids(tok, "the house")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.bos_token_id and tok.eos_token_id in ids
    plain = word_tokenizer(WORDS)
    with pytest.raises(ValueError, match="no chat template"):
        chat_ids(plain, "the house")


def test_batched_generation_equals_one_prompt_at_a_time(chat_lm):
    model, tok = chat_lm
    ids = _prompt_ids(tok)
    one = generate_responses(ChatModel("m", model), tok, ids, max_new_tokens=6, batch_size=1)
    three = generate_responses(ChatModel("m", model), tok, ids, max_new_tokens=6, batch_size=3)
    assert [g.ids for g in one] == [g.ids for g in three]
    for g, p in zip(one, ids, strict=True):
        assert g.prompt_tokens == len(p) and 1 <= len(g.ids) <= 6
        assert g.stopped == (g.ids[-1] == tok.eos_token_id)
        assert tok.eos_token_id not in g.ids[:-1]  # cut at the first stop token
    with pytest.raises(ValueError, match="max_new_tokens 0"):
        generate_responses(ChatModel("m", model), tok, ids, max_new_tokens=0)


def test_kl_is_zero_against_itself_and_positive_against_a_perturbed_model(chat_lm):
    model, tok = chat_lm
    ids = _prompt_ids(tok)
    gens = generate_responses(ChatModel("m", model), tok, ids, max_new_tokens=5, batch_size=5)
    responses = [g.ids for g in gens]
    same = response_kl(ChatModel("m", model), ChatModel("ref", model), ids, responses)
    assert all(k["kl_sum"] == 0.0 and k["tokens"] == len(r) for k, r in zip(same, responses, strict=True))  # fmt: skip
    assert same[0]["contexts"] == {len(ids[0]) + j: 1 for j in range(len(responses[0]))}
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.add_(0.05 * torch.randn_like(other.model.layers[0].mlp.down_proj.weight))  # fmt: skip
    moved = response_kl(ChatModel("m", other), ChatModel("ref", model), ids, responses)
    assert all(k["kl_mean"] > 1e-6 and k["kl_max"] >= k["kl_mean"] for k in moved)
    with pytest.raises(ValueError, match="5 prompts and 4 responses"):
        response_kl(ChatModel("m", other), ChatModel("ref", model), ids, responses[:4])


def test_focus_pair_drifts_only_beyond_the_window(chat_lm):
    base, tok = chat_lm
    fm = get_focus_model(copy.deepcopy(base), FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=1, seed=0)).eval()  # fmt: skip
    ids = _prompt_ids(tok)
    responses = [
        g.ids for g in generate_responses(ChatModel("m", base), tok, ids, max_new_tokens=4)
    ]
    wide, reference = focus_pair(fm, window=200)  # every key in the window: dense by construction
    assert wide.name == "focus top-1 window 200" and fm.focus_config.window == 4
    assert max(k["kl_max"] for k in response_kl(wide, reference, ids, responses)) < 1e-6
    narrow, reference = focus_pair(fm)
    assert sum(k["kl_sum"] for k in response_kl(narrow, reference, ids, responses)) > 1e-4
    assert fm.focus_config.window == 4  # the settings come back after each use


# --------------------------------------------------------------------------------------------
# focus bench instructions
# --------------------------------------------------------------------------------------------


def _arc_rows(n: int, offset: int) -> dict:
    return {
        "id": [f"arc-{offset + i}" for i in range(n)],
        "question": [
            " ".join(WORDS[(offset + i) % 20 : (offset + i) % 20 + 6]) + "?" for i in range(n)
        ],  # fmt: skip
        "choices": [{"text": ["a", "b"], "label": ["A", "B"]}] * n,
        "answerKey": ["A"] * n,
    }


@pytest.fixture
def instruct_home(tmp_path, monkeypatch):
    """A FOCUS_HOME with ARC questions, a paragraphed corpus, a tiny chat model and an
    adapter (window 4, one sink)."""
    from focus_attention.assets.benchmarks import BENCHMARKS, benchmark_dir
    from focus_attention.assets.cache import CACHE_FORMAT, MANIFEST_NAME
    from focus_attention.assets.corpora import prepare_corpus

    monkeypatch.setenv("FOCUS_HOME", str(tmp_path / "home"))
    root = benchmark_dir()
    for i, task in enumerate(("arc_easy", "arc_challenge")):
        (root / task).mkdir(parents=True)
        (root / BENCHMARKS[task].file).write_bytes(arrow_stream(_arc_rows(8, 10 * i)))
    (root / MANIFEST_NAME).write_text(json.dumps({"format": CACHE_FORMAT, "files": {}}))
    books = tmp_path / "books"
    books.mkdir()
    for b in range(4):
        paras = [" ".join(WORDS[(b + p + j) % len(WORDS)] for j in range(70)) + "." for p in range(12)]  # fmt: skip
        (books / f"book{b}.txt").write_text("\n\n".join(paras) + "\n")
    prepare_corpus(books, quiet=True)
    model_dir = make_model_dir(tmp_path / "model", max_positions=512)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapter = tmp_path / "adapter"
    get_focus_model(base, FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=1, seed=0)).save_pretrained(adapter)  # fmt: skip
    return {"model": model_dir, "adapter": adapter, "corpus": books}


def test_focus_bench_instructions_end_to_end(instruct_home, tmp_path, capsys):
    out = tmp_path / "instructions.json"
    rc = cli.main(["bench", "instructions", "--model", str(instruct_home["model"]),
                   "--adapter", str(instruct_home["adapter"]), "--top-k", "1", "2",
                   "--corpus", str(instruct_home["corpus"]), "--prompts", "10", "--limit", "4",
                   "--max-new-tokens", "5", "--batch-size", "3", "--no-progress", "--threads", "1",
                   "--json", str(out)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "| reference |" in table and "| focus top-2 window 4 |" in table
    result = json.loads(out.read_text())
    assert set(result) == {"config", "instructions", "prompts", "reference", "models", "seconds", "versions", "environment"}  # fmt: skip
    assert result["config"]["top_k"] == [1, 2] and result["versions"]["if-verifiable"] == "0.1.2"
    assert result["instructions"]["kept"] == list(INSTRUCTION_TYPES)
    assert set(result["instructions"]["excluded"]) == set(EXCLUDED_INSTRUCTIONS)
    assert len(result["prompts"]) == 4 and {p["source"] for p in result["prompts"]} <= {"question", "passage"}  # fmt: skip
    ref = result["reference"]
    assert len(ref["responses"]) == 4 and set(ref["accuracy"]) >= {"prompt_strict", "prompt_strict_stderr", "instruction_loose"}  # fmt: skip
    assert [m["settings"]["top_k"] for m in result["models"]] == [1, 2]
    ref_tokens = sum(r["new_tokens"] for r in ref["responses"])
    for m in result["models"]:
        assert set(m) == {"name", "settings", "accuracy", "difference", "generated_tokens", "responses", "kl"}  # fmt: skip
        assert m["kl"]["tokens"] == ref_tokens and m["kl"]["unit"] == "nats"
        assert m["kl"]["scored_tokens"]["routed_share"] > 0.9  # prompts far beyond window 4
        assert m["kl"]["mean_per_token"] > 0 and all("kl" in r for r in m["responses"])
        assert set(m["difference"]) == set(m["accuracy"])


def test_focus_bench_instructions_untouched_model_alone(instruct_home, tmp_path):
    from focus_attention.bench.instructions import run_instructions_benchmark

    config = InstructionsBenchConfig(model=str(instruct_home["model"]), corpus=str(instruct_home["corpus"]),
                                     prompts=10, limit=2, max_new_tokens=3, progress=False)  # fmt: skip
    result = run_instructions_benchmark(config)
    assert result["models"] == [] and len(result["reference"]["responses"]) == 2


@pytest.mark.parametrize("kind", ["lora", "model", "focus+lora"])
def test_focus_bench_instructions_of_a_tuned_run(instruct_home, tmp_path, kind):
    """A run that trained LoRA or base weights: the reference is the untouched base (the
    same responses as the base alone), the evaluated model the tuned one."""
    pytest.importorskip("peft")
    from focus_attention.bench.instructions import run_instructions_benchmark

    run = tuned_run(instruct_home["model"], tmp_path / "run", kind)
    common = dict(model=str(instruct_home["model"]), corpus=str(instruct_home["corpus"]),
                  prompts=10, limit=3, max_new_tokens=4, progress=False)  # fmt: skip
    alone = run_instructions_benchmark(InstructionsBenchConfig(**common))
    result = run_instructions_benchmark(InstructionsBenchConfig(adapter=str(run), **common))
    assert result["reference"]["responses"] == alone["reference"]["responses"]
    (model,) = result["models"]
    assert model["name"] == ("focus top-1 window 4" if kind == "focus+lora" else "tuned dense")
    assert model["kl"]["mean_per_token"] > 1e-6  # the tuned model drifts from the base
    if kind != "focus+lora":
        assert model["settings"]["window"] is None and "routed_share" not in model["kl"]["scored_tokens"]  # fmt: skip
        with pytest.raises(ValueError, match="without Focus routers"):
            run_instructions_benchmark(InstructionsBenchConfig(adapter=str(run), top_k=(1,), **common))  # fmt: skip


def test_focus_bench_instructions_refuses_an_empty_directory(instruct_home, tmp_path):
    from focus_attention.bench.instructions import run_instructions_benchmark

    (tmp_path / "empty").mkdir()
    config = InstructionsBenchConfig(model=str(instruct_home["model"]), adapter=str(tmp_path / "empty"),
                                     corpus=str(instruct_home["corpus"]), progress=False)  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no Focus adapter"):
        run_instructions_benchmark(config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=(1,)), "adapter"),
        (dict(prompts=0), "prompts"),
        (dict(limit=0), "limit"),
        (dict(passage_share=1.5), "passage_share"),
        (dict(adapter="x", window=()), "window"),
        (dict(split="dev"), "split"),
    ],
)
def test_bench_config_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InstructionsBenchConfig(**kwargs)


def test_bench_instructions_cli_reports_bad_arguments(capsys):
    rc = cli.main(["bench", "instructions", "--window", "32"])
    assert rc == 1 and "adapter" in capsys.readouterr().err
