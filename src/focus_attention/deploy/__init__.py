"""Deployment (docs/deploy.md): a Focus model exported as a model directory any
transformers tool loads (:func:`export_model`, ``focus export``; loaded through
``trust_remote_code`` by :func:`load_exported`), adapters shared on the Hugging Face hub
(:func:`resolve_adapter`, :func:`push_adapter`) and their model cards. Each name is imported
from its module on first access (:mod:`focus_attention.utils.lazy`): the settings
(:mod:`.settings`) import without torch or transformers."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            "..hf.card": ("adapter_card", "export_card", "read_records"),
            ".config": ("FocusExportConfig",),
            ".export": ("export_adapter", "export_model"),
            "..hf.hub": ("push_adapter", "resolve_adapter"),
            ".loading": ("load_exported",),
            ".remote": ("FocusForCausalLM",),
            ".settings": ("ExportConfig",),
        }
    ),
)
