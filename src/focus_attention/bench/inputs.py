"""The model and the token ids a speed benchmark runs: a registered or local model with its
tokenizer and the text of a corpus split, or a preset with random weights
(``random:PRESET``, :mod:`focus_attention.assets.presets`) with seeded random ids."""

from __future__ import annotations

from typing import Any

import torch

from ..assets.corpora import load_corpus
from ..assets.models import load_model
from ..assets.presets import is_random_model, preset_named
from ..assets.random_models import build_random_model, random_token_ids

__all__ = ["bench_token_ids", "load_bench_model", "weights_record"]


def load_bench_model(
    model: str, dtype: str, device: str | torch.device, seed: int
) -> tuple[Any, Any | None]:
    """``(model, tokenizer)`` on ``device`` in ``dtype``, in eval mode with ``sdpa``
    attention: a preset with random weights (seeded by ``seed``; tokenizer None), or
    :func:`~focus_attention.assets.models.load_model`'s.

    Raises:
        ValueError / RuntimeError: an unknown preset; :func:`load_model`'s errors.
    """
    if is_random_model(model):
        return build_random_model(model, dtype=dtype, device=device, seed=seed), None
    loaded, tokenizer = load_model(model, dtype, device=device, quiet=True)
    loaded.config._attn_implementation = "sdpa"
    return loaded, tokenizer


def bench_token_ids(
    model: Any, tokenizer: Any | None, corpus: str, split: str, total: int, seed: int, rows: int = 1
) -> torch.Tensor:
    """Token ids ``[rows, total]`` (int64, on the CPU): without a tokenizer (a random-weight
    model) seeded random ids in the model's vocabulary, a different sequence per row; else
    the first ``total`` tokens of the corpus split (repeated if shorter), the same in every
    row.

    Raises:
        ValueError: the corpus cannot be read (its loader's errors).
    """
    if tokenizer is None:
        return random_token_ids(model.config.vocab_size, rows, total, seed)
    text = "\n\n".join(load_corpus(corpus).texts(split))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < total:
        ids = ids.repeat(1, -(-total // ids.shape[1]))
    return ids[:, :total].expand(rows, -1).contiguous()


def weights_record(model: str, seed: int) -> dict[str, Any]:
    """What a result records of the model's weights: ``{"weights": "random", "preset",
    "seed", "inputs": "random token ids"}`` for a preset, ``{"weights": "pretrained"}``
    otherwise."""
    if not is_random_model(model):
        return {"weights": "pretrained"}
    return {"weights": "random", "preset": preset_named(model).name, "seed": seed,
            "inputs": "seeded random token ids"}  # fmt: skip
