"""Focus, the method in one file: every step in plain PyTorch, top to bottom.

1. Routing scores: each token against ``K`` learned centroids (docs/method.md §1).
2. Sinkhorn balancing of the scores into soft routing rows (§2).
3. The soft gate: dense attention whose distant logits the rows' affinity gates (§3).
4. Hard top-k memberships and the Focus mask they define (§4).
5. Attention under a boolean mask: the masked-attention primitive and the dense oracle
   every fast path is tested against (§3-§5).

The functions take checked inputs. The public ops (:mod:`.routing`, :mod:`.gates`,
:mod:`.masks`, :mod:`.sparse`) validate their arguments and compute each step by calling the
function here (the PyTorch backends ``math``, ``gather`` and ``masked`` attend with
:func:`masked_attention`), so the arithmetic below is the package's; the fused kernels
(C++, Triton, FlexAttention) compute the same steps their own way and are tested against
these. Shapes: ``B`` batch, ``N`` tokens, ``K`` groups, ``H`` query heads sharing ``H_kv``
key-value heads, ``D`` head_dim.
"""

from __future__ import annotations

import math

import torch

from ..utils.precision import without_autocast

# --------------------------------------------------------------------------------------
# 1. Routing scores (docs/method.md §1)
# --------------------------------------------------------------------------------------


@without_autocast
def group_scores(hidden, proj, centroids, temperature: float, *, normalize: bool = True):
    """``S = normalize(hidden @ proj) @ normalize(centroids).T / temperature``: float32
    ``[B, N, K]`` from ``hidden [B, N, d_model]``, ``proj [d_model, d_g]``, ``centroids
    [K, d_g]``. ``normalize=False`` is the paper's plain dot product."""
    feats = hidden.float() @ proj.float()
    cents = centroids.float()
    if normalize:  # cosine similarities: outlier features of the hidden state do not decide
        feats = torch.nn.functional.normalize(feats, dim=-1, eps=1e-6)
        cents = torch.nn.functional.normalize(cents, dim=-1, eps=1e-6)
    return feats @ cents.t() / float(temperature)


# --------------------------------------------------------------------------------------
# 2. Sinkhorn balancing (docs/method.md §2)
# --------------------------------------------------------------------------------------


def sinkhorn(log_scores, n_iter: int, padding_mask=None, *, return_column_bias: bool = False):
    """Soft routing rows ``[B, N, K]`` (float32, float64 for float64 scores): ``n_iter``
    times, every group column is divided by its sum over the real tokens, then every token
    row by its sum over groups, in log space. ``n_iter = 0``: the softmax over groups.
    Padding (``padding_mask [B, N]`` False) leaves the column sums and its rows are zero.
    With ``return_column_bias``, also the centred per-group bias ``c [B, K]`` such that
    ``rows = softmax(log_scores + c)``."""
    bsz, _, k = log_scores.shape
    ct = torch.promote_types(log_scores.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
    # +-inf scores (a centroid scaled to 1e4 at a tiny temperature) would give inf - inf
    x = log_scores.to(ct).clamp(min=-1e30, max=1e30)
    real = None
    if padding_mask is not None:
        # a sequence with no real token is computed as if unpadded, then zeroed below
        real = (padding_mask | ~padding_mask.any(dim=1, keepdim=True))[..., None]
        # padding rows stay finite (no NaN gradient) and are excluded from the column sums
        x = torch.where(real, x, torch.zeros_like(x))
    col_total = torch.zeros(bsz, 1, k, dtype=ct, device=x.device)
    for _ in range(n_iter):
        cols_in = x if real is None else x.masked_fill(~real, float("-inf"))
        col = torch.logsumexp(cols_in, dim=1, keepdim=True)  # [B, 1, K]
        x = x - col
        col_total = col_total + col
        x = x - torch.logsumexp(x, dim=2, keepdim=True)  # rows sum to 1
    if n_iter == 0:  # no balancing: the softmax over groups
        x = x - torch.logsumexp(x, dim=2, keepdim=True)
    probs = x.exp()
    if padding_mask is not None:
        probs = probs.masked_fill(~padding_mask[..., None], 0.0)
    if not return_column_bias:
        return probs
    bias = -col_total[:, 0, :]
    return probs, bias - bias.mean(dim=-1, keepdim=True)


# --------------------------------------------------------------------------------------
# 3. The soft gate (docs/method.md §3)
# --------------------------------------------------------------------------------------


def soft_gate(affinity, local, gate: str, sharpness: float, eps: float):
    """The gate of the affinities ``a = g_i . g_j``: ``gate="paper"`` a factor on the logit,
    ``sigmoid(sharpness * a)``; ``gate="log"`` a bias added to it, ``log(eps + a)``; on
    ``local`` pairs (the window, sinks) the factor 1 and the bias 0."""
    if gate == "paper":
        return torch.where(local, torch.ones_like(affinity), torch.sigmoid(sharpness * affinity))
    return torch.where(local, torch.zeros_like(affinity), torch.log(eps + affinity))


def gated_logits(qk, affinity, local, visible, gate: str, sharpness: float, eps: float, scale):
    """Gated logits ``[B, H, Nq, Nk]`` from the products ``qk = q . k``; ``-inf`` where not
    ``visible``. What does not depend on the head is one ``[B, Nq, Nk]`` tensor, so the
    per-head logits take one extra pass (as eager attention's scale and mask)."""
    neg_inf = torch.full((), -math.inf, device=qk.device)
    value = soft_gate(affinity, local, gate, sharpness, eps)
    if gate == "paper":
        mask_bias = torch.where(visible, torch.zeros_like(affinity), neg_inf)
        return torch.addcmul(mask_bias[:, None], qk, (value * scale)[:, None])
    return torch.add(torch.where(visible, value, neg_inf)[:, None], qk, alpha=scale)


def gated_attention(query, key, value, query_probs, key_probs, local, visible, gate: str,
                    sharpness: float, eps: float, scale: float, softcap: float | None):  # fmt: skip
    """Soft-gated attention ``[B, H, Nq, D]`` in the query's dtype: the routing rows
    ``query_probs [B, Nq, K]``, ``key_probs [B, Nk, K]`` give the affinities, ``local``
    and ``visible`` bool ``[B or 1, Nq, Nk]`` the ungated and the causal, real pairs.
    Products in the inputs' dtype, gate and softmax in float32 (float64 for float64)."""
    ct = torch.promote_types(torch.promote_types(query.dtype, query_probs.dtype), torch.float32)
    affinity = query_probs.to(ct) @ key_probs.to(ct).transpose(1, 2)  # [B, Nq, Nk]
    # A row with no visible key (padding) is computed as if every key were visible and its
    # output zeroed afterwards, so softmax never sees an all -inf row (no NaN gradient).
    row_any = visible.any(dim=-1, keepdim=True)  # [B, Nq, 1]
    visible = visible | ~row_any
    k = expand_kv_heads(key, query.shape[1])
    v = expand_kv_heads(value, query.shape[1])
    qk = (query @ k.transpose(-1, -2)).to(ct)  # [B, H, Nq, Nk], product in the input dtype
    if softcap is not None:
        qk, scale = softcap * torch.tanh(qk * (scale / softcap)), 1.0
    logits = gated_logits(qk, affinity, local, visible, gate, sharpness, eps, scale)
    probs = torch.softmax(logits, dim=-1).to(query.dtype)
    out = probs @ v
    return out * row_any[:, None].to(out.dtype)


# --------------------------------------------------------------------------------------
# 4. Top-k memberships and the Focus mask (docs/method.md §4)
# --------------------------------------------------------------------------------------


def topk_memberships(scores, top_k: int):
    """bool ``[B, N, K]``: each token joins its ``top_k`` highest-scoring groups, ties to the
    lowest group index (a stable descending sort), decided in float32."""
    out = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if top_k == 1:  # argmax returns the first of tied maxima: the same rule, without a sort
        return out.scatter_(-1, scores.float().argmax(dim=-1, keepdim=True), True)
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    return out.scatter_(-1, order[..., :top_k], True)


def causal_and_local(num_queries: int, num_keys: int, window: int, device=None):
    """bool ``[Nq, Nk]`` masks ``(causal, local)`` of queries at positions ``Nk - Nq ..
    Nk - 1`` (bottom-right aligned): key ``j`` is causal to query ``i`` iff ``j <= i`` and
    local iff ``i - j < window`` (the window counts the query itself)."""
    qpos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    kpos = torch.arange(num_keys, device=device)[None, :]
    return kpos <= qpos, (qpos - kpos) < window


def focus_mask(query_groups, key_groups, window: int, key_padding_mask=None):
    """bool ``[B, Nq, Nk]``: query ``i`` sees key ``j`` iff ``j <= i``, ``j`` is real and
    either ``i - j < window`` or the two share a group (``query_groups [B, Nq, K]``,
    ``key_groups [B, Nk, K]``). ``window`` at most ``Nk`` (int64 arithmetic).

    Per key-value head memberships ``query_groups [B, Nq, H_kv, K]``, ``key_groups
    [B, Nk, H_kv, K]`` (a routing per key-value head) give bool ``[B, H_kv, Nq, Nk]``: head
    ``h``'s mask from its own memberships, each head computed directly."""
    nq, nk = query_groups.shape[1], key_groups.shape[1]
    causal, local = causal_and_local(nq, nk, window, query_groups.device)
    if query_groups.dim() == 4:  # [B, N, H_kv, K] -> [B, H_kv, N, K]: one product per head
        query_groups, key_groups = query_groups.transpose(1, 2), key_groups.transpose(1, 2)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, None]
    share = (query_groups.float() @ key_groups.float().transpose(-1, -2)) > 0
    mask = causal & (local | share)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[..., None, :]
    return mask


# --------------------------------------------------------------------------------------
# 5. Attention under a boolean mask (docs/method.md §3-§5)
# --------------------------------------------------------------------------------------


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat ``[B, H_kv, N, D]`` key/value heads to ``[B, H, N, D]`` (GQA/MQA sharing:
    query head ``h`` uses key/value head ``h // (H // H_kv)``)."""
    h_kv = x.shape[1]
    if h_kv == num_heads:
        return x
    return x.repeat_interleave(num_heads // h_kv, dim=1)


def masked_softmax(query, key, mask, *, scale: float, softcap: float | None = None,
                   eager: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention probabilities and log-sum-exp of every query under a boolean mask: the one
    masked softmax of the package (with :func:`masked_attention`, its product with values).

    Args:
        query: ``[..., H, Nq, D]``; key: ``[..., H_kv, Nk, D]``, ``H % H_kv == 0`` (query
            head ``h`` reads key head ``h // (H / H_kv)``, its ``H / H_kv`` heads as rows of
            one product, no key copied).
        mask: bool, True = visible, ``[..., Nq, Nk]`` (every head), ``[..., H_kv, Nq, Nk]``
            (per key-value head) or ``[..., H, Nq, Nk]`` (per query head), broadcastable over
            the leading dimensions; None: every key visible.
        scale: logit scale; softcap: optional Gemma-2 soft-capping ``c * tanh(logits / c)``.
        eager: False (the fast paths' arithmetic): products in float32 (float64 for float64
            inputs), probabilities ``exp(logits - lse)`` from the log-sum-exp. True (eager
            attention's arithmetic): products in the inputs' dtype, ``torch.softmax`` in
            float32 (float64).

    Returns:
        ``(probs [..., H, Nq, Nk], lse [..., H, Nq])`` in float32 (float64 for float64
        inputs). A row with no visible key gives probabilities 0 and log-sum-exp ``-inf``,
        never NaN, also in the gradient (its logits are replaced by zeros first).
    """
    h, nq, d = query.shape[-3:]
    h_kv, nk = key.shape[-3], key.shape[-2]
    rep = h // max(1, h_kv)
    ct = torch.promote_types(query.dtype, torch.float32)
    dt = query.dtype if eager else ct
    q = query.to(dt)
    if rep > 1:  # the rep query heads of a key head are rows of one product
        q = q.reshape(*q.shape[:-3], h_kv, rep * nq, d)
    logits = (q @ key.to(dt).transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.reshape(*logits.shape[:-2], rep, nq, nk)  # [..., H_kv, rep, Nq, Nk]
    seen = None
    if mask is not None:
        if mask.dim() < query.dim():  # shared by every head
            mask = mask.unsqueeze(-3)
        if rep > 1 and mask.shape[-3] == h:  # one per query head
            mask = mask.unflatten(-3, (h_kv, rep))
        else:  # one per key-value head (or shared): the same for its rep query heads
            mask = mask.unsqueeze(-3)
        seen = mask.any(dim=-1, keepdim=True)
        logits = torch.where(seen, logits.masked_fill(~mask, -math.inf), torch.zeros_like(logits))
    logits = logits.to(ct)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1) if eager else torch.exp(logits - lse[..., None])
    if seen is not None:
        probs = torch.where(seen, probs, torch.zeros_like(probs))
        lse = torch.where(seen[..., 0], lse, torch.full_like(lse, -math.inf))
    return probs.flatten(-4, -3), lse.flatten(-3, -2)


def masked_attention(query, key, value, mask, *, scale: float, softcap: float | None = None,
                     eager: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Softmax attention under a boolean mask: :func:`masked_softmax` (see it for
    ``query``, ``key``, ``mask``, ``scale``, ``softcap``, ``eager``) times ``value
    [..., H_kv, Nk, D]``.

    Returns:
        ``(out [..., H, Nq, D], lse [..., H, Nq])``: ``out`` in float32 (float64 for float64
        inputs), or with ``eager`` in the inputs' dtype (probabilities cast to it before the
        product, as eager attention does); ``lse`` float32 (float64). A row with no visible
        key outputs zeros and ``-inf``.
    """
    probs, lse = masked_softmax(query, key, mask, scale=scale, softcap=softcap, eager=eager)
    h, nq = probs.shape[-3], probs.shape[-2]
    h_kv = value.shape[-3]
    dt = value.dtype if eager else probs.dtype
    # [..., H, Nq, Nk] -> [..., H_kv, rep * Nq, Nk]: the rep query heads of a value head
    probs = probs.reshape(*probs.shape[:-3], h_kv, h // max(1, h_kv) * nq, probs.shape[-1])
    out = probs.to(dt) @ value.to(dt)
    return out.reshape(*out.shape[:-3], h, nq, out.shape[-1]), lse


def attention_probs(query, key, mask, scale: float, softcap: float | None = None):
    """Softmax attention probabilities under a boolean mask, the maps a Focus layer returns
    for ``output_attentions`` (the logits of :func:`dense_attention`).

    Args:
        query: ``[B, H, Nq, D]``; key: ``[B, H_kv, Nk, D]``; mask: bool ``[B, Nq, Nk]`` or
            ``[B, H_kv, Nq, Nk]`` (per key-value head, each query head under its own).
        scale: logit scale; softcap: optional logit soft-capping.

    Returns:
        ``[B, H, Nq, Nk]`` in the query's dtype, computed in float32 (float64 for float64
        inputs); a row with no visible key is all zeros.
    """
    ct = torch.promote_types(query.dtype, torch.float32)
    key = expand_kv_heads(key, query.shape[1]).to(ct)
    if mask.dim() == 4 and mask.shape[1] not in (1, query.shape[1]):  # per key-value head
        mask = expand_kv_heads(mask, query.shape[1])
    probs, _ = masked_softmax(query.to(ct), key, mask, scale=scale, softcap=softcap, eager=True)
    return probs.to(query.dtype)


def dense_attention(query, key, value, mask, *, scale: float | None = None,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Softmax attention under an explicit boolean mask, the oracle every fast path is tested
    against: logits in the inputs' dtype, softmax in fp32 (float64 for float64 inputs), as
    eager attention does. ``O(Nq * Nk)`` memory.

    A query row with no visible key outputs zeros and log-sum-exp ``-inf``, never NaN
    (docs/method.md §3).

    Args:
        query: ``[B, H, Nq, D]``; key, value: ``[B, H_kv, Nk, D]`` with ``H % H_kv == 0``.
        mask: bool ``[B, Nq, Nk]`` (shared by all heads), ``[B, H_kv, Nq, Nk]`` (per
            key-value head, as :func:`focus_mask` of per-head memberships gives) or
            ``[B, H, Nq, Nk]``; True = visible.
        scale: logit scale, default ``D ** -0.5``.
        softcap: optional Gemma-2 logit soft-capping ``c * tanh(logits / c)``.

    Returns:
        ``(out [B, H, Nq, D] in query's dtype, lse [B, H, Nq] float32 or float64)``.
    """
    num_heads = query.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    k, v = expand_kv_heads(key, num_heads), expand_kv_heads(value, num_heads)
    if mask.dim() == 4 and mask.shape[1] not in (1, num_heads):  # per key-value head
        mask = expand_kv_heads(mask, num_heads)
    return masked_attention(query, k, v, mask, scale=scale, softcap=softcap, eager=True)
