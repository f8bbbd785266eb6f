"""The settings of ``focus export`` and the names of an exported model directory
(docs/deploy.md). Imports neither torch nor transformers.

An exported directory is a Hugging Face model directory that transformers loads through its
custom-code mechanism: ``config.json`` (model type :data:`EXPORT_MODEL_TYPE`, the base
model's own config under :data:`BASE_CONFIG_KEY`, the Focus inference settings
:data:`SETTING_FIELDS` at its top level, and an ``auto_map`` naming the classes of
:data:`REMOTE_CODE_NAME`), the base model's weights and generation config, the tokenizer,
the Focus adapter (``focus_config.json``, ``focus_model.safetensors``) and ``README.md``.
"""

from __future__ import annotations

from dataclasses import field

from ..hf.config import INFERENCE_SETTINGS
from ..settings import AdapterOverrides, ModelSettings, settings_class
from ..utils.checks import bad

__all__ = [
    "AUTO_MAP",
    "BASE_CONFIG_KEY",
    "EXPORT_FORMAT_VERSION",
    "EXPORT_MODEL_TYPE",
    "FORMAT_KEY",
    "REMOTE_CODE_NAME",
    "SETTING_FIELDS",
    "ExportConfig",
]

#: ``model_type`` of an exported directory's ``config.json`` (no transformers model has it,
#: so loading without ``trust_remote_code=True`` fails instead of giving the dense base)
EXPORT_MODEL_TYPE = "focus"
#: the custom-code file written into an exported directory
REMOTE_CODE_NAME = "modeling_focus.py"
#: ``config.json`` ``auto_map``: the Auto classes and the classes of :data:`REMOTE_CODE_NAME`
AUTO_MAP = {
    "AutoConfig": "modeling_focus.FocusExportConfig",
    "AutoModelForCausalLM": "modeling_focus.FocusForCausalLM",
}
#: ``config.json`` key holding the base model's config (the ``config.json`` it was saved with)
BASE_CONFIG_KEY = "base_config"
#: ``config.json`` key holding the layout version of an exported directory
FORMAT_KEY = "focus_export_format"
#: version of the exported directory's layout
EXPORT_FORMAT_VERSION = 1
#: the Focus settings ``config.json`` holds at its top level: the inference settings
#: (:data:`~focus_attention.hf.config.INFERENCE_SETTINGS`), which can change at load time
#: (``from_pretrained(dir, trust_remote_code=True, top_k=1)`` or an edit of
#: ``config.json``); the trained shapes stay in ``focus_config.json``
SETTING_FIELDS = tuple(INFERENCE_SETTINGS)


@settings_class()
class ExportConfig(AdapterOverrides, ModelSettings):
    """Settings of ``focus export`` (each field a flag and a key of the ``[export]`` table of
    ``--config``): the base model and adapter to export, the inference settings written
    into the export over the adapter's (:class:`~focus_attention.settings.AdapterOverrides`,
    one value each), and where to write it.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    adapter: str | None = field(
        default=None,
        metadata={"help": "the Focus adapter (required): a folder written by save_pretrained "
                  "or focus train --method focus, or a hub repo id"},
    )  # fmt: skip
    out: str | None = field(
        default=None, metadata={"help": "directory of the exported model (required)"}
    )
    overwrite: bool = field(default=False, metadata={"help": "replace a non-empty --out"})

    def __post_init__(self) -> None:
        self.check_shared()
        for name in ("adapter", "out"):
            if not getattr(self, name):
                raise bad("ExportConfig", name, getattr(self, name), "a directory")
        self.out = str(self.out)
