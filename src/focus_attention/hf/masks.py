"""The ``"focus"`` mask function and the :class:`FocusMask` it returns (docs/method.md §8).

Instead of materialising a mask, the mask function hands the attention function what the
model's mask helper computed (the raw 2-D padding mask, the mask pattern, offsets). A Focus
layer takes causality from positions and padding from the 2-D mask; any other layer builds
its base implementation's mask from it. Only plain causal or sliding-window causal patterns
are accepted (docs/method.md §8); anything else (packed sequences, bidirectional attention,
or/and overlays, prepared 4-D masks) raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    create_masks_for_generate,
    sliding_window_causal_mask_function,
)

from .runtime import ATTN_IMPLEMENTATION, disabled_base_impl

#: queries per block when a non-trivial mask pattern is checked (bounds its memory).
CHECK_BLOCK = 1024


class FocusMask:
    """What the ``"focus"`` mask function hands to the ``"focus"`` attention function.

    Attributes:
        kwargs: the keyword arguments transformers passed to the mask function (batch size,
            lengths, offsets, ``mask_function``, 2-D ``attention_mask``...).
        padding: bool ``[B, L]`` (True = real token) over every token so far, or None.
        routing_state: per Focus layer index, the routing state of this model call that
            activation checkpointing's recomputed forward must reuse (the routing bias a
            soft layer routed with before folding the batch in); one mask per model call,
            so each forward keeps its own however many run before a backward.
    """

    def __init__(self, kwargs: dict) -> None:
        # with a static cache the offsets are the cache's own length tensor, which the layers
        # advance in place: a mask built later (lazily) needs their values of now
        self.kwargs = {k: v.clone() if k.endswith("_offset") and isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}  # fmt: skip
        pad = kwargs.get("attention_mask")
        self.padding: torch.Tensor | None = None if pad is None else pad.to(torch.bool)
        self._base: dict[str, Any] = {}
        self._checked = False
        self._keys: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.routing_state: dict[int, Any] = {}

    @classmethod
    def of_call(cls, padding: torch.Tensor | None, query: torch.Tensor, config: Any,
                local_size: int | None = None) -> FocusMask:  # fmt: skip
        """The mask transformers builds for a causal call without cache of the model with
        ``config`` (sliding-window causal over ``local_size`` tokens when given), with
        ``query`` ``[B, H, N, D]`` under the 2-D ``padding`` mask bool ``[B, N]`` or None:
        what a compiled Focus layer's operator rebuilds from its inputs (its base
        implementation's mask included, built when asked for)."""
        bsz, _, n, _ = query.shape
        kwargs = dict(
            batch_size=bsz, q_length=n, kv_length=n, q_offset=0, kv_offset=0,
            mask_function=causal_mask_function, attention_mask=padding,
            allow_is_causal_skip=True, dtype=query.dtype, config=config, use_vmap=False,
            device=query.device,
        )  # fmt: skip
        if local_size is not None:
            kwargs.update(mask_function=sliding_window_causal_mask_function(local_size),
                          local_size=local_size)  # fmt: skip
        return cls(kwargs)

    def base_mask(self, impl: str) -> Any:
        """The mask the implementation ``impl`` (``"eager"``, ``"sdpa"``...) would have
        received (built once per implementation, lazily)."""
        if impl not in self._base:
            fn = ALL_MASK_ATTENTION_FUNCTIONS[impl]
            self._base[impl] = fn(**self.kwargs)
        return self._base[impl]

    def check_causal(self) -> None:
        """Raise ``ValueError`` unless the mask pattern is plain causal or sliding-window
        causal (padding aside). Checked once per mask object."""
        if self._checked:
            return
        fn = self.kwargs.get("mask_function")
        if fn is not causal_mask_function:
            if self.kwargs.get("use_vmap"):
                raise ValueError(unsupported_mask_message("a custom or/and mask overlay"))
            _check_pattern(fn, self.kwargs)
        self._checked = True

    def keys(self, nk: int, sink_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(real [B, Nk] bool or None, sinks [B, Nk] bool or None)`` for ``nk`` keys.

        Raises:
            ValueError: the 2-D mask does not cover exactly the ``nk`` keys.
        """
        if nk not in self._keys:
            real = self.padding
            if real is not None:
                if real.shape[1] != nk:
                    raise ValueError(
                        f"Focus: the 2-D attention_mask covers {real.shape[1]} tokens but the "
                        f"layer has {nk} keys (past + current); pass a mask over every token"
                    )
                if bool(real.all()):
                    real = None
            self._keys[nk] = (real, sink_keys(real, nk, sink_tokens, self.kwargs["device"]))
        return self._keys[nk]


def unsupported_mask_message(what: str) -> str:
    """The message for a mask a Focus layer cannot take; ``what`` names what it carries."""
    return (
        f"Focus layers support causal attention with a 2-D padding mask only; this call "
        f"carries {what} (packed sequences without attention_mask, bidirectional attention "
        "and mask overlays are not supported)"
    )


def _check_pattern(fn: Callable | None, kw: dict) -> None:
    """Evaluate ``fn`` block by block and compare it with causal / sliding-causal."""
    if fn is None:
        raise ValueError(unsupported_mask_message("no mask function"))
    device = kw.get("device", "cpu")
    b, q_len, kv_len = kw["batch_size"], kw["q_length"], kw["kv_length"]
    q_off, kv_off = int(kw.get("q_offset", 0)), int(kw.get("kv_offset", 0))
    local = kw.get("local_size")
    bidx = torch.arange(b, device=device)[:, None, None, None]
    hidx = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    kv = torch.arange(kv_len, device=device) + kv_off
    causal_ok, sliding_ok = True, local is not None
    for start in range(0, q_len, CHECK_BLOCK):
        q = torch.arange(start, min(q_len, start + CHECK_BLOCK), device=device) + q_off
        try:
            got = fn(bidx, hidx, q[None, None, :, None], kv[None, None, None, :])
            got = torch.as_tensor(got, device=device).expand(b, 1, q.numel(), kv_len)
        except Exception as err:  # an index-based function that cannot broadcast
            raise ValueError(
                unsupported_mask_message(f"a mask function that failed ({err})")
            ) from err
        causal = (kv[None, :] <= q[:, None])[None, None]
        causal_ok = causal_ok and bool((got == causal).all())
        if sliding_ok:
            sliding = causal & (kv[None, :] > q[:, None] - int(local))[None, None]
            sliding_ok = bool((got == sliding).all())
        if not (causal_ok or sliding_ok):
            raise ValueError(unsupported_mask_message("a mask pattern that is not causal"))


def sink_keys(
    real: torch.Tensor | None, nk: int, sink_tokens: int, device: Any
) -> torch.Tensor | None:
    """Keys among the first ``sink_tokens`` real tokens of their sequence, bool ``[B, Nk]``
    (``[1, Nk]`` without padding), or None when ``sink_tokens`` is 0 (docs/method.md §3)."""
    if sink_tokens <= 0:
        return None
    if real is None:
        return (torch.arange(nk, device=device) < sink_tokens)[None, :]
    index = real.long().cumsum(dim=-1) - 1  # index among the real tokens
    return real & (index < sink_tokens)


def focus_mask_interface(**kwargs: Any) -> FocusMask:
    """Mask function registered as ``"focus"`` with ``AttentionMaskInterface``.

    Receives the keyword arguments transformers passes to every mask function
    (``batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
    attention_mask`` (2-D bool ``[B, L]`` or None), ``config``, ``device``, ...) and returns a
    :class:`FocusMask` wrapping them (docs/method.md §8). Whether the model has Focus
    attached is checked by the attention function, which sees the modules. Inside
    ``disable_focus()`` (in the calling thread) it returns the base implementation's own
    mask instead, so the model is called exactly as the base model.
    """
    impl = disabled_base_impl(kwargs.get("config"))
    if impl is not None:
        return ALL_MASK_ATTENTION_FUNCTIONS[impl](**kwargs)
    return FocusMask(kwargs)


class GenerateMasks:
    """The ``create_masks_for_generate`` a wrapped base model gets (set on the instance, where
    ``generate`` looks it up): with a static KV cache, ``generate`` builds the attention masks
    before each forward through it, which with Focus would hand the model a
    :class:`FocusMask` where it expects a 2-D padding mask. While Focus is enabled a call
    returns the 2-D ``attention_mask`` as given (the model then builds its masks in its
    forward, as with a dynamic cache); inside ``disable_focus()`` it runs the base model's
    own function. A class rather than a closure, so a wrapped model still pickles."""

    def __init__(self, base_model: Any) -> None:
        self.base = getattr(base_model, "create_masks_for_generate", create_masks_for_generate)

    def __call__(self, config: Any, inputs_embeds: Any, attention_mask: Any, **kwargs: Any) -> Any:  # fmt: skip
        if config._attn_implementation == ATTN_IMPLEMENTATION and disabled_base_impl(config) is None:  # fmt: skip
            return attention_mask
        return self.base(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs)  # fmt: skip
