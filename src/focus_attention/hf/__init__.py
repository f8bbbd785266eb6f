"""Focus adapter for Hugging Face causal LMs (docs/method.md §8): config, routers, the
``"focus"`` attention implementation and the PEFT-like ``FocusModel``."""

from .architectures import SUPPORTED_MODEL_TYPES
from .attention import (
    FocusAttentionDropoutWarning,
    attention_probs,
    focus_attention_forward,
    register_focus_attention,
)
from .cache import BufferedDynamicLayer, FocusCacheLayer, check_dynamic_cache
from .config import FocusConfig
from .files import (
    CONFIG_NAME,
    STATE_CONFIG_KEY,
    TRAINER_WEIGHTS_NAME,
    WEIGHTS_NAME,
    FocusBaseMismatchWarning,
    base_model_fingerprint,
)
from .masks import FocusMask, focus_mask_interface
from .model import (
    FIXED_CONFIG_FIELDS,
    FocusModel,
    FocusSlidingWindowWarning,
    get_focus_model,
)
from .router import ROUTER_DTYPE, FocusRouter
from .runtime import ATTN_IMPLEMENTATION

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_NAME",
    "FIXED_CONFIG_FIELDS",
    "ROUTER_DTYPE",
    "STATE_CONFIG_KEY",
    "SUPPORTED_MODEL_TYPES",
    "TRAINER_WEIGHTS_NAME",
    "WEIGHTS_NAME",
    "BufferedDynamicLayer",
    "FocusAttentionDropoutWarning",
    "FocusBaseMismatchWarning",
    "FocusCacheLayer",
    "FocusConfig",
    "FocusMask",
    "FocusModel",
    "FocusRouter",
    "FocusSlidingWindowWarning",
    "attention_probs",
    "base_model_fingerprint",
    "check_dynamic_cache",
    "focus_attention_forward",
    "focus_mask_interface",
    "get_focus_model",
    "register_focus_attention",
]
