"""The settings of ``focus export`` and the names of an exported model directory
(docs/deploy.md). Imports neither torch nor transformers.

An exported directory is a Hugging Face model directory that transformers loads through its
custom-code mechanism: ``config.json`` (model type :data:`EXPORT_MODEL_TYPE`, the base
model's own config under :data:`BASE_CONFIG_KEY`, the Focus inference settings
:data:`SETTING_FIELDS` in the table :data:`SETTINGS_KEY`, the base model's name under
:data:`BASE_NAME_KEY`, and an ``auto_map`` naming the classes of :data:`REMOTE_CODE_NAME`),
the base model's weights and generation config, the tokenizer, the Focus adapter
(``focus_config.json``, ``focus_model.safetensors``), the adapter's records
(``train_config.json``, ``focus eval`` results) and ``README.md``.

The settings sit in their own table because readers of a model's config take its top-level
keys for their own: ``GenerationConfig.from_model_config`` reads a top-level ``top_k`` as
sampling's. Exports of the first layout (:data:`READABLE_FORMATS`), which kept the settings
at the top level, still load.
"""

from __future__ import annotations

import json
from dataclasses import field
from typing import Any

from ..hf.config import INFERENCE_SETTINGS
from ..settings import AdapterOverrides, ModelSettings, settings_class
from ..utils.checks import bad

__all__ = [
    "AUTO_MAP",
    "BASE_CONFIG_KEY",
    "BASE_NAME_KEY",
    "EXPORT_FORMAT_VERSION",
    "EXPORT_MODEL_TYPE",
    "FORMAT_KEY",
    "READABLE_FORMATS",
    "REMOTE_CODE_NAME",
    "SETTINGS_KEY",
    "SETTING_FIELDS",
    "ExportConfig",
    "exported_settings",
    "with_settings",
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
#: version of the exported directory's layout (1: the settings at the top level of
#: ``config.json``; 2: in its :data:`SETTINGS_KEY` table)
EXPORT_FORMAT_VERSION = 2
#: the layout versions this version of the package loads
READABLE_FORMATS = (1, 2)
#: ``config.json`` key holding the Focus inference settings (a table of
#: :data:`SETTING_FIELDS`), where no reader of a model config's own keys finds them
SETTINGS_KEY = "focus"
#: ``config.json`` key holding the base model's name (as the model card names it), so that
#: a model loaded from the export and saved again still names it
BASE_NAME_KEY = "focus_base_model"
#: the Focus settings of ``config.json``'s :data:`SETTINGS_KEY` table: the inference
#: settings (:data:`~focus_attention.hf.config.INFERENCE_SETTINGS`), which can change at
#: load time (``from_pretrained(dir, trust_remote_code=True, top_k=1)`` or an edit of the
#: table); the trained shapes stay in ``focus_config.json``
SETTING_FIELDS = tuple(INFERENCE_SETTINGS)


def exported_settings(document: dict[str, Any]) -> dict[str, Any]:
    """The Focus inference settings an exported ``config.json`` ``document`` holds, by name
    (those it has): its :data:`SETTINGS_KEY` table, or its top-level keys in the first
    layout."""
    if document.get(FORMAT_KEY) == 1:
        return {k: document[k] for k in SETTING_FIELDS if k in document}
    table = document.get(SETTINGS_KEY)
    return dict(table) if isinstance(table, dict) else {}


def with_settings(document: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of the exported ``config.json`` ``document`` with the Focus settings
    ``changes`` (by name) over its own, in the document's layout (values as JSON holds
    them: tuples become lists)."""
    changes = json.loads(json.dumps(changes))
    out = json.loads(json.dumps(document))
    if out.get(FORMAT_KEY) == 1:
        out.update(changes)
    else:
        out[SETTINGS_KEY] = {**exported_settings(out), **changes}
    return out


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
