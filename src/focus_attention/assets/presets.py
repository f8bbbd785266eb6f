"""Model shapes with random weights: a registry of presets, one row per preset, that the
benchmarks build from a configuration alone (no download, no tokenizer) to time a model of
that size (:func:`focus_attention.assets.random_models.build_random_model`).

A benchmark's ``--model random:NAME`` names a preset; its token ids are seeded random ids in
the preset's vocabulary, and its results record that the weights are random. Speed depends
on the shapes, not on the values, so these time what a real checkpoint of the same shape
would, without one; quality means nothing on them.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "PRESETS",
    "RANDOM_PREFIX",
    "ModelPreset",
    "is_random_model",
    "preset_named",
]

#: the prefix of a ``--model`` value that names a preset with random weights
RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class ModelPreset:
    """One LLaMA-architecture shape (transformers' ``LlamaConfig`` fields of the same names).

    Attributes:
        name: registry name (``random:NAME``).
        description: the model whose shape this is, one line.
        hidden_size: d_model.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads H.
        num_key_value_heads: key-value heads H_kv (H a multiple of it).
        head_dim: D.
        intermediate_size: the MLP's inner width.
        vocab_size: tokens of the vocabulary (the ids drawn for inputs).
        rope_theta: rotary base.
        max_position_embeddings: positions the model is configured for.
        tie_word_embeddings: whether the output projection is the input embedding.
        rms_norm_eps: epsilon of the RMS norms.
    """

    name: str
    description: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-5

    def config_fields(self) -> dict[str, Any]:
        """The ``LlamaConfig`` keyword arguments of this shape (``rope_theta`` as
        ``rope_parameters``)."""
        fields = asdict(self)
        for key in ("name", "description", "rope_theta"):
            fields.pop(key)
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        return fields


_ROWS = (
    ModelPreset(
        name="llama-3.2-1b",
        description="Llama-3.2-1B's shape (16 layers, GQA 32/8, D 64, tied embeddings)",
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    ModelPreset(
        name="llama-3-8b",
        description="Llama-3-8B's shape (32 layers, GQA 32/8, D 128; Llama-3.1's 131,072 "
        "positions)",
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False,
    ),
    ModelPreset(
        name="smollm2-135m",
        description="SmolLM2-135M's shape (30 layers, GQA 9/3, D 64, tied embeddings)",
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    ModelPreset(
        name="llama-tiny",
        description="a tiny LLaMA (2 layers, GQA 4/2, D 16) for runs on the CPU in seconds",
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=512, rope_theta=10000.0,
        max_position_embeddings=65536, tie_word_embeddings=True,
    ),
)  # fmt: skip
#: the presets by name, in the order the help lists them
PRESETS: dict[str, ModelPreset] = {row.name: row for row in _ROWS}


def is_random_model(model: str | None) -> bool:
    """Whether a ``--model`` value names a preset with random weights (``random:NAME``)."""
    return isinstance(model, str) and model.startswith(RANDOM_PREFIX)


def preset_named(model: str) -> ModelPreset:
    """The preset of ``random:NAME`` (or of ``NAME``).

    Raises:
        ValueError: an unknown name; the message lists the presets.
    """
    name = model.removeprefix(RANDOM_PREFIX)
    if name not in PRESETS:
        known = ", ".join(RANDOM_PREFIX + n for n in PRESETS)
        raise ValueError(f"unknown model preset {model!r}: the presets are {known}")
    return PRESETS[name]
