"""Soft-gated dense attention for training with Sinkhorn routing (spec section 3).

Both gates cost one extra ``[B, Nq, Nk]`` affinity matrix shared by all heads on top of eager
dense attention: ``O(N^2)``, as the paper says (no training speed-up is claimed).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from ._checks import check_device, check_positive, check_shape, check_tensor, fail
from .masks import check_groups, effective_window
from .reference import expand_kv_heads

Gate = Literal["paper", "log"]
GATES = ("paper", "log")


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    check_tensor("query", query, 4, floating=True)
    check_tensor("key", key, 4, floating=True)
    check_tensor("value", value, 4, floating=True)
    b, h, _, d = query.shape
    if key.shape[0] != b or key.shape[-1] != d:
        fail("key", f"shape {tuple(key.shape)}", f"[B={b}, H_kv, Nk, D={d}]")
    if value.shape != key.shape:
        fail("value", f"shape {tuple(value.shape)}", f"the key's shape {tuple(key.shape)}")
    if key.shape[1] < 1 or h % key.shape[1] != 0:
        fail("key", f"H_kv = {key.shape[1]} for H = {h} query heads", "H % H_kv == 0")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        fail("key/value", f"dtypes {key.dtype}/{value.dtype}", f"the query's dtype {query.dtype}")
    if d < 1:
        fail("query", f"head_dim D = {d}", "D >= 1")
    check_device("key", key, query.device, "query")
    check_device("value", value, query.device, "query")


def gated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_probs: torch.Tensor,
    key_probs: torch.Tensor,
    window: int,
    *,
    gate: Gate = "log",
    sharpness: float = 10.0,
    eps: float = 1e-6,
    scale: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    always_visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal attention whose distant logits are gated by soft group affinities.

    With ``a_ij = g_i . g_j`` (dot product of the Sinkhorn rows of query ``i`` and key ``j``)
    and ``local(i, j) = 0 <= i - j < window``:

    - ``gate="paper"`` (paper Eq. 2): ``s_ij = (q_i . k_j) * scale * m_ij`` with
      ``m_ij = 1`` if local else ``sigmoid(sharpness * a_ij)``. Never below 0.5 for
      ``a_ij >= 0``: it tempers distant logits, it does not prune them.
    - ``gate="log"`` (product decision): ``s_ij = (q_i . k_j) * scale + log(eps + a_ij)`` on
      distant pairs. With one-hot rows this is exactly the hard top-k mask, so the soft and
      the inference paths share their limit.

    Causality (``j <= i``, queries bottom-right aligned) and padding are applied as boolean
    masks; a query row with nothing visible outputs zeros. Differentiable everywhere
    (including the gate) and finite in fp16/bf16.

    Args:
        query: ``[B, H, Nq, D]``; key, value: ``[B, H_kv, Nk, D]``, ``H % H_kv == 0``.
        query_probs: ``[B, Nq, K]`` float routing rows (Sinkhorn output) of the queries.
        key_probs: ``[B, Nk, K]`` float routing rows of the keys.
        window: local window in tokens, ``>= 1``.
        gate: ``"paper"`` or ``"log"``.
        sharpness: ``lambda`` of the paper gate (not given in the paper; product default 10).
        eps: floor inside the log gate.
        scale: logit scale, default ``D ** -0.5``; softcap: optional Gemma-2 soft-capping,
            applied before the gate.
        key_padding_mask: optional bool ``[B, Nk]``, True = real token.
        always_visible: optional bool ``[B, Nk]``: keys every later query sees ungated
            (attention-sink tokens, product decision).

    Returns:
        ``[B, H, Nq, D]`` in the query's dtype.

    Raises:
        ValueError: malformed shapes or dtypes, unknown gate, ``window < 1``, ``scale`` or
            ``softcap`` not a finite number > 0.
    """
    _check_qkv(query, key, value)
    if gate not in GATES:
        fail("gate", repr(gate), f"one of {GATES}")
    b, h, nq, d = query.shape
    nk = key.shape[2]
    check_tensor("query_probs", query_probs, 3, floating=True)
    check_tensor("key_probs", key_probs, 3, floating=True)
    check_shape("query_probs", query_probs, (b, nq, query_probs.shape[-1]), "[B, Nq, K]")
    check_shape("key_probs", key_probs, (b, nk, query_probs.shape[-1]), "[B, Nk, K]")
    # reuse the group-mask validation for window / padding / Nq <= Nk
    check_groups(
        torch.zeros(b, nq, 1, dtype=torch.bool, device=query.device),
        torch.zeros(b, nk, 1, dtype=torch.bool, device=query.device),
        key_padding_mask,
        window,
    )
    check_device("query_probs", query_probs, query.device, "query")
    check_device("key_probs", key_probs, query.device, "query")
    scale = check_positive("scale", scale)
    softcap = check_positive("softcap", softcap)
    scale = d**-0.5 if scale is None else scale
    device = query.device
    qpos = torch.arange(nk - nq, nk, device=device)[:, None]
    kpos = torch.arange(nk, device=device)[None, :]
    causal = (kpos <= qpos)[None]  # [1, Nq, Nk]
    local = ((qpos - kpos) < effective_window(window, nk))[None]
    if always_visible is not None:
        check_shape("always_visible", always_visible, (b, nk), "[B, Nk] bool")
        local = local | always_visible[:, None, :]
    visible = causal if key_padding_mask is None else causal & key_padding_mask[:, None, :]
    # fp32 (fp64 for float64 inputs, e.g. gradcheck)
    ct = torch.promote_types(torch.promote_types(query.dtype, query_probs.dtype), torch.float32)
    affinity = query_probs.to(ct) @ key_probs.to(ct).transpose(1, 2)  # [B, Nq, Nk]

    k = expand_kv_heads(key, h)
    v = expand_kv_heads(value, h)
    # Everything that does not depend on the head is folded into one [B, 1, Nq, Nk] tensor,
    # so the per-head logits take a single extra pass (as eager attention's scale + mask).
    # A row with no visible key (padding) is computed as if every key were visible and its
    # output zeroed afterwards, so softmax never sees an all -inf row (no NaN gradient).
    row_any = visible.any(dim=-1, keepdim=True)  # [B, Nq, 1]
    visible = visible | ~row_any
    neg_inf = torch.full((), -math.inf, device=device)
    qk = query @ k.transpose(-1, -2)  # [B, H, Nq, Nk] in the input dtype
    qk = qk.to(ct)
    if softcap is not None:
        qk = softcap * torch.tanh(qk * (scale / softcap))
        scale_factor = 1.0
    else:
        scale_factor = scale
    if gate == "paper":
        factor = torch.where(local, torch.ones_like(affinity), torch.sigmoid(sharpness * affinity))
        mask_bias = torch.where(visible, torch.zeros_like(affinity), neg_inf)
        logits = torch.addcmul(mask_bias[:, None], qk, (factor * scale_factor)[:, None])
    else:
        bias = torch.where(local, torch.zeros_like(affinity), torch.log(eps + affinity))
        bias = torch.where(visible, bias, neg_inf)
        logits = torch.add(bias[:, None], qk, alpha=scale_factor)
    probs = torch.softmax(logits, dim=-1).to(query.dtype)
    out = probs @ v
    return out * row_any[:, None].to(out.dtype)
