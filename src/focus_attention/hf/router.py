"""The per-layer Focus router: projection, centroids and the calibrated causal bias."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..ops import (
    causal_topk_groups,
    causal_topk_groups_many,
    group_scores,
    sinkhorn,
    topk_memberships,
)

#: dtype of every router parameter and buffer, whatever the model's dtype (docs/method.md §1:
#: scores are computed in fp32); casts of the model leave the routers in it.
ROUTER_DTYPE = torch.float32


def check_router_values(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` when a floating ``tensor`` about to be loaded
    into a router holds NaN or infinities once in :data:`ROUTER_DTYPE` (a float64 value
    beyond float32's range included); tensors on the meta device hold no values to check."""
    if not tensor.is_floating_point() or tensor.device.type == "meta":
        return
    if not bool(torch.isfinite(tensor.to(ROUTER_DTYPE)).all()):
        raise ValueError(
            f"Focus weights: {name} holds NaN or infinite values (in float32), expected "
            "finite router weights (the adapter is damaged: save or train it again)"
        )


def checks_nan(hidden: torch.Tensor) -> bool:
    """Whether causal routing of ``hidden`` (:meth:`FocusRouter.topk_groups`, the path of
    decoding) checks its scores for NaN (a ``ValueError`` then): on the CPU, where reading
    the check back costs nothing, and wherever gradients are computed.
    At inference on another device (a GPU) it would wait for the device at every Focus layer
    (a host synchronisation per layer and step), so there a NaN hidden state is not checked
    and reaches the logits as NaN, as in the dense model; router weights are checked for
    NaN and infinities when they load (docs/method.md §4). Sequence-wide routing keeps its
    checks."""
    return hidden.device.type == "cpu" or torch.is_grad_enabled()


def init_generator(seed: int, layer_idx: int) -> torch.Generator:
    # one independent stream per (seed, layer): a layer's initialisation does not depend on
    # which other layers get Focus
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + layer_idx) % (2**63 - 1))


def orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    """Q of the QR decomposition with a sign convention that makes it unique."""
    q, r = torch.linalg.qr(x)
    return q * torch.sign(torch.diagonal(r))[None, :]


def _preserves_values(fn, device: torch.device) -> bool:
    """Whether ``fn`` (an ``nn.Module._apply`` function) keeps a tensor's values: False for
    ``to_empty`` (fresh memory) and for moves to the ``meta`` device."""
    if device.type == "meta":
        return True  # nothing to preserve; the caller handles leaving meta
    probe = torch.full((1,), 1.5, dtype=ROUTER_DTYPE, device=device)
    out = fn(probe)
    return out.device.type != "meta" and float(out.float().cpu()[0]) == 1.5


class FocusRouter(nn.Module):
    """Routing of one attention layer (docs/method.md §1, §2 and §4).

    Parameters (trainable): ``proj`` ``W_g`` ``[d_model, d_g]`` and ``centroids`` ``C``
    ``[K, d_g]``, so ``d_model * d_g + K * d_g`` per layer. Buffers (saved, not trained):
    ``routing_bias`` ``[K]`` float32, the running mean of the Sinkhorn column bias, and
    ``bias_updates`` (how many soft-training batches fed it).

    Precision and placement: the parameters and float buffers are float32 always
    (:data:`ROUTER_DTYPE`). ``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.double()`` and
    ``.float()`` move a router to the requested device but keep it float32 (the cast of the
    values is never applied, so no precision is lost and routing does not depend on whether a
    model was cast before or after wrapping), as PEFT keeps adapter weights in float32.

    Values: a router created on the ``meta`` device holds none; when it is later materialised
    (``to_empty``) it is initialised as below, to the values it would have had on a real
    device. A router that held values (trained or loaded) and lost them (moved to ``meta``, or
    ``to_empty``) reports :attr:`holds_values` False, and a Focus layer refuses to run with it
    until values are loaded (:meth:`FocusModel.load_state_dict`, ``FocusModel.from_pretrained``)
    or :meth:`reset_parameters` is called.

    Initialisation (docs/method.md §1, deterministic from ``seed`` and ``layer_idx``):
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
        device: where the tensors are created (default: the current default device).
    """

    #: the router's tensors in the adapter file, in file order (the last one an integer
    #: counter, the others float32)
    TENSORS = ("proj", "centroids", "routing_bias", "bias_updates")
    #: whether the router reads each key-value head's queries and keys (a
    #: :class:`~focus_attention.hf.query_key.QueryKeyRouter`) rather than the hidden state
    reads_query_key = False

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
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.d_model, self.num_groups, self.group_dim = d_model, num_groups, group_dim
        self.temperature = float(temperature)
        self.layer_idx = layer_idx
        self.seed = int(seed)
        self.bias_momentum = float(bias_momentum)
        #: the ranks whose routing statistics :meth:`update_bias` combines (a
        #: ``torch.distributed`` ProcessGroup; None: the default group). Set it to the
        #: data-parallel group when other ranks see the same batch (tensor or context
        #: parallelism).
        self.data_parallel_group: Any = None
        #: whether :meth:`update_bias` combines the statistics of the data-parallel ranks
        self.sync_statistics = True
        kw = {"device": device, "dtype": ROUTER_DTYPE}
        self.proj = nn.Parameter(torch.empty(d_model, group_dim, **kw))
        self.centroids = nn.Parameter(torch.empty(num_groups, group_dim, **kw))
        self.register_buffer("routing_bias", torch.zeros(num_groups, **kw))
        self.register_buffer("bias_updates", torch.zeros((), dtype=torch.long, device=device))
        #: False while the tensors hold no values (meta, or emptied by ``to_empty``).
        self.holds_values = False
        #: True until the router first holds values (its initialisation was deferred).
        self._never_initialised = True
        self.reset_parameters(self.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Deterministic initialisation described in the class docstring (buffers zeroed).

        ``seed`` defaults to the seed the router was built with. On the ``meta`` device
        nothing is written (the initialisation runs when the router is materialised)."""
        if seed is not None:
            self.seed = int(seed)
        if self.centroids.device.type == "meta":
            return
        gen = init_generator(self.seed, self.layer_idx)
        k, d = self.num_groups, self.group_dim
        cpu = torch.device("cpu")
        proj = orthonormal_columns(torch.randn(self.d_model, d, generator=gen, device=cpu))
        if k <= d:
            cents = orthonormal_columns(torch.randn(d, k, generator=gen, device=cpu)).t()
        else:
            cents = torch.randn(k, d, generator=gen, device=cpu)
            cents = cents / cents.norm(dim=-1, keepdim=True)
        self.proj.copy_(proj)
        self.centroids.copy_(cents)
        self.routing_bias.zero_()
        self.bias_updates.zero_()
        self.mark_loaded()

    def mark_loaded(self) -> None:
        """Record that the tensors now hold real values (after an initialisation or a load)."""
        self.holds_values = self.centroids.device.type != "meta"
        self._never_initialised = self._never_initialised and not self.holds_values

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (behind ``.to``, ``.half``, ``.cuda``, ``to_empty``...) with
        the float32 rule and the value tracking described in the class docstring."""
        before = self.centroids.device
        preserves = _preserves_values(fn, before)

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if t.is_floating_point() and out.dtype != t.dtype:
                out = t.to(device=out.device)  # the move without the cast
            return out

        super()._apply(keep_fp32, recurse)
        after = self.centroids.device
        if after.type == "meta" or not preserves or before.type == "meta":
            self.holds_values = False
            if after.type != "meta" and self._never_initialised:
                self.reset_parameters()  # deferred initialisation: same values as on a device
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if all(prefix + n in state_dict for n in self.TENSORS):
            with torch.no_grad():  # ``assign=True`` may bring another dtype: back to fp32
                for name in self.TENSORS[:-1]:
                    t = getattr(self, name)
                    if t.dtype != ROUTER_DTYPE:
                        t.data = t.data.to(ROUTER_DTYPE)
            self.mark_loaded()

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Routing scores ``[B, N, K]`` float32 of ``hidden`` ``[B, N, d_model]``
        (docs/method.md §1), also inside ``torch.autocast`` (see :func:`group_scores`)."""
        return group_scores(hidden, self.proj, self.centroids, self.temperature)

    def soft(
        self, scores: torch.Tensor, n_iter: int, real: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinkhorn rows ``[B, N, K]`` float32 and column bias ``[B, K]`` of ``scores``
        ``[B, N, K]``; padding (``real`` bool ``[B, N]``, True = real, or None) is excluded
        from the column sums and its rows are zero (docs/method.md §2)."""
        probs, bias = sinkhorn(scores, n_iter, real, return_column_bias=True)
        return probs, bias

    def causal_groups(
        self, scores: torch.Tensor, top_k: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal top-k memberships bool ``[B, N, K]``: top-k of ``scores + routing_bias``
        (or of ``scores + bias``, a ``[K]`` bias such as an earlier ``routing_bias``).

        A token's groups depend on that token only (docs/method.md §4). Ties go to the
        lowest group index.
        """
        bias = self.routing_bias if bias is None else bias
        return topk_memberships(scores + bias.float(), top_k)

    def topk_groups(self, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
        """Causal top-k memberships bool ``[B, N, K]`` of ``hidden`` ``[B, N, d_model]``:
        ``causal_groups(scores(hidden), top_k)``, in one fused call for a decoding step on
        the CPU (:func:`~focus_attention.ops.causal_topk_groups`, docs/method.md §4).
        NaN scores raise ``ValueError`` where :func:`checks_nan` says so."""
        return causal_topk_groups(
            hidden, self.proj, self.centroids, self.routing_bias, self.temperature, top_k,
            check_nan=checks_nan(hidden),
        )  # fmt: skip

    def topk_group_sets(self, hidden: torch.Tensor, top_ks: tuple[int, ...]) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """:meth:`topk_groups` for each of ``top_ks``, the scores computed once
        (:func:`~focus_attention.ops.causal_topk_groups_many`; asymmetric top-k,
        docs/method.md §4): a tuple of bool ``[B, N, K]`` in the order of ``top_ks``."""
        return causal_topk_groups_many(
            hidden, self.proj, self.centroids, self.routing_bias, self.temperature, top_ks,
            check_nan=checks_nan(hidden),
        )  # fmt: skip

    @torch.no_grad()
    def update_bias(self, column_bias: torch.Tensor, real: torch.Tensor | None) -> None:
        """Fold one batch of Sinkhorn column biases ``[B, K]`` into ``routing_bias``.

        Sequences without a real token (``real`` bool ``[B, N]``, True = real) are skipped.
        A batch mean enters with weight ``max(bias_momentum, 1 / (updates + 1))``: a
        cumulative mean at first, an EMA later (docs/method.md §4). The Focus layer calls it
        once per soft-routing forward of the model in training mode (the recomputed forward
        of activation checkpointing does not fold the batch in again).

        Data parallelism (docs/method.md §6, "Distributed training"): while a
        ``torch.distributed`` process group is initialised with more than one rank in
        :attr:`data_parallel_group` (None: the default group, every rank), each call gathers
        every rank's batch mean and row count (one ``all_gather`` of ``K + 1`` float32) and
        folds the ranks' means in rank order, so every rank ends with the statistics, and
        ``bias_updates``, of one process folding the same micro-batches in that order (one
        process with ``W`` times the gradient accumulation, whatever the engine: DDP with
        or without buffer broadcast, Trainer, accelerate). Every rank of the group must
        therefore make the same number of calls; set :attr:`sync_statistics` False (or use
        :func:`local_statistics`) for forwards that run on some ranks only.
        """
        if real is not None:
            column_bias = column_bias[real.any(dim=-1)]
        rows = column_bias.shape[0]
        kept = column_bias.float().to(self.routing_bias.device)
        mean = kept.mean(dim=0) if rows else kept.new_zeros(self.num_groups)
        local = torch.cat([mean, kept.new_tensor([float(rows)])])
        for part in self._gather_ranks(local):
            if part[-1] == 0:
                continue
            weight = torch.clamp(1.0 / (self.bias_updates.float() + 1.0), min=self.bias_momentum)
            self.routing_bias.mul_(1.0 - weight).add_(weight * part[:-1])
            self.bias_updates.add_(1)

    def _gather_ranks(self, local: torch.Tensor) -> list[torch.Tensor]:
        """``local`` of every rank of the data-parallel group, in rank order (``[local]``
        without an initialised group of more than one rank, or with ``sync_statistics``
        off)."""
        if not (self.sync_statistics and dist.is_available() and dist.is_initialized()):
            return [local]
        group = self.data_parallel_group
        world = dist.get_world_size(group)
        if world == 1:
            return [local]
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return parts

    def check_ready(self, hidden: torch.Tensor) -> None:
        """Raise ``ValueError`` unless the router holds values on ``hidden``'s device."""
        if not self.holds_values:
            where = "on the meta device" if self.centroids.device.type == "meta" else "emptied"
            raise ValueError(
                f"the Focus router of layer {self.layer_idx} holds no values ({where}: it was "
                "moved to the meta device or materialised with to_empty after it held values); "
                "load an adapter (FocusModel.from_pretrained / load_state_dict) or call "
                "reset_parameters() on it"
            )
        if self.centroids.device != hidden.device:
            raise ValueError(
                f"the Focus router of layer {self.layer_idx} is on {self.centroids.device} but the "
                f"hidden state entering the layer is on {hidden.device}: move the FocusModel "
                "(focus_model.to(device)), not only its base model"
            )

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, d_model={self.d_model}, K={self.num_groups}, "
            f"d_g={self.group_dim}, tau={self.temperature}"
        )


@contextmanager
def local_statistics(routers: Iterable[FocusRouter]) -> Iterator[None]:
    """Within the block, the ``routers`` fold only this process's batches
    (:attr:`FocusRouter.sync_statistics` off; restored on exit), for soft training-mode
    forwards that not every rank of the data-parallel group runs."""
    routers = list(routers)
    before = [r.sync_statistics for r in routers]
    for r in routers:
        r.sync_statistics = False
    try:
        yield
    finally:
        for r, flag in zip(routers, before, strict=True):
            r.sync_statistics = flag
