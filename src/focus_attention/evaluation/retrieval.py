"""Which layers retrieve: the share of attention the last query of a prompt gives a span of
earlier tokens (a needle), per layer, from the dense model (docs/method.md §9).

Retrieval from far back (a number hidden in a long prompt, a fact given early) runs through
a few heads that attend from the question straight to the needle; a layer whose grouping
drops those keys loses the answer. Ranking the layers by the attention their strongest head
gives the needle, on prompts of the validation split, picks the layers to keep dense
(``FocusConfig.dense_layers``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["needle_attention"]


@torch.no_grad()
def needle_attention(fm: Any, input_ids: torch.Tensor, span: tuple[int, int]) -> dict[int, float]:
    """Per Focus layer, the largest share of its attention that one head of the prompt's last
    query gives the tokens ``span = (start, end)`` (end excluded), in the dense model (Focus
    disabled for the call, through ``FocusModel.record_dense_attention``).

    Args:
        fm: a :class:`~focus_attention.hf.FocusModel`.
        input_ids: int64 ``[1, N]``, one prompt.
        span: token indices ``0 <= start < end < N`` of the needle.

    Returns:
        ``{layer: share}``, each share in ``[0, 1]`` (the softmax mass, computed in float32,
        of the best head; logit soft-capping applied where the layer has it).

    Raises:
        ValueError: a batch other than one prompt, or a span outside ``0 <= start < end < N``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"needle_attention: input_ids {tuple(input_ids.shape)}, expected [1, N]")
    start, end = span
    n = input_ids.shape[1]
    if not 0 <= start < end < n:
        raise ValueError(f"needle_attention: span {span} outside 0 <= start < end < N={n}")
    saved = fm.focus_config
    fm.focus_config = saved.replace(dense_layers=())  # every Focus layer records
    try:
        with fm.record_dense_attention() as records:
            fm(input_ids=input_ids, use_cache=False)
    finally:
        fm.focus_config = saved
    out = {}
    for rec in records:
        query = rec["query"][:, :, -1:].float()  # [1, H, 1, D]
        key = rec["key"].float()
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        logits = (query @ key.transpose(-1, -2)) * rec["scale"]
        if rec["softcap"] is not None:
            logits = rec["softcap"] * torch.tanh(logits / rec["softcap"])
        probs = logits.softmax(dim=-1)[0, :, 0]  # [H, N]
        out[int(rec["layer"])] = float(probs[:, start:end].sum(dim=-1).max())
    return out
