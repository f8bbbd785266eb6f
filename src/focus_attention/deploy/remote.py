"""The model class transformers' custom-code mechanism loads from an exported directory
(its ``config.json`` ``auto_map`` names it through ``modeling_focus.py``; docs/deploy.md):
its ``from_pretrained`` returns the base model with Focus attached
(:func:`focus_attention.deploy.loading.load_exported`)."""

from __future__ import annotations

import os
from typing import Any

from transformers import PreTrainedModel

from .config import FocusExportConfig
from .loading import load_exported

__all__ = ["FocusForCausalLM"]


class FocusForCausalLM(PreTrainedModel):
    """The ``AutoModelForCausalLM`` entry of an exported Focus model (docs/deploy.md).

    Never instantiated: :meth:`from_pretrained` returns the base model's own class (for
    example ``LlamaForCausalLM``) with Focus attached, so every tool that takes a
    transformers model takes it; ``model.focus_model`` is its
    :class:`~focus_attention.hf.FocusModel`.
    """

    config_class = FocusExportConfig
    base_model_prefix = "model"

    def __init__(self, config: FocusExportConfig, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "FocusForCausalLM is not built from a config: load an exported Focus model with "
            "AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True), or wrap a "
            "base model with focus_attention.get_focus_model"
        )

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any, **kwargs: Any
    ) -> PreTrainedModel:
        """The exported model in ``pretrained_model_name_or_path`` (a directory or a hub
        repo id): :func:`~focus_attention.deploy.loading.load_exported`, which documents the
        arguments, returns and errors."""
        return load_exported(pretrained_model_name_or_path, *model_args, **kwargs)
