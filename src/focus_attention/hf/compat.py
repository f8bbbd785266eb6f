"""Names that changed between transformers releases, resolved once against the installed one.

The package supports ``transformers>=5.0,<6``. Later 5.x releases renamed the KV cache
keyword of model calls and outputs (``past_key_values`` became ``cache``) and the activation
checkpointing methods (``gradient_checkpointing_enable`` became
``activation_checkpointing_enable``, ``is_gradient_checkpointing`` became
``is_activation_checkpointing``), keeping the old names as deprecated aliases that raise
``FutureWarning``. The package's own calls go through this module, which uses the new names
where the installed release has them and the old ones on earlier releases (docs/method.md
§8).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

from transformers import GenerationMixin, PreTrainedModel

#: keyword (and output attribute) of the KV cache in model calls of the installed release:
#: ``"cache"``, or ``"past_key_values"`` before the rename
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
#: whether the installed release names the checkpointing methods ``activation_checkpointing_*``
ACTIVATION_CHECKPOINTING = hasattr(PreTrainedModel, "activation_checkpointing_enable")


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{CACHE_KWARG: cache}``: the keyword argument that hands a model call its KV cache."""
    return {CACHE_KWARG: cache}


def cache_of(output: Any) -> Any:
    """The KV cache a model call returned (``output.cache``, or ``output.past_key_values``
    before the rename); None when the output carries none."""
    return getattr(output, CACHE_KWARG, None)


def enable_activation_checkpointing(model: Any, use_reentrant: bool | None = None) -> None:
    """Turn on activation checkpointing of a ``PreTrainedModel`` (or a :class:`FocusModel`,
    which forwards the call to its base model).

    Args:
        model: the model.
        use_reentrant: ``torch.utils.checkpoint``'s ``use_reentrant``; None keeps
            transformers' default.
    """
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if ACTIVATION_CHECKPOINTING:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def activation_checkpointing_enabled(model: Any) -> bool:
    """Whether activation checkpointing is on for ``model`` (``is_activation_checkpointing``,
    or ``is_gradient_checkpointing`` before the rename)."""
    name = (
        "is_activation_checkpointing" if ACTIVATION_CHECKPOINTING else "is_gradient_checkpointing"
    )
    return bool(getattr(model, name))


@contextlib.contextmanager
def peft_reads_old_names() -> Iterator[None]:
    """Silence the ``FutureWarning`` that transformers raises when peft (0.21) reads the
    deprecated alias ``is_gradient_checkpointing`` while it wraps a model; the package's own
    calls use :func:`activation_checkpointing_enabled`, so only peft's read is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        yield
