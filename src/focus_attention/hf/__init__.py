"""Focus adapter for Hugging Face causal LMs (issue 3): config, routers, the ``"focus"``
attention implementation and the PEFT-like ``FocusModel``."""

from .architectures import SUPPORTED_MODEL_TYPES
from .attention import (
    ATTN_IMPLEMENTATION,
    FocusCacheLayer,
    FocusMask,
    focus_attention_forward,
    focus_mask_interface,
    register_focus_attention,
)
from .config import FocusConfig
from .model import (
    CONFIG_NAME,
    FIXED_CONFIG_FIELDS,
    WEIGHTS_NAME,
    FocusBaseMismatchWarning,
    FocusModel,
    base_model_fingerprint,
    get_focus_model,
)
from .router import FocusRouter

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_NAME",
    "FIXED_CONFIG_FIELDS",
    "SUPPORTED_MODEL_TYPES",
    "WEIGHTS_NAME",
    "FocusBaseMismatchWarning",
    "FocusCacheLayer",
    "FocusConfig",
    "FocusMask",
    "FocusModel",
    "FocusRouter",
    "base_model_fingerprint",
    "focus_attention_forward",
    "focus_mask_interface",
    "get_focus_model",
    "register_focus_attention",
]
