"""Tiny offline assets for tests: a word-level tokenizer, a random LLaMA model directory,
a small corpus folder prepared in a cache, the ``focus train`` settings sized for them, and
the JSON contract of ``focus eval``. Used by the ``module_assets`` / ``assets`` fixtures of
``conftest.py`` and by the pipeline, training and evaluation tests."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from tiny import tiny_llama, word_tokenizer

WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "was",
    "he",
    "she",
    "it",
    "that",
    "his",
    "her",
    "had",
    "with",
    "for",
    "as",
    "not",
    "but",
    "at",
    "be",
    "on",
    "my",
    "all",
    "by",
    "him",
    "have",
    "so",
    "which",
    "you",
    "said",
    "mr",
    "mrs",
    "miss",
    "very",
    "could",
    "would",
    "there",
    "been",
    "they",
    "were",
    "no",
    "one",
    "elizabeth",
    "darcy",
    "anne",
    "emma",
    "house",
    "letter",
    "sister",
    "mother",
    "walk",
    "morning",
    "evening",
    "ball",
]
PUNCT = [".", ",", ";", "!", "?"]


def make_tokenizer():
    """An offline word-level tokenizer over :data:`WORDS` (+ punctuation, ``<eos>``, ``<bos>``)."""
    return word_tokenizer(WORDS + PUNCT, bos=True)


def make_text(seed: int, n_words: int) -> str:
    """Deterministic pseudo-prose: a Markov-ish word walk with punctuation and line breaks."""
    rng = random.Random(seed)
    out, line = [], []
    prev = 0
    for i in range(n_words):
        # a sticky walk over the word list gives the model something learnable
        prev = (prev + rng.choice([1, 1, 2, 3, -1, 7])) % len(WORDS)
        line.append(WORDS[prev])
        if rng.random() < 0.1:
            line.append(rng.choice(PUNCT))
        if len(line) >= 12 or i == n_words - 1:
            out.append(" ".join(line))
            line = []
    return "\n".join(out) + "\n"


def make_model_dir(path: Path, *, seed: int = 0, max_positions: int = 128) -> Path:
    """Save a tiny random LLaMA (2 layers, hidden 32, GQA 4/2) and the tokenizer in ``path``."""
    tok = make_tokenizer()
    model = tiny_llama(
        len(tok),
        seed,
        max_positions=max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_corpus_dir(path: Path, *, n_docs: int = 4, n_words: int = 1500) -> Path:
    """A folder of ``n_docs`` text files (split by whole document: >= 1 train, validation and
    test document each)."""
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (path / f"book{i}.txt").write_text(make_text(100 + i, n_words))
    return path


def train_config(**settings):
    """A TrainConfig from flat settings: the FocusConfig fields among them go to its
    ``focus``."""
    import dataclasses

    from focus_attention.hf import FocusConfig
    from focus_attention.training import TrainConfig

    names = {f.name for f in dataclasses.fields(FocusConfig)} - {"seed"}  # the run seeds it
    focus = {k: settings.pop(k) for k in list(settings) if k in names}
    return TrainConfig(**settings, focus=FocusConfig(**focus))


def tiny_config(assets: dict, out: Path, **changes):
    """A TrainConfig for the tiny model: K=4, top_k=2, window 8, seq_len 32, 1 thread."""
    kw = dict(
        model=str(assets["model"]),
        corpus=str(assets["corpus"]),
        out=str(out),
        steps=6,
        seq_len=32,
        batch_size=2,
        grad_accum=1,
        lr=1e-2,
        warmup_steps=2,
        eval_every=3,
        eval_tokens=64,
        save_every=2,
        threads=1,
        progress=False,
        num_groups=4,
        top_k=2,
        window=8,
        group_dim=8,
        sink_tokens=1,
    )
    kw.update(changes)
    return train_config(**kw)


def make_tiny_assets(root: Path) -> dict:
    """A tiny model directory and a local corpus prepared in the cache ``root/focus-home``
    (``FOCUS_HOME`` is set only while preparing: use it with :func:`use_tiny_assets`)."""
    from focus_attention.assets.corpora import prepare_corpus

    home = root / "focus-home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(home))
        model = make_model_dir(root / "tiny-llama")
        corpus = make_corpus_dir(root / "books")
        prepare_corpus(corpus, quiet=True)
    return {"model": model, "corpus": corpus, "root": root, "home": home}


def use_tiny_assets(assets: dict, monkeypatch) -> dict:
    """Point ``FOCUS_HOME`` at the tiny assets' cache for one test."""
    monkeypatch.setenv("FOCUS_HOME", str(assets["home"]))
    return assets


EVAL_KEYS = {
    "ppl",
    "pairs_retained",
    "tokens",
    "base_weights_sha256",
    "config",
    "versions",
}


def check_eval_schema(result: dict, num_groups: int) -> None:
    """The JSON contract of ``focus eval``."""
    assert set(result) >= EVAL_KEYS
    ks = [str(k) for k in range(1, num_groups + 1)]
    assert set(result["ppl"]) >= {"base", "focus_soft", "focus_topk"}
    assert list(result["ppl"]["focus_topk"]) == ks
    assert list(result["pairs_retained"]) == ks
    for v in [result["ppl"]["base"], result["ppl"]["focus_soft"], *result["ppl"]["focus_topk"].values()]:  # fmt: skip
        assert isinstance(v, float) and math.isfinite(v) and v > 1
    for v in result["pairs_retained"].values():
        assert 0 < v <= 1
    assert isinstance(result["tokens"], int) and result["tokens"] > 0
    sha = result["base_weights_sha256"]
    assert len(sha["before"]) == 64 and sha["before"] == sha["after"]
    assert result["config"]["focus"]["num_groups"] == num_groups
    assert {"torch", "transformers", "python"} <= set(result["versions"])
    json.dumps(result)  # plain JSON


def require_real_assets() -> None:
    """Skip unless smollm2-135m and the Austen corpus are prepared (`focus setup`)."""
    from focus_attention.assets.cache import read_manifest
    from focus_attention.assets.corpora import corpus_dir
    from focus_attention.assets.models import is_prepared
    from focus_attention.utils.io import focus_home

    if not is_prepared("smollm2-135m"):
        pytest.skip(f"smollm2-135m is not prepared in {focus_home()}: run `focus setup`")
    if read_manifest(corpus_dir("austen")) is None:
        pytest.skip(f"corpus 'austen' is not prepared in {focus_home()}: run `focus setup`")
