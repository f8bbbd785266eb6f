"""Focus adapter for Hugging Face causal LMs (docs/method.md §8): config, routers, the
``"focus"`` attention implementation and the PEFT-like ``FocusModel``. Each name is imported
from its module on first access (:mod:`focus_attention.utils.lazy`): the settings
(:mod:`.config`) import without torch or transformers."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            ".architectures": ("SUPPORTED_MODEL_TYPES",),
            ".attention": ("focus_attention_forward", "register_focus_attention"),
            ".base_attention": ("attention_probs",),
            ".cache": ("BufferedDynamicLayer", "FocusCacheLayer", "check_cache"),
            ".config": ("FocusConfig",),
            ".focus_cache": ("FocusCache",),
            ".files": (
                "CONFIG_NAME",
                "STATE_CONFIG_KEY",
                "TRAINER_WEIGHTS_NAME",
                "WEIGHTS_NAME",
                "FocusBaseMismatchWarning",
                "base_model_fingerprint",
            ),
            ".layer_call": ("FocusAttentionDropoutWarning",),
            ".masks": ("FocusMask", "focus_mask_interface"),
            ".model": (
                "FIXED_CONFIG_FIELDS",
                "FocusModel",
                "FocusSlidingWindowWarning",
                "get_focus_model",
            ),
            ".router": ("ROUTER_DTYPE", "FocusRouter"),
            ".static_cache": ("FocusStaticLayer",),
            ".runtime": ("ATTN_IMPLEMENTATION",),
        }
    ),
)
