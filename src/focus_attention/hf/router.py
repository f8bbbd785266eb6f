"""The per-layer Focus router: projection, centroids and the calibrated causal bias."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import group_scores, sinkhorn, topk_memberships


def _init_generator(seed: int, layer_idx: int) -> torch.Generator:
    # one independent stream per (seed, layer): a layer's initialisation does not depend on
    # which other layers get Focus
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + layer_idx) % (2**63 - 1))


def _orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    """Q of the QR decomposition with a sign convention that makes it unique."""
    q, r = torch.linalg.qr(x)
    return q * torch.sign(torch.diagonal(r))[None, :]


class FocusRouter(nn.Module):
    """Routing of one attention layer (spec sections 1, 2 and 4).

    Parameters (trainable): ``proj`` ``W_g`` ``[d_model, d_g]`` and ``centroids`` ``C``
    ``[K, d_g]``, so ``d_model * d_g + K * d_g`` per layer. Buffers (saved, not trained):
    ``routing_bias`` ``[K]`` float32, the running mean of the Sinkhorn column bias, and
    ``bias_updates`` (how many soft-training batches fed it).

    Initialisation (product decision, deterministic from ``seed`` and ``layer_idx``):
    ``proj`` has orthonormal columns (a random semi-orthogonal matrix, so an isotropic
    hidden state projects to an isotropic ``d_g``-vector); the centroids are ``K``
    orthonormal directions (rows of a random orthogonal matrix) when ``K <= d_g``, else ``K``
    random unit vectors. The scores are cosine similarities
    (:func:`focus_attention.ops.group_scores`), so for isotropic hidden states every group is
    equally likely by symmetry when ``K <= d_g`` (approximately when ``K > d_g``): groups
    start balanced in expectation. Pretrained hidden states share a mean direction that can favour one group;
    Sinkhorn balances soft routing by construction, and the calibrated ``routing_bias``
    (zero at initialisation) balances causal top-k routing once it has seen soft-routing
    batches (training or :meth:`FocusModel.calibrate`).

    Args:
        d_model: width of the hidden state entering the attention block.
        num_groups: ``K``; group_dim: ``d_g``; temperature: ``tau > 0``.
        layer_idx: the layer this router serves; seed: initialisation seed.
        bias_momentum: see :class:`FocusConfig`.
    """

    def __init__(
        self,
        d_model: int,
        num_groups: int,
        group_dim: int,
        temperature: float,
        *,
        layer_idx: int,
        seed: int = 0,
        bias_momentum: float = 0.01,
    ) -> None:
        super().__init__()
        self.d_model, self.num_groups, self.group_dim = d_model, num_groups, group_dim
        self.temperature = float(temperature)
        self.layer_idx = layer_idx
        self.bias_momentum = float(bias_momentum)
        self.proj = nn.Parameter(torch.empty(d_model, group_dim))
        self.centroids = nn.Parameter(torch.empty(num_groups, group_dim))
        self.register_buffer("routing_bias", torch.zeros(num_groups))
        self.register_buffer("bias_updates", torch.zeros((), dtype=torch.long))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic initialisation described in the class docstring (buffers zeroed)."""
        gen = _init_generator(seed, self.layer_idx)
        k, d = self.num_groups, self.group_dim
        proj = _orthonormal_columns(torch.randn(self.d_model, d, generator=gen))
        if k <= d:
            cents = _orthonormal_columns(torch.randn(d, k, generator=gen)).t()  # [K, d_g]
        else:
            cents = torch.randn(k, d, generator=gen)
            cents = cents / cents.norm(dim=-1, keepdim=True)
        if self.proj.device.type == "meta":
            return
        self.proj.copy_(proj)
        self.centroids.copy_(cents)
        self.routing_bias.zero_()
        self.bias_updates.zero_()

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Routing scores ``[B, N, K]`` float32 of ``hidden`` ``[B, N, d_model]`` (spec section 1)."""
        return group_scores(hidden, self.proj, self.centroids, self.temperature)

    def soft(
        self, scores: torch.Tensor, n_iter: int, real: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinkhorn rows ``[B, N, K]`` float32 and column bias ``[B, K]`` of ``scores``
        ``[B, N, K]``; padding (``real`` bool ``[B, N]``, True = real, or None) is excluded
        from the column sums and its rows are zero (spec section 2)."""
        probs, bias = sinkhorn(scores, n_iter, real, return_column_bias=True)
        return probs, bias

    def causal_groups(self, scores: torch.Tensor, top_k: int) -> torch.Tensor:
        """Causal top-k memberships bool ``[B, N, K]``: top-k of ``scores + routing_bias``.

        A token's groups depend on that token only (product decision, spec section 4). Ties
        go to the lowest group index.
        """
        return topk_memberships(scores + self.routing_bias.float(), top_k)

    @torch.no_grad()
    def update_bias(self, column_bias: torch.Tensor, real: torch.Tensor | None) -> None:
        """Fold one batch of Sinkhorn column biases ``[B, K]`` into ``routing_bias``.

        Sequences without a real token are skipped. The batch mean enters with weight
        ``max(bias_momentum, 1 / (updates + 1))``: a cumulative mean at first, an EMA later
        (product decision, spec section 4). Called by every soft-routing forward in training
        mode; with activation checkpointing the recomputed forward folds the same batch in a
        second time.
        """
        if real is not None:
            column_bias = column_bias[real.any(dim=-1)]
        if column_bias.shape[0] == 0:
            return
        batch = column_bias.float().mean(dim=0).to(self.routing_bias.device)
        weight = torch.clamp(1.0 / (self.bias_updates.float() + 1.0), min=self.bias_momentum)
        self.routing_bias.mul_(1.0 - weight).add_(weight * batch)
        self.bias_updates.add_(1)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, d_model={self.d_model}, K={self.num_groups}, "
            f"d_g={self.group_dim}, tau={self.temperature}"
        )
