"""Routing: group scores, Sinkhorn balancing and hard top-k memberships (docs/method.md §1,
§2 and §4)."""

from __future__ import annotations

import torch

from ..utils.checks import check_int
from . import reference
from .checks import check_count, check_finite, check_shape, check_tensor, fail
from .sparse import extension

#: most tokens per call that :func:`causal_topk_groups` routes with the fused CPU kernel (a
#: decoding step, a short chunk); longer inputs go through matrix products, which are
#: faster there
FUSED_ROUTE_TOKENS = 16


def group_scores(
    hidden: torch.Tensor,
    proj: torch.Tensor,
    centroids: torch.Tensor,
    temperature: float,
    *,
    normalize: bool = True,
) -> torch.Tensor:
    """Routing scores of every token against every centroid.

    ``S = normalize(hidden @ proj) @ normalize(centroids).T / temperature`` computed in fp32
    (docs/method.md §1, Focus paper Sec. 3.1). With ``normalize=True`` (the default, a
    choice of this package, docs/method.md §1) both the projected hidden state and the centroids are L2-normalised, so the
    scores are cosine similarities in ``[-1/temperature, 1/temperature]``: the hidden states
    of pretrained LMs carry a few huge outlier features that otherwise swamp the routing.
    ``normalize=False`` gives the paper's plain dot product.

    Args:
        hidden: ``[B, N, d_model]`` any float dtype, the hidden state entering the attention
            block (after the block's input norm).
        proj: ``[d_model, d_g]`` projection ``W_g``.
        centroids: ``[K, d_g]`` centroids ``C``.
        temperature: ``tau > 0`` (paper default 0.1).

    Returns:
        ``[B, N, K]`` float32 scores, computed in float32 also inside ``torch.autocast``.

    Raises:
        ValueError: wrong ranks, mismatched ``d_model`` or ``d_g``, non-positive temperature.
    """
    check_tensor("hidden", hidden, 3, floating=True)
    check_tensor("proj", proj, 2, floating=True)
    check_tensor("centroids", centroids, 2, floating=True)
    if proj.shape[0] != hidden.shape[-1]:
        fail("proj", f"shape {tuple(proj.shape)}", f"[d_model={hidden.shape[-1]}, d_g]")
    if centroids.shape[1] != proj.shape[1]:
        fail("centroids", f"shape {tuple(centroids.shape)}", f"[K, d_g={proj.shape[1]}]")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        fail("temperature", repr(temperature), "a float > 0")
    return reference.group_scores(hidden, proj, centroids, temperature, normalize=normalize)


def sinkhorn(
    log_scores: torch.Tensor,
    n_iter: int,
    padding_mask: torch.Tensor | None = None,
    *,
    return_column_bias: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sinkhorn balancing of routing scores, in log space and fp32 (docs/method.md §2).

    Starting from ``Q = exp(log_scores)`` each of ``n_iter`` iterations divides every group
    column by its sum over the real tokens (equal mass per group), then every token row by its
    sum over groups (rows sum to 1). Gradients flow through every step. ``n_iter = 0`` turns
    the balancing off: the rows are the plain softmax of the scores over groups and the column
    bias is zero (the "without Sinkhorn" ablation of the paper).

    The result equals ``softmax(log_scores + c, dim=-1)`` row by row, where ``c`` ``[B, K]`` is
    minus the accumulated column log-normalisers: a per-group bias. With
    ``return_column_bias=True`` it is returned (centred to zero mean over groups) so a causal
    router can calibrate a bias from it (docs/method.md §4).

    Args:
        log_scores: ``[B, N, K]`` float scores (any float dtype; computed in fp32).
        n_iter: number of iterations, ``>= 0`` (paper default 10; 0 = softmax, no balancing).
        padding_mask: optional bool ``[B, N]``, True = real token. Padding is excluded from
            the column sums and its rows are all zero in the output.

    Returns:
        float32 ``[B, N, K]`` (float64 for float64 input); every real row sums to 1. With
        ``return_column_bias`` a tuple ``(probs, bias [B, K])``.

    Raises:
        ValueError: rank not 3, ``n_iter < 0``, NaN scores, malformed ``padding_mask``.
    """
    check_tensor("log_scores", log_scores, 3, floating=True)
    check_int("sinkhorn", "n_iter", n_iter, 0)
    check_finite("log_scores", log_scores)
    if padding_mask is not None:
        check_tensor("padding_mask", padding_mask, 2)
        if padding_mask.dtype != torch.bool:
            fail("padding_mask", f"dtype {padding_mask.dtype}", "torch.bool (True = real)")
        check_shape(
            "padding_mask", padding_mask, tuple(log_scores.shape[:2]), "[B, N] of log_scores"
        )
    return reference.sinkhorn(
        log_scores, n_iter, padding_mask, return_column_bias=return_column_bias
    )


def topk_memberships(scores: torch.Tensor, top_k: int, *, check_nan: bool = True) -> torch.Tensor:
    """Hard routing: each token joins its ``top_k`` highest-scoring groups (docs/method.md §4).

    Ties go to the lowest group index (a stable descending sort), so the result is
    deterministic on every run and device.

    Args:
        scores: ``[B, N, K]`` float scores (routing is decided in fp32).
        top_k: ``1 <= top_k <= K``.
        check_nan: raise on NaN scores (the default). The check reads a value back from
            the device, a host synchronisation; ``False`` skips it, and the groups of a
            token with a NaN score are then what PyTorch's ``argmax`` and ``sort`` make of
            NaN (they rank it highest).

    Returns:
        bool ``[B, N, K]`` with exactly ``top_k`` True per token.

    Raises:
        ValueError: rank not 3, ``top_k`` outside ``1..K``, NaN scores (with ``check_nan``).
    """
    check_tensor("scores", scores, 3, floating=True)
    k = scores.shape[-1]
    check_count("topk_memberships", "top_k", top_k, 1, k)
    if check_nan:
        check_finite("scores", scores)
    return reference.topk_memberships(scores, top_k)


def causal_topk_groups(
    hidden: torch.Tensor,
    proj: torch.Tensor,
    centroids: torch.Tensor,
    bias: torch.Tensor,
    temperature: float,
    top_k: int,
    *,
    check_nan: bool = True,
) -> torch.Tensor:
    """Causal top-k memberships of tokens from their hidden states (docs/method.md §1, §4):
    ``topk_memberships(group_scores(hidden, proj, centroids, temperature) + bias, top_k)``.

    Without gradients, for at most :data:`FUSED_ROUTE_TOKENS` tokens on the CPU (a
    decoding step), the fused kernel of ``cpu_fused`` computes it in one call instead of a
    dozen small PyTorch calls (each several microseconds, which at decoding cost as much as
    sparse attention saves). It computes the same float32 arithmetic in another order, so
    scores agree to float32 rounding (about 1e-6 relative), as those of a token computed
    alone and within a batch already do; only a near-tie between groups can fall the
    other way. Elsewhere (gradients, longer inputs, other devices, no kernel) the two ops
    above run.

    Args:
        hidden: ``[B, N, d_model]`` any float dtype; proj: ``[d_model, d_g]``; centroids:
            ``[K, d_g]``; bias: ``[K]`` float, added to the scores (the calibrated routing
            bias); temperature: ``tau > 0``; top_k: ``1 <= top_k <= K``; check_nan: as
            for :func:`topk_memberships` (the fused kernel reports NaN without a
            synchronisation, so it always checks).

    Returns:
        bool ``[B, N, K]`` with exactly ``top_k`` True per token, ties to the lowest index.

    Raises:
        ValueError: the errors of :func:`group_scores` and :func:`topk_memberships`
            (wrong ranks or sizes, ``top_k`` outside ``1..K``, NaN scores).
    """
    kernel = _routing_kernel(hidden, proj, centroids, bias, temperature, top_k)
    if kernel is None:
        scores = group_scores(hidden, proj, centroids, temperature) + bias.float()
        return topk_memberships(scores, top_k, check_nan=check_nan)
    return _fused_route(kernel, hidden, proj, centroids, bias, temperature, top_k)


def causal_topk_groups_many(
    hidden: torch.Tensor,
    proj: torch.Tensor,
    centroids: torch.Tensor,
    bias: torch.Tensor,
    temperature: float,
    top_ks: tuple[int, ...],
    *,
    check_nan: bool = True,
) -> tuple[torch.Tensor, ...]:
    """:func:`causal_topk_groups` for several ``top_k`` of the same tokens, the scores
    computed once (asymmetric top-k, docs/method.md §4: a query's ``query_top_k`` groups and
    a key's ``top_k`` groups come from the same scores).

    Each result is bitwise the one :func:`causal_topk_groups` gives for its ``top_k``:
    where the fused kernel routes (a decoding step) it runs once per distinct value, a call
    of a few microseconds; elsewhere ``group_scores + bias`` is computed once and
    :func:`topk_memberships` taken for each value.

    Args:
        hidden, proj, centroids, bias, temperature, check_nan: as for
            :func:`causal_topk_groups`.
        top_ks: one or more ints, each in ``1..K``; repeats are allowed.

    Returns:
        a tuple of bool ``[B, N, K]``, one per entry of ``top_ks``, in order (the same
        tensor object for equal entries).

    Raises:
        ValueError: ``top_ks`` empty, and the errors of :func:`causal_topk_groups`.
    """
    if not isinstance(top_ks, (tuple, list)) or len(top_ks) == 0:
        fail("top_ks", repr(top_ks), "a non-empty tuple of ints in 1..K")
    kernels = {k: _routing_kernel(hidden, proj, centroids, bias, temperature, k) for k in top_ks}
    if all(kernel is not None for kernel in kernels.values()):
        groups = {k: _fused_route(kernel, hidden, proj, centroids, bias, temperature, k)
                  for k, kernel in kernels.items()}  # fmt: skip
    else:
        scores = group_scores(hidden, proj, centroids, temperature) + bias.float()
        groups = {k: topk_memberships(scores, k, check_nan=check_nan) for k in kernels}
    return tuple(groups[k] for k in top_ks)


def _fused_route(kernel, hidden, proj, centroids, bias, temperature, top_k) -> torch.Tensor:
    """The fused kernel's memberships bool ``[B, N, K]`` on inputs :func:`_routing_kernel`
    accepted; ``ValueError`` on NaN scores, as :func:`topk_memberships` raises."""
    groups, has_nan = kernel.focus_route(
        hidden.contiguous(), proj, centroids, bias, float(temperature), top_k
    )
    if has_nan:
        fail("scores", "a tensor containing NaN", "finite scores")
    return groups


def _routing_kernel(hidden, proj, centroids, bias, temperature, top_k):
    """The loaded kernel module when :func:`causal_topk_groups` can run it on these inputs,
    else None (anything it would refuse goes to the checked ops, which raise the documented
    errors)."""
    if torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return None
    if hidden.shape[1] > FUSED_ROUTE_TOKENS or hidden.device.type != "cpu":
        return None
    if not hidden.is_floating_point() or hidden.numel() == 0:
        return None
    router = (proj, centroids, bias)
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in router):  # fmt: skip
        return None
    k = centroids.shape[0]
    shapes_ok = proj.dim() == 2 and centroids.dim() == 2 and bias.shape == (k,)
    shapes_ok = shapes_ok and proj.shape[0] == hidden.shape[2] and centroids.shape[1] == proj.shape[1]  # fmt: skip
    positive = isinstance(temperature, (int, float)) and temperature > 0
    if not (shapes_ok and positive and isinstance(top_k, int) and 1 <= top_k <= k):
        return None
    return extension.load()
