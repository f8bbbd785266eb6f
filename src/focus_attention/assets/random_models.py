"""Causal LMs with random weights built from a preset shape (:mod:`.presets`) on the device
they run on: transformers' own ``LlamaConfig`` and ``AutoModelForCausalLM.from_config``
under ``torch.device(device)``, with transformers' weight initialisation skipped
(``no_init_weights``; the tied output projection tied again after it) and the weights drawn
once, seeded, on that device as LLaMA initialises
them (matrices ``N(0, initializer_range)``, norm weights 1), so that a model of an 8B shape
is never built on the CPU first (docs/deploy.md; the prefill and decoding studies that run
such models and their timings: experiments/prefill/README.md, experiments/decode/README.md)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.initialization import no_init_weights

from .presets import ModelPreset, preset_named

__all__ = ["build_random_model", "random_model_config", "random_token_ids"]


def random_model_config(preset: ModelPreset, **overrides: Any) -> LlamaConfig:
    """The ``LlamaConfig`` of ``preset``, with ``overrides`` (``LlamaConfig`` fields, such
    as ``num_hidden_layers=1`` for a smaller model of the same kind) over its fields.

    Raises:
        ValueError: an override that is not a field of the preset.
    """
    fields = preset.config_fields()
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"model preset {preset.name}: unknown overrides {unknown}")
    return LlamaConfig(**{**fields, **overrides})


def _draw_weights(model: torch.nn.Module, std: float, seed: int, device: torch.device) -> None:
    """LLaMA's initialisation, drawn in place from one seeded generator on ``device``:
    matrices (projections, embeddings) ``N(0, std)``, norm weights 1, other vectors 0."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            if param.ndim >= 2:
                param.normal_(0.0, std, generator=generator)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.zero_()


def build_random_model(
    model: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """A LLaMA causal LM of the preset ``model`` (``random:NAME`` or ``NAME``) with seeded
    random weights, built directly on ``device`` in ``dtype``, in eval mode, with ``sdpa``
    attention.

    Args:
        model: the preset's name.
        dtype: the weights' dtype (a ``torch.dtype`` or its name).
        device: where the weights are created.
        seed: seed of the weights (the same seed gives the same weights on one device).
        overrides: ``LlamaConfig`` fields over the preset's (:func:`random_model_config`).

    Returns:
        a transformers ``LlamaForCausalLM``; its ``config.name_or_path`` is ``model``.

    Raises:
        ValueError: an unknown preset (the message lists them) or override.
    """
    config = random_model_config(preset_named(model), **(overrides or {}))
    config._attn_implementation = "sdpa"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    device = torch.device(device)
    with torch.device(device), no_init_weights():
        built = AutoModelForCausalLM.from_config(config, dtype=dtype)
    built.tie_weights()  # skipped with the initialisation; the output projection is the embedding
    _draw_weights(built, config.initializer_range, seed, device)
    built.config.name_or_path = model
    return built.eval()


def random_token_ids(vocab_size: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """Seeded random token ids ``[batch, length]`` (int64, on the CPU) in ``[0, vocab_size)``:
    the input of a model with random weights, which has no tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)
