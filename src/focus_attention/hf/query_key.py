"""Query-key routing (docs/method.md §4, "Query-key routing"; experimental): per key-value
head, learnable centroids score each key's vector and each query's vector (pooled over the
query heads that share the key-value head), both taken before the rotary embedding.

The attention function receives queries and keys after the rotary embedding, which makes
their direction depend on the position. The router scores them from the hidden state the
pre-hook passes, with the attention module's own projections. Where those are linear (no
query/key norm, plain ``nn.Linear`` or GPT-2's ``Conv1D``: :data:`LINEAR_QUERY_KEY`), the
centroids are folded into them once: the scores are one ``[d_model, H_kv * K + H * K]``
product of the hidden state (``H_kv * K`` query columns with mean pooling), not a query and
key projection per Focus layer and call. Elsewhere (QK-norms, adapters wrapping the
projections) the router recomputes the pre-rotary states (:data:`PRE_ROTARY`). A key's
groups depend on that key only, so routing stays causal and a KV cache keeps each key's
groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops import sinkhorn, topk_memberships
from .router import ROUTER_DTYPE, FocusRouter, checks_nan, init_generator, orthonormal_columns

__all__ = [
    "LINEAR_QUERY_KEY",
    "PRE_ROTARY",
    "QueryKeyRouter",
    "check_query_key_model",
    "head_memberships",
    "pre_rotary_query_key",
]


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, N, H * D]`` -> ``[B, H, N, D]``."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _projections(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaMA, Mistral, Qwen-2, Gemma-2 and Gemma-3 (whose ``q_norm`` / ``k_norm`` act per
    head, before the rotary embedding)."""
    q = _heads(module.q_proj(hidden), module.head_dim)
    k = _heads(module.k_proj(hidden), module.head_dim)
    if hasattr(module, "q_norm"):
        q, k = module.q_norm(q), module.k_norm(k)
    return q, k


def _normed_projections(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """OLMo-2: ``q_norm`` / ``k_norm`` over the whole projection, before the heads split."""
    q = _heads(module.q_norm(module.q_proj(hidden)), module.head_dim)
    k = _heads(module.k_norm(module.k_proj(hidden)), module.head_dim)
    return q, k


def _fused(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-2: one fused projection ``c_attn``; no rotary embedding (absolute positions)."""
    q, k, _ = module.c_attn(hidden).split(module.split_size, dim=2)
    return _heads(q, module.head_dim), _heads(k, module.head_dim)


#: per model type, how the queries and keys before the rotary embedding are computed from the
#: hidden state entering the attention module, as the module's own forward computes them
PRE_ROTARY: dict[str, Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "gpt2": _fused,
    "llama": _projections,
    "mistral": _projections,
    "qwen2": _projections,
    "gemma2": _projections,
    "gemma3_text": _projections,
    "olmo2": _normed_projections,
}


Weights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def _separate_weights(module: nn.Module) -> Weights | None:
    """``q_proj`` / ``k_proj`` of exactly ``nn.Linear`` (no adapter around them) and no
    QK-norm."""
    q, k = module.q_proj, module.k_proj
    if hasattr(module, "q_norm") or type(q) is not nn.Linear or type(k) is not nn.Linear:
        return None
    return q.weight, q.bias, k.weight, k.bias


def _fused_weights(module: nn.Module) -> Weights | None:
    """GPT-2's ``c_attn`` ``Conv1D`` (weight ``[d_model, 3 * d_model]``)."""
    proj, split = module.c_attn, module.split_size
    if type(proj).__name__ != "Conv1D":
        return None
    w, b = proj.weight, proj.bias
    return w[:, :split].t(), b[:split], w[:, split : 2 * split].t(), b[split : 2 * split]


#: per model type, the affine maps from the hidden state to the pre-rotary queries and keys:
#: ``(W_q [H * D, d_model], b_q [H * D] | None, W_k [H_kv * D, d_model], b_k | None)``, or
#: None where the module's are not plain affine maps (the router then recomputes the states)
LINEAR_QUERY_KEY: dict[str, Callable[[nn.Module], Weights | None]] = {
    "gpt2": _fused_weights,
    "llama": _separate_weights,
    "mistral": _separate_weights,
    "qwen2": _separate_weights,
    "gemma2": _separate_weights,
    "gemma3_text": _separate_weights,
    "olmo2": lambda module: None,  # q_norm / k_norm over the whole projection
}


def _stamp(tensors: tuple[torch.Tensor | None, ...]) -> tuple:
    """What identifies the values of ``tensors``: storage, device, dtype and the in-place
    version counter (inference tensors have none: they cannot change outside inference
    mode)."""

    def one(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.device, t.dtype, None if t.is_inference() else t._version

    return tuple(None if t is None else one(t) for t in tensors)


def check_query_key_model(model_type: str) -> None:
    """Raise ``ValueError`` naming ``model_type`` unless :data:`PRE_ROTARY` has it."""
    if model_type not in PRE_ROTARY:
        raise ValueError(
            f"FocusConfig.router_input='query_key' does not support model type {model_type!r}: "
            f"it recomputes the pre-rotary queries and keys for {', '.join(PRE_ROTARY)} only; "
            "use router_input='hidden_state'"
        )


def pre_rotary_query_key(model_type: str, module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(query [B, H, N, D], key [B, H_kv, N, D])`` of ``hidden`` ``[B, N, d_model]``
    before the rotary embedding, in the module's dtype, computed by ``module`` (the attention
    module of a model of type ``model_type``) as its forward does.

    Raises:
        ValueError: a model type without an entry in :data:`PRE_ROTARY`.
    """
    check_query_key_model(model_type)
    return PRE_ROTARY[model_type](module, hidden)


def head_memberships(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """:func:`~focus_attention.ops.topk_memberships` of scores ``[B, N, H_kv, K]``: bool
    ``[B, N, H_kv, K]``, ``top_k`` groups per token and key-value head. NaN scores are not
    checked here (that reads the device back): :meth:`QueryKeyRouter.group_sets` checks
    them where :func:`~.router.checks_nan` says to."""
    return topk_memberships(scores.flatten(1, 2), top_k, check_nan=False).view(scores.shape)


class QueryKeyRouter(FocusRouter):
    """Query-key routing of one attention layer (docs/method.md §4, "Query-key routing").

    Parameters (trainable, the only ones): ``centroids`` ``[H_kv, K, D]`` float32, ``K``
    per key-value head. Buffers (saved): ``key_mean`` ``[H_kv, D]``, subtracted from every
    key before it is scored (zero at initialisation; ``focus train --objective attention``
    or ``coverage`` keeps the running mean of the training keys there, as MagicPIG centres
    keys);
    ``routing_bias`` ``[H_kv, K]`` added to the scores of keys and queries (zero at
    initialisation; ``focus train --objective coverage`` folds the Sinkhorn column bias of
    each batch's keys into it, so the keys' hard groups stay balanced) and ``bias_updates``.

    Scores are plain dot products in float32 (the centroids' norms set their sharpness;
    ``temperature`` is not used): a key's ``(k - key_mean) . c`` against its head's
    centroids, a query's ``q_bar . c`` where ``q_bar`` is the mean of the queries of the
    ``H / H_kv`` heads that share the key-value head (``query_pooling="max"``: ``max_h q_h .
    c`` over those heads instead). A key joins its ``top_k`` best groups,
    a query its ``query_top_k`` best (as with hidden-state routing).

    Initialisation (deterministic from ``seed`` and ``layer_idx``): each head's centroids are
    ``K`` orthonormal directions when ``K <= D``, else ``K`` random unit vectors.

    Args:
        num_heads, num_kv_heads, head_dim: the attention layer's ``H``, ``H_kv``, ``D``.
        model_type: the model's ``config.model_type`` (:data:`PRE_ROTARY` entry).
        num_groups, layer_idx, seed, bias_momentum, device: as :class:`FocusRouter`.
        query_pooling: ``"mean"`` or ``"max"`` (:attr:`FocusConfig.query_pooling`).

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, or a model type
            without a :data:`PRE_ROTARY` entry.
    """

    TENSORS = ("centroids", "key_mean", "routing_bias", "bias_updates")
    reads_query_key = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, num_groups: int, *,
                 model_type: str, layer_idx: int, seed: int = 0, bias_momentum: float = 0.01,
                 query_pooling: str = "mean",
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        if num_heads % num_kv_heads:
            raise ValueError(f"query-key routing: {num_heads} query heads are not a multiple of "
                             f"{num_kv_heads} key-value heads")  # fmt: skip
        check_query_key_model(model_type)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.model_type, self.query_pooling = model_type, query_pooling
        self.d_model, self.num_groups, self.group_dim = 0, num_groups, head_dim
        self.temperature, self.layer_idx, self.seed = 1.0, layer_idx, int(seed)
        self.bias_momentum = float(bias_momentum)
        self.data_parallel_group, self.sync_statistics = None, True
        kw = {"device": device, "dtype": ROUTER_DTYPE}
        self.centroids = nn.Parameter(torch.empty(num_kv_heads, num_groups, head_dim, **kw))
        self.register_buffer("key_mean", torch.zeros(num_kv_heads, head_dim, **kw))
        self.register_buffer("routing_bias", torch.zeros(num_kv_heads, num_groups, **kw))
        self.register_buffer("bias_updates", torch.zeros((), dtype=torch.long, device=device))
        self.holds_values, self._never_initialised = False, True
        self._fold: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fold_stamp: tuple | None = None
        self.reset_parameters(self.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Deterministic initialisation (class docstring); buffers zeroed."""
        if seed is not None:
            self.seed = int(seed)
        if self.centroids.device.type == "meta":
            return
        gen = init_generator(self.seed, self.layer_idx)
        k, d = self.num_groups, self.head_dim
        heads = []
        for _ in range(self.num_kv_heads):
            if k <= d:
                heads.append(orthonormal_columns(torch.randn(d, k, generator=gen)).t())
            else:
                c = torch.randn(k, d, generator=gen)
                heads.append(c / c.norm(dim=-1, keepdim=True))
        self.centroids.copy_(torch.stack(heads))
        for name in ("key_mean", "routing_bias", "bias_updates"):
            getattr(self, name).zero_()
        self.mark_loaded()

    def query_key(self, module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """:func:`pre_rotary_query_key` of this router's model type."""
        return pre_rotary_query_key(self.model_type, module, hidden)

    def key_scores(self, key: torch.Tensor) -> torch.Tensor:
        """Scores ``[B, N, H_kv, K]`` float32 of keys ``[B, H_kv, N, D]`` (pre-rotary):
        ``(k - key_mean) . c + routing_bias``."""
        centred = key.float() - self.key_mean[:, None, :]
        scores = torch.einsum("bhnd,hkd->bnhk", centred, self.centroids)
        return scores + self.routing_bias

    def query_scores(self, query: torch.Tensor) -> torch.Tensor:
        """Scores ``[B, N, H_kv, K]`` float32 of queries ``[B, H, N, D]`` (pre-rotary),
        pooled over the heads sharing each key-value head (``query_pooling``): the mean
        query against the head's centroids, or each centroid's best score over the heads."""
        bsz, heads, n, d = query.shape
        grouped = query.float().view(bsz, self.num_kv_heads, heads // self.num_kv_heads, n, d)
        if self.query_pooling == "max":
            scores = torch.einsum("bhgnd,hkd->bnhgk", grouped, self.centroids).amax(dim=3)
        else:
            scores = torch.einsum("bhnd,hkd->bnhk", grouped.mean(dim=2), self.centroids)
        return scores + self.routing_bias

    def folded_scores(self, module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """``(key scores, query scores)`` ``[B, N, H_kv, K]`` float32 of ``hidden``
        ``[B, N, d_model]`` entering ``module``, as :meth:`key_scores` and
        :meth:`query_scores` of its pre-rotary states, from one product with the centroids
        folded into the module's query and key maps (:data:`LINEAR_QUERY_KEY`); None where
        those maps are not plain affine ones. The folded matrix is built in float64 and kept
        until the centroids, ``key_mean``, ``routing_bias`` or the projections change (their
        storage or version counter: every in-place operation, an optimiser step and
        ``load_state_dict`` included) or :meth:`train` is called (a change through
        ``.data`` moves no version counter: call ``eval()`` after it)."""
        weights = LINEAR_QUERY_KEY[self.model_type](module)
        if weights is None:
            return None
        stamp = _stamp((self.centroids, self.key_mean, self.routing_bias, *weights))
        if stamp != self._fold_stamp:
            self._fold, self._fold_stamp = self._folded_maps(*weights), stamp
        matrix, offset = self._fold
        bsz, n = hidden.shape[:2]
        flat = torch.addmm(offset, hidden.reshape(bsz * n, -1).to(matrix.dtype), matrix)
        hk, k = self.num_kv_heads, self.num_groups
        keys, queries = flat.split([hk * k, flat.shape[1] - hk * k], dim=1)
        # query columns per pooled head: one block per key-value head with mean pooling
        pooled = queries.reshape(bsz, n, hk, -1, k).amax(dim=3)
        return keys.reshape(bsz, n, hk, k), pooled

    def train(self, mode: bool = True) -> QueryKeyRouter:
        """``nn.Module.train``; also drops the folded maps of :meth:`folded_scores`."""
        self._fold = self._fold_stamp = None
        return super().train(mode)

    @torch.no_grad()
    def _folded_maps(self, w_q: torch.Tensor, b_q: torch.Tensor | None, w_k: torch.Tensor,
                     b_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(matrix [d_model, H_kv * K + P * K], offset [H_kv * K + P * K])`` float32 with
        ``P = H_kv`` (mean pooling) or ``H`` (max pooling): key columns ``W_k^T c`` with
        offset ``(b_k - key_mean) . c + routing_bias``, then query columns per pooled head."""
        c, bias = self.centroids.double(), self.routing_bias.double()
        hk, k, d = c.shape
        w_k, w_q = w_k.detach().double().view(hk, d, -1), w_q.detach().double().view(hk, -1, d, w_k.shape[1])  # fmt: skip
        shift = -self.key_mean.double() if b_k is None else b_k.detach().double().view(hk, d) - self.key_mean.double()  # fmt: skip
        b_q = w_q.new_zeros(w_q.shape[:3]) if b_q is None else b_q.detach().double().view(w_q.shape[:3])  # fmt: skip
        if self.query_pooling == "mean":
            w_q, b_q = w_q.mean(dim=1, keepdim=True), b_q.mean(dim=1, keepdim=True)
        matrix = torch.cat([torch.einsum("hdm,hkd->mhk", w_k, c).flatten(1),
                            torch.einsum("hgdm,hkd->mhgk", w_q, c).flatten(1)], dim=1)  # fmt: skip
        offset = torch.cat([(torch.einsum("hd,hkd->hk", shift, c) + bias).flatten(),
                            (torch.einsum("hgd,hkd->hgk", b_q, c) + bias[:, None]).flatten()])  # fmt: skip
        return matrix.to(ROUTER_DTYPE).contiguous(), offset.to(ROUTER_DTYPE)

    def balanced_keys(self, key_scores: torch.Tensor, n_iter: int, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Sinkhorn-balanced soft groups of the keys whose :meth:`key_scores` are
        ``key_scores`` ``[B, N, H_kv, K]``, per key-value head (docs/method.md §2): rows
        ``[B, N, H_kv, K]`` float32 (each real key's row sums to 1, each group holds ``1 / K``
        of the real keys after ``n_iter`` iterations) and the centred column bias
        ``[B, H_kv, K]`` of the scores without ``routing_bias``, which
        :meth:`update_key_mean` folds into ``routing_bias``. ``real`` bool ``[B, N]``
        (True = real) or None; padding rows are zero."""
        scores = key_scores - self.routing_bias  # the whole bias, not a correction
        bsz, n, heads, k = scores.shape
        flat = scores.permute(0, 2, 1, 3).reshape(bsz * heads, n, k)
        mask = None if real is None else real.repeat_interleave(heads, dim=0)
        probs, bias = sinkhorn(flat, n_iter, mask, return_column_bias=True)
        return probs.view(bsz, heads, n, k).transpose(1, 2), bias.view(bsz, heads, k)

    def group_sets(self, module: nn.Module, hidden: torch.Tensor, top_ks: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(key memberships, query memberships)`` bool ``[B, N, H_kv, K]`` of the tokens of
        ``hidden`` ``[B, N, d_model]`` entering ``module``: ``top_ks[0]`` groups per key,
        ``top_ks[1]`` per query; ties to the lowest group index.

        Raises:
            ValueError: NaN scores, where :func:`~.router.checks_nan` says they are checked.
        """
        with torch.no_grad():
            scores = self.folded_scores(module, hidden)
            if scores is None:
                query, key = self.query_key(module, hidden)
                scores = self.key_scores(key), self.query_scores(query)
        keys, queries = scores
        if checks_nan(hidden) and bool(torch.isnan(keys).any() | torch.isnan(queries).any()):
            raise ValueError(f"Focus layer {self.layer_idx}: NaN query-key routing scores")
        return head_memberships(keys, top_ks[0]), head_memberships(queries, top_ks[1])

    @torch.no_grad()
    def update_key_mean(self, key: torch.Tensor, real: torch.Tensor | None,
                        column_bias: torch.Tensor | None = None) -> None:  # fmt: skip
        """Fold one batch's mean pre-rotary key per head (``key`` ``[B, H_kv, N, D]``, real
        tokens only: ``real`` bool ``[B, N]`` or None) into ``key_mean``, and its mean
        Sinkhorn column bias (``column_bias`` ``[B, H_kv, K]`` of :meth:`balanced_keys`, the
        sequences with a real token; None: ``routing_bias`` unchanged) into
        ``routing_bias``: a cumulative mean at first, then an exponential moving average of
        momentum ``bias_momentum``; one update of ``bias_updates``."""
        weights = key.new_ones(key.shape[0], key.shape[2]) if real is None else real.to(key.dtype)
        total = weights.sum().clamp_min(1.0)
        mean = torch.einsum("bhnd,bn->hd", key.float(), weights.float()) / total
        weight = torch.clamp(1.0 / (self.bias_updates.float() + 1.0), min=self.bias_momentum)
        self.key_mean.mul_(1.0 - weight).add_(weight * mean)
        if column_bias is not None:
            rows = column_bias if real is None else column_bias[real.any(dim=-1)]
            if rows.shape[0]:
                self.routing_bias.mul_(1.0 - weight).add_(weight * rows.float().mean(dim=0))
        self.bias_updates.add_(1)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, H_kv={self.num_kv_heads}, K={self.num_groups}, "
                f"D={self.head_dim}, reads=query_key")  # fmt: skip
