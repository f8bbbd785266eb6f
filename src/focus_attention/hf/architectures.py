"""Per-model-type details of the supported Hugging Face causal LMs (docs/method.md §8).

Every supported model computes its attention through transformers' ``AttentionInterface``,
so Focus needs from each architecture only: which modules are the self-attention blocks,
their layer index, the model width, and which layers are already sliding-window. The
attention details themselves (GPT-2's ``scale_attn_by_inverse_layer_idx``, Gemma-2's
``query_pre_attn_scalar`` and logit softcap, GQA, QK-norm, biases) reach the Focus attention
function through the module (``module.scaling``) and the ``scaling`` / ``softcap`` keyword
arguments the model passes, so they need no per-architecture code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Architecture:
    """How Focus finds the attention blocks of one model type.

    Attributes:
        model_type: ``config.model_type``.
        attention_classes: class names of the self-attention modules.
        routing_input: what the router sees (the hidden state entering the attention module).
    """

    model_type: str
    attention_classes: tuple[str, ...]
    routing_input: str = "the block's input norm output"


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("gpt2", ("GPT2Attention",), "ln_1 output"),
        Architecture("llama", ("LlamaAttention",), "input_layernorm output"),
        Architecture("mistral", ("MistralAttention",), "input_layernorm output"),
        Architecture("qwen2", ("Qwen2Attention",), "input_layernorm output"),
        Architecture("gemma2", ("Gemma2Attention",), "input_layernorm output"),
        Architecture("gemma3_text", ("Gemma3Attention",), "input_layernorm output"),
        # OLMo-2 normalises after attention: its attention input is the residual stream.
        Architecture("olmo2", ("Olmo2Attention",), "the residual stream (OLMo-2 is post-norm)"),
    )
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(ARCHITECTURES)


def get_architecture(model: nn.Module) -> Architecture:
    """The :class:`Architecture` of ``model``.

    Raises:
        ValueError: the model has no ``config.model_type`` or it is not supported; the message
            lists the supported types.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"Focus does not support model type {model_type!r} "
            f"({type(model).__name__}); supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return ARCHITECTURES[model_type]


def attention_modules(model: nn.Module, arch: Architecture) -> dict[int, nn.Module]:
    """Self-attention modules of ``model`` keyed by layer index (cross-attention excluded).

    Raises:
        ValueError: none found, or two modules claim the same layer index.
    """
    found: dict[int, nn.Module] = {}
    for _, module in model.named_modules():
        if type(module).__name__ not in arch.attention_classes:
            continue
        if getattr(module, "is_cross_attention", False):
            continue
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            raise ValueError(f"{type(module).__name__} has no integer layer_idx ({idx!r})")
        if idx in found:
            raise ValueError(f"two attention modules claim layer index {idx}")
        found[idx] = module
    if not found:
        raise ValueError(f"no {arch.attention_classes} modules found in {type(model).__name__}")
    return dict(sorted(found.items()))


def layer_types(config, num_layers: int) -> list[str]:
    """Per-layer attention type: ``config.layer_types`` where the model declares it (Gemma-2/3,
    Qwen-2), else ``"full_attention"`` for every layer. Mistral's model-wide
    ``sliding_window`` is not a per-layer type: Focus layers replace it and warn (``FocusSlidingWindowWarning``)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return ["full_attention"] * num_layers
    return list(types)[:num_layers]


def hidden_size(config) -> int:
    """Model width ``d_model`` (``n_embd`` on GPT-2, an alias of ``hidden_size``)."""
    return int(config.hidden_size)


def text_config_of(model_config: Any) -> Any:
    """The text (decoder) config of a transformers config: ``get_text_config()`` where the
    config has it (a multimodal model's language part), else the config itself."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config  # fmt: skip


def kv_heads_of(model_config: Any) -> int:
    """Key-value heads per layer of a transformers config, read from its text config where
    it has one (``num_key_value_heads``, else ``num_attention_heads``: no grouped-query
    attention)."""
    text = text_config_of(model_config)
    return int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
