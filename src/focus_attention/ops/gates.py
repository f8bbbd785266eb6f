"""Soft-gated dense attention for training with Sinkhorn routing (docs/method.md §3).

``backend="dense"``: both gates cost one extra ``[B, Nq, Nk]`` affinity matrix shared by all
heads on top of eager dense attention: ``O(N^2)`` memory, as the paper says (no training
speed-up is claimed). ``backend="flex"``: the gate is a FlexAttention ``score_mod`` (an
additive bias for the log gate, a factor on the logit for the paper gate) computed inside
the kernel from the routing rows, so on CUDA (compiled kernels) nothing of size
``Nq x Nk`` is stored and memory grows linearly with the length.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from ..utils.precision import without_autocast
from . import reference
from .checks import (
    check_bool,
    check_device,
    check_positive,
    check_qkv,
    check_shape,
    check_tensor,
    fail,
)
from .masks import check_groups, effective_window
from .names import GATES
from .sparse.flex import causal_block_mask, flex_call

Gate = Literal["paper", "log"]
GateBackend = Literal["dense", "flex"]
GATE_BACKENDS = ("dense", "flex")


@without_autocast
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
    chunk_size: int | None = None,
    backend: GateBackend = "dense",
) -> torch.Tensor:
    """Dense causal attention whose distant logits are gated by soft group affinities.

    With ``a_ij = g_i . g_j`` (dot product of the Sinkhorn rows of query ``i`` and key ``j``)
    and ``local(i, j) = 0 <= i - j < window``:

    - ``gate="paper"`` (paper Eq. 2): ``s_ij = (q_i . k_j) * scale * m_ij`` with
      ``m_ij = 1`` if local else ``sigmoid(sharpness * a_ij)``. Never below 0.5 for
      ``a_ij >= 0``: it tempers distant logits, it does not prune them.
    - ``gate="log"`` (this package's choice, docs/method.md §3):
      ``s_ij = (q_i . k_j) * scale + log(eps + a_ij)`` on distant pairs. With one-hot rows this is exactly the hard top-k mask, so the soft and
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
        sharpness: ``lambda`` of the paper gate (not given in the paper; default 10).
        eps: floor inside the log gate.
        scale: logit scale, default ``D ** -0.5``; softcap: optional Gemma-2 soft-capping,
            applied before the gate.
        key_padding_mask: optional bool ``[B, Nk]``, True = real token.
        always_visible: optional bool ``[B, Nk]``: keys every later query sees ungated
            (attention-sink tokens, docs/method.md §3).
        chunk_size: optional query rows per chunk (``backend="dense"``). Each chunk's
            logits are computed alone and, when gradients are recorded, recomputed in the
            backward pass (``torch.utils.checkpoint``), so the attention of a call holds
            ``O(B * H * chunk_size * Nk)`` floats at a time instead of ``O(B * H * Nq * Nk)``,
            for one extra forward of the attention. Same result up to float rounding.
        backend: ``"dense"`` (eager PyTorch, any device) or ``"flex"`` (FlexAttention with
            the gate as a ``score_mod``: compiled and differentiable on CUDA; eager and
            without gradients on CPU, for checking).

    Returns:
        ``[B, H, Nq, D]`` in the query's dtype (logits, gate and softmax in float32, float64
        for float64 inputs). Any zero-size dimension (``B``, ``H``, ``Nq``, ``Nk``) gives an
        empty or all-zero result of that shape.

    Raises:
        ValueError: malformed shapes or dtypes, unknown gate or backend, ``window < 1``,
            ``scale`` or ``softcap`` not a finite number > 0, ``chunk_size < 1``, tensors on
            different devices, ``backend="flex"`` with inputs that require grad on CPU.
    Inside ``torch.autocast`` it still computes as described (autocast does not apply).
    """
    _check_gated(query, key, value, query_probs, key_probs, window, gate, key_padding_mask)
    _check_options(query, key, always_visible, chunk_size, backend)
    scale = check_positive("scale", scale)
    softcap = check_positive("softcap", softcap)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    args = (query, key, value, query_probs, key_probs, window, gate, sharpness, eps, scale)
    if backend == "flex" and query.numel() and key.numel():
        return _flex_gated(*args, softcap, key_padding_mask, always_visible)
    return _dense_gated(*args, softcap, key_padding_mask, always_visible, chunk_size)


def straight_through(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Routing rows that are ``hard`` in value and ``soft`` in gradient (the straight-through
    estimator; docs/method.md §6, "Straight-through routing").

    Args:
        hard: bool ``[B, N, K]`` group memberships (top-k routing).
        soft: float ``[B, N, K]`` routing rows (Sinkhorn output) that carry the gradient.

    Returns:
        ``soft``'s dtype ``[B, N, K]``: equal to ``hard`` (0.0 / 1.0) in value; the gradient
        of a loss with respect to it reaches ``soft`` unchanged.

    Raises:
        ValueError: ``hard`` not bool, ``soft`` not floating, or different shapes.
    """
    check_tensor("hard", hard, 3)
    check_tensor("soft", soft, 3, floating=True)
    check_bool("hard", hard)
    check_shape("hard", hard, tuple(soft.shape), "[B, N, K] like soft")
    return hard.to(soft.dtype) + (soft - soft.detach())


def _check_options(query, key, always_visible, chunk_size, backend) -> None:
    """Validate ``always_visible``, ``chunk_size`` and ``backend`` (``ValueError``)."""
    if always_visible is not None:
        check_shape("always_visible", always_visible, (query.shape[0], key.shape[2]), "[B, Nk]")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        fail("chunk_size", repr(chunk_size), "None or an int >= 1")
    if backend not in GATE_BACKENDS:
        fail("backend", repr(backend), f"one of {GATE_BACKENDS}")


def _dense_gated(query, key, value, query_probs, key_probs, window, gate, sharpness, eps,
                 scale, softcap, key_padding_mask, always_visible, chunk_size):  # fmt: skip
    """:func:`gated_attention` in eager PyTorch (one ``[B, H, Nq, Nk]`` logit tensor, or
    one per chunk of ``chunk_size`` query rows)."""
    local, visible = _visibility(query, key, window, key_padding_mask, always_visible)
    settings = (gate, sharpness, eps, scale, softcap)
    nq = query.shape[2]
    if chunk_size is None or chunk_size >= nq:
        return reference.gated_attention(query, key, value, query_probs, key_probs, local,
                                         visible, *settings)  # fmt: skip
    outs = []
    for start in range(0, nq, chunk_size):
        rows = slice(start, start + chunk_size)
        args = (query[:, :, rows], key, value, query_probs[:, rows], key_probs,
                local[:, rows], visible[:, rows], *settings)  # fmt: skip
        if torch.is_grad_enabled():
            outs.append(checkpoint(reference.gated_attention, *args, use_reentrant=False))
        else:
            outs.append(reference.gated_attention(*args))
    return torch.cat(outs, dim=2)


def _flex_gated(query, key, value, query_probs, key_probs, window, gate, sharpness, eps,
                scale, softcap, key_padding_mask, always_visible):  # fmt: skip
    """:func:`gated_attention` as one FlexAttention call: causal (and padding) block mask,
    the gate as a ``score_mod`` reading the routing rows (the affinity ``g_i . g_j`` is
    summed inside the kernel)."""
    wants_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, query_probs, key_probs)
    )
    if query.device.type == "cpu" and wants_grad:
        fail(
            "backend",
            "'flex' with inputs that require grad on CPU",
            "'dense' (PyTorch's FlexAttention has no CPU backward)",
        )
    nq, nk, device = query.shape[2], key.shape[2], query.device
    ct = torch.promote_types(torch.promote_types(query.dtype, query_probs.dtype), torch.float32)
    qp, kp = query_probs.to(ct), key_probs.to(ct)
    offset = torch.tensor(nk - nq, device=device)
    width = torch.tensor(effective_window(window, nk), device=device)

    def score_mod(score, b, h, i, j):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        affinity = qp[b, i, 0] * kp[b, j, 0]
        for g in range(1, qp.shape[-1]):
            affinity = affinity + qp[b, i, g] * kp[b, j, g]
        local = (i + offset - j) < width
        if always_visible is not None:
            local = local | always_visible[b, j]
        value = reference.soft_gate(affinity, local, gate, sharpness, eps)
        return score * value if gate == "paper" else score + value

    mask = causal_block_mask(nq, nk, key_padding_mask, device)
    out, _ = flex_call(query, key, value, mask, scale=scale, score_mod=score_mod)
    return out.to(query.dtype)


def _check_gated(query, key, value, query_probs, key_probs, window, gate, padding) -> None:
    """Validate :func:`gated_attention`'s tensors, window, gate and padding mask
    (``ValueError``)."""
    check_qkv(query, key, value)
    if gate not in GATES:
        fail("gate", repr(gate), f"one of {GATES}")
    b, _, nq, _ = query.shape
    nk = key.shape[2]
    check_tensor("query_probs", query_probs, 3, floating=True)
    check_tensor("key_probs", key_probs, 3, floating=True)
    check_shape("query_probs", query_probs, (b, nq, query_probs.shape[-1]), "[B, Nq, K]")
    check_shape("key_probs", key_probs, (b, nk, query_probs.shape[-1]), "[B, Nk, K]")
    # reuse the group-mask validation for window / padding / Nq <= Nk
    check_groups(
        torch.zeros(b, nq, 1, dtype=torch.bool, device=query.device),
        torch.zeros(b, nk, 1, dtype=torch.bool, device=query.device),
        padding,
        window,
        owner="gated_attention",
    )
    check_device("query_probs", query_probs, query.device, "query")
    check_device("key_probs", key_probs, query.device, "query")


def _visibility(query, key, window, key_padding_mask, always_visible):
    """``(local, visible)``: bool ``[B or 1, Nq, Nk]`` masks of the local pairs (window and
    always-visible keys) and of the causal, real pairs."""
    nq, nk = query.shape[2], key.shape[2]
    causal, local = reference.causal_and_local(nq, nk, effective_window(window, nk), query.device)
    causal, local = causal[None], local[None]  # [1, Nq, Nk]
    if always_visible is not None:
        local = local | always_visible[:, None, :]
    visible = causal if key_padding_mask is None else causal & key_padding_mask[:, None, :]
    return local, visible
