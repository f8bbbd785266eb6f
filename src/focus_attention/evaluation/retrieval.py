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

from ..ops.reference import attention_probs

__all__ = ["base_sliding_window", "needle_attention", "needle_attention_by_head"]


def base_sliding_window(model_config: Any, layer: int) -> int | None:
    """The sliding window (tokens, the query included) of the base model's attention in
    ``layer``, or None for full attention: layers that ``config.layer_types`` marks
    ``"sliding_attention"`` (Gemma-2/3), or every layer of a model with a model-wide
    ``sliding_window`` and no layer types (Mistral)."""
    sliding = getattr(model_config, "sliding_window", None)
    if sliding is None:
        return None
    types = getattr(model_config, "layer_types", None)
    if types is None or types[layer] == "sliding_attention":
        return int(sliding)
    return None


@torch.no_grad()
def needle_attention(fm: Any, input_ids: torch.Tensor, span: tuple[int, int]) -> dict[int, float]:
    """Per Focus layer, the largest share of its attention that one head of the prompt's last
    query gives the tokens ``span = (start, end)`` (end excluded), in the dense model: the
    largest of :func:`needle_attention_by_head`'s shares.

    Returns:
        ``{layer: share}``, each share in ``[0, 1]``.

    Raises:
        ValueError: as :func:`needle_attention_by_head`.
    """
    return {layer: max(shares) for layer, shares in needle_attention_by_head(fm, input_ids, span).items()}  # fmt: skip


def needle_attention_by_head(
    fm: Any, input_ids: torch.Tensor, span: tuple[int, int]
) -> dict[int, list[float]]:
    """Per Focus layer and key-value head, the largest share of its attention that one of
    its query heads gives, from the prompt's last query, the tokens ``span = (start, end)``
    (end excluded), in the dense model (the base model's own attention, through
    ``FocusModel.record_dense_attention``, so a base layer's sliding window applies: the
    attention a dense layer or dense head would have; docs/method.md §9).

    Args:
        fm: a :class:`~focus_attention.hf.FocusModel`.
        input_ids: int64 ``[1, N]``, one prompt.
        span: token indices ``0 <= start < end < N`` of the needle.

    Returns:
        ``{layer: [share of key-value head 0, 1, ...]}``, each share in ``[0, 1]`` (the
        softmax mass, computed in float32; logit soft-capping applied where the layer has
        it), the index of the list being the ``kv_head`` of ``FocusConfig.dense_heads``.

    Raises:
        ValueError: a batch other than one prompt, a span outside ``0 <= start < end < N``,
            or Focus disabled (nothing recorded).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"needle_attention: input_ids {tuple(input_ids.shape)}, expected [1, N]")
    start, end = span
    n = input_ids.shape[1]
    if not 0 <= start < end < n:
        raise ValueError(f"needle_attention: span {span} outside 0 <= start < end < N={n}")
    saved = fm.focus_config
    fm.focus_config = saved.replace(dense_layers=(), dense_heads=())  # every head records
    try:
        with fm.record_dense_attention() as records:
            fm(input_ids=input_ids, use_cache=False)
    finally:
        fm.focus_config = saved
    if not records:
        raise ValueError(
            "needle_attention: no Focus layer recorded its attention (called inside "
            "disable_focus(), or on an unloaded model?)"
        )
    out = {}
    for rec in records:
        query = rec["query"][:, :, -1:].float()  # [1, H, 1, D]
        key = rec["key"].float()
        kv_heads = key.shape[1]
        visible = torch.ones(1, 1, key.shape[2], dtype=torch.bool, device=key.device)
        window = base_sliding_window(fm.base_model.config, int(rec["layer"]))
        if window is not None:  # the base layer sees only its last ``window`` keys
            visible[..., : max(0, n - window)] = False
        probs = attention_probs(query, key, visible, rec["scale"], rec["softcap"])
        shares = probs[0, :, 0, start:end].sum(dim=-1)  # [H]
        out[int(rec["layer"])] = shares.view(kv_heads, -1).max(dim=1).values.tolist()
    return out
