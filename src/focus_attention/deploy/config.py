"""The config of an exported Focus model (``config.json`` of a directory written by
``focus export``; docs/deploy.md): the base model's config, the Focus inference settings in
their own table, the base model's name and the layout version. transformers loads it
through ``modeling_focus.py`` (``auto_map``)."""

from __future__ import annotations

from transformers import CONFIG_MAPPING, PreTrainedConfig

from .settings import BASE_CONFIG_KEY, EXPORT_MODEL_TYPE

__all__ = ["FocusExportConfig", "base_config_of"]


class FocusExportConfig(PreTrainedConfig):
    """``config.json`` of an exported Focus model (docs/deploy.md).

    Attributes:
        base_config: the base model's config as a dict (its ``config.json``).
        focus_export_format: the layout version of the exported directory.
        focus: the Focus inference settings the model loads with, by name (those of
            :data:`~focus_attention.hf.config.INFERENCE_SETTINGS`; a missing one is the
            adapter's own). A ``from_pretrained`` keyword of a setting's name
            (``top_k=1``), or an edit of this table, changes them
            (:class:`~focus_attention.hf.FocusConfig` documents each). They are not
            top-level keys, which readers of a model config take for their own
            (``GenerationConfig.from_model_config`` reads ``top_k`` as sampling's).
            Exports of layout 1 hold them at the top level instead.
        focus_base_model: the base model's name, as the model card names it.
    """

    model_type = EXPORT_MODEL_TYPE

    base_config: dict | None = None
    focus_export_format: int | None = None
    focus: dict | None = None
    focus_base_model: str | None = None

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
