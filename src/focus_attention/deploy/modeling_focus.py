"""Custom code of an exported Focus model (docs/deploy.md), copied into the directory as
``modeling_focus.py``: transformers imports it when a model is loaded with
``trust_remote_code=True`` (``config.json`` ``auto_map``). It only imports the classes from
the installed ``focus-attention`` package, which does the work."""

try:
    from focus_attention.deploy.config import FocusExportConfig
    from focus_attention.deploy.remote import FocusForCausalLM
except ImportError as err:
    raise ImportError(
        "this model uses Focus sparse attention, which needs the focus-attention package (the "
        "Python package focus_attention, with its torch and transformers), installed from a "
        f"clone of its repository: pip install ./focus-attention; importing it failed: {err}"
    ) from err

__all__ = ["FocusExportConfig", "FocusForCausalLM"]
