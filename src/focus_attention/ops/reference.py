"""Dense masked softmax attention: the oracle every fast path is tested against."""

from __future__ import annotations

import math

import torch


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat ``[B, H_kv, N, D]`` key/value heads to ``[B, H, N, D]`` (GQA/MQA sharing:
    query head ``h`` uses key/value head ``h // (H // H_kv)``)."""
    h_kv = x.shape[1]
    if h_kv == num_heads:
        return x
    return x.repeat_interleave(num_heads // h_kv, dim=1)


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention under an explicit boolean mask: logits in the inputs' dtype,
    softmax in fp32 (float64 for float64 inputs), as eager attention does.

    A query row with no visible key outputs zeros and log-sum-exp ``-inf``, never NaN
    (docs/method.md §3). ``O(Nq * Nk)`` memory: an oracle, not a fast path.

    Args:
        query: ``[B, H, Nq, D]``; key, value: ``[B, H_kv, Nk, D]`` with ``H % H_kv == 0``.
        mask: bool ``[B, Nq, Nk]`` (shared by all heads) or ``[B, H, Nq, Nk]``; True = visible.
        scale: logit scale, default ``D ** -0.5``.
        softcap: optional Gemma-2 logit soft-capping ``c * tanh(logits / c)``.

    Returns:
        ``(out [B, H, Nq, D] in query's dtype, lse [B, H, Nq] float32 or float64)``.
    """
    num_heads, d = query.shape[1], query.shape[-1]
    scale = d**-0.5 if scale is None else scale
    k = expand_kv_heads(key, num_heads)
    v = expand_kv_heads(value, num_heads)
    logits = (query @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if mask.ndim == 3:
        mask = mask[:, None]
    logits = logits.masked_fill(~mask, float("-inf"))
    row_any = mask.any(dim=-1, keepdim=True)
    logits = torch.where(row_any, logits, torch.zeros_like(logits))
    ct = torch.promote_types(logits.dtype, torch.float32)  # fp32, fp64 for float64 inputs
    lse = torch.logsumexp(logits.to(ct), dim=-1)
    probs = torch.softmax(logits.to(ct), dim=-1).to(query.dtype)
    probs = torch.where(row_any, probs, torch.zeros_like(probs))
    lse = torch.where(row_any[..., 0], lse, torch.full_like(lse, -math.inf))
    return probs @ v, lse
