"""The config of an exported Focus model (``config.json`` of a directory written by
``focus export``; docs/deploy.md): the base model's config, the Focus inference settings and
the layout version. transformers loads it through ``modeling_focus.py`` (``auto_map``)."""

from __future__ import annotations

from typing import Any

from transformers import CONFIG_MAPPING, PreTrainedConfig

from ..hf.config import INFERENCE_SETTINGS, InferenceSetting
from .settings import BASE_CONFIG_KEY, EXPORT_MODEL_TYPE

__all__ = ["FocusExportConfig", "base_config_of", "declare_settings", "json_type"]


def json_type(setting: InferenceSetting) -> str:
    """The annotation of an inference setting's ``config.json`` field: its value as JSON
    holds it (a list for a list setting), or None (the adapter's own)."""
    value = "list" if setting.is_list else setting.type.removesuffix(" | None")
    return f"{value} | None"


def declare_settings(namespace: dict[str, Any]) -> None:
    """Declare in a config class body's ``namespace`` one field per inference setting of
    :data:`~focus_attention.hf.config.INFERENCE_SETTINGS`, in its order: type
    :func:`json_type`, default None. (transformers makes a config class a dataclass as
    soon as it is defined, so the fields go into its body.)"""
    annotations = namespace.setdefault("__annotations__", {})
    for name, setting in INFERENCE_SETTINGS.items():
        annotations[name] = json_type(setting)
        namespace[name] = None


class FocusExportConfig(PreTrainedConfig):
    """``config.json`` of an exported Focus model (docs/deploy.md).

    Attributes:
        base_config: the base model's config as a dict (its ``config.json``).
        focus_export_format: the layout version of the exported directory.
        window, sink_tokens, dense_layers, ...: one field per inference setting
            (:data:`~focus_attention.hf.config.INFERENCE_SETTINGS`): the settings the model
            loads with (None: the adapter's own); a keyword of ``from_pretrained`` with one
            of these names, or an edit of ``config.json``, changes them
            (:class:`~focus_attention.hf.FocusConfig` documents each).
    """

    model_type = EXPORT_MODEL_TYPE

    base_config: dict | None = None
    focus_export_format: int | None = None
    declare_settings(locals())

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None):
        """The base model's text config (its own class, :func:`base_config_of`): tools that
        read the model's shape from the directory's config (``transformers serve`` takes its
        context length, ``max_position_embeddings``, from here) see the base model's. The
        export's own config while no valid base config is set (during construction)."""
        data = getattr(self, BASE_CONFIG_KEY, None)
        if not isinstance(data, dict) or data.get("model_type") not in CONFIG_MAPPING:
            return super().get_text_config(decoder=decoder, encoder=encoder)
        return base_config_of(self).get_text_config(decoder=decoder, encoder=encoder)


def base_config_of(config: FocusExportConfig) -> PreTrainedConfig:
    """The base model's config held by ``config`` (its own transformers config class).

    Raises:
        ValueError: no base config, or one of a model type transformers does not know.
    """
    data = getattr(config, BASE_CONFIG_KEY, None)
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(
            f"config.json of an exported Focus model: {BASE_CONFIG_KEY!r} must be the base "
            f"model's config (a dict with its model_type), received {type(data).__name__}"
        )
    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"config.json of an exported Focus model: the base model type {model_type!r} is "
            "not one this version of transformers knows"
        )
    return CONFIG_MAPPING[model_type].from_dict(dict(data))
