"""Diagnostic visibility masks: which distant keys each query would see if something other
than the learned router chose them, at the budget of top-1 routing (docs/method.md §4).

A key is *near* a query when it is causal, real and either local (``i - j < window``) or a
sink; it is *distant* when it is causal, real and neither. Every mask here keeps the near keys
and picks distant ones per key-value head:

- :func:`oracle_visibility`: each query keeps its ``ceil(distant / K)`` distant keys of
  highest ``q . k`` (the share top-1 routing keeps with ``K`` balanced groups);
- :func:`group_visibility`: the keys are grouped by their nearest centroid (e.g. k-means
  centroids of a prompt's keys, :func:`kmeans_keys`), and each query sees the distant keys of
  the groups whose centroids its ``q . c`` scores highest.

Queries of the ``H / H_kv`` heads sharing a key-value head are pooled by the **maximum** of
their scores (a key or centroid ranks by the best score any of those heads gives it).
Shapes: query ``[B, H, Nq, D]``, key ``[B, H_kv, Nk, D]``, queries bottom-right aligned;
masks bool ``[B, H_kv, Nq, Nk]``, True = visible. Scores are ranked in float32 (float64 for
float64 inputs); their order does not depend on a positive logit scale or a soft cap, so none
is taken. These masks are for diagnosis only: k-means centroids fitted on a prompt's keys
see every key of it, later ones included.
"""

from __future__ import annotations

import torch

from .checks import check_bool, check_shape, check_tensor, fail
from .masks import effective_window
from .reference import causal_and_local

__all__ = [
    "distant_kept_share",
    "group_visibility",
    "kmeans_keys",
    "near_and_distant",
    "oracle_visibility",
    "pooled_scores",
]

#: query rows scored at once (bounds the ``[B, H, rows, Nk]`` float32 scores held)
CHUNK_ROWS = 512


def _check_inputs(query: torch.Tensor, key: torch.Tensor, sinks, real) -> None:
    """Raise ``ValueError`` unless query ``[B, H, Nq, D]`` and key ``[B, H_kv, Nk, D]``
    (``H % H_kv == 0``, ``Nq <= Nk``) are floating and ``sinks``/``real`` are None or bool
    ``[B, Nk]``."""
    check_tensor("query", query, 4, floating=True)
    check_tensor("key", key, 4, floating=True)
    bsz, h, nq, d = query.shape
    if key.shape[0] != bsz or key.shape[3] != d or key.shape[1] < 1 or h % key.shape[1]:
        fail("key", f"shape {tuple(key.shape)}", f"[B={bsz}, H_kv dividing H={h}, Nk, D={d}]")
    if nq > key.shape[2]:
        fail("query", f"Nq = {nq} queries for Nk = {key.shape[2]} keys", "Nq <= Nk")
    for name, x in (("sinks", sinks), ("real", real)):
        if x is not None:
            check_tensor(name, x, 2)
            check_bool(name, x)
            check_shape(name, x, (bsz, key.shape[2]), "[B, Nk]")


def near_and_distant(num_queries: int, num_keys: int, window: int, *, sinks=None, real=None,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(near, distant)`` bool ``[B or 1, Nq, Nk]`` of bottom-right aligned queries (module
    docstring): ``sinks`` and ``real`` bool ``[B, Nk]`` or None (no sink; every key real)."""
    window = effective_window(window, num_keys)
    causal, local = causal_and_local(num_queries, num_keys, window, device)
    near, distant = (causal & local)[None], (causal & ~local)[None]
    if sinks is not None:
        near = near | (distant & sinks[:, None, :])
        distant = distant & ~sinks[:, None, :]
    if real is not None:
        near, distant = near & real[:, None, :], distant & real[:, None, :]
    return near, distant


def pooled_scores(query: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``max_h q_h . x`` over the query heads ``h`` sharing each key-value head: float32
    (float64) ``[B, H_kv, Nq, M]`` from ``query [B, H, Nq, D]`` and ``other [B, H_kv, M, D]``
    (keys or centroids)."""
    bsz, h, nq, d = query.shape
    h_kv = other.shape[1]
    ct = torch.promote_types(query.dtype, torch.float32)
    q = query.to(ct).reshape(bsz, h_kv, h // h_kv, nq, d)
    return (q @ other.to(ct)[:, :, None].transpose(-1, -2)).amax(dim=2)


def _base_mask(query, key, window, sinks, real) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, distant)``: the near keys as a fresh ``[B, H_kv, Nq, Nk]`` mask, and the
    distant ones ``[B or 1, Nq, Nk]``."""
    bsz, h_kv, nk = key.shape[0], key.shape[1], key.shape[2]
    near, distant = near_and_distant(query.shape[2], nk, window, sinks=sinks, real=real,
                                     device=query.device)  # fmt: skip
    return near[:, None].expand(bsz, h_kv, -1, -1).clone(), distant


def oracle_visibility(query: torch.Tensor, key: torch.Tensor, window: int, num_groups: int,
                      *, top_k: int = 1, sinks=None, real=None) -> torch.Tensor:  # fmt: skip
    """The near keys and, per key-value head, each query's ``ceil(top_k * distant /
    num_groups)`` distant keys of highest pooled ``q . k`` (:func:`pooled_scores`; ties
    broken by ``torch.topk``), the share top-k routing of ``num_groups`` groups reads: bool
    ``[B, H_kv, Nq, Nk]``. Each query keeps exactly that many distant keys (never more
    than it has).

    Raises:
        ValueError: malformed tensors, ``window``, ``num_groups`` or ``top_k`` not an int
            >= 1, ``top_k`` above ``num_groups``.
    """
    _check_inputs(query, key, sinks, real)
    _check_count("num_groups", num_groups)
    _check_count("window", window)
    _check_count("top_k", top_k)
    if top_k > num_groups:
        fail("top_k", top_k, f"at most num_groups = {num_groups}")
    mask, distant = _base_mask(query, key, window, sinks, real)
    budget = (distant.sum(dim=-1) * top_k + num_groups - 1) // num_groups  # [B or 1, Nq]
    for start in range(0, query.shape[2], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        need = budget[:, None, rows]  # [B or 1, 1, rows]
        most = int(need.max()) if need.numel() else 0
        if most == 0:
            continue
        far = distant[:, None, rows]
        scores = pooled_scores(query[:, :, rows], key).masked_fill(~far, float("-inf"))
        picked = scores.topk(most, dim=-1).indices
        keep = torch.arange(most, device=query.device) < need[..., None]
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picked, keep.expand_as(picked))  # fmt: skip
        mask[:, :, rows] |= chosen & far
    return mask


def kmeans_keys(key: torch.Tensor, num_clusters: int, *, iters: int = 10, seed: int = 0,
                real=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Lloyd's k-means (squared Euclidean distance) of each key-value head's real keys.

    The centroids start at ``num_clusters`` distinct real keys drawn with a CPU generator
    seeded ``seed`` (the same on every device); each of ``iters`` rounds assigns every key
    to its nearest centroid (ties: the lowest index) and moves each centroid to the mean of
    its real keys (an empty cluster keeps its centroid).

    Args:
        key: ``[B, H_kv, Nk, D]`` floating. num_clusters: ``1 .. Nk``. iters: rounds >= 0.
        seed: the initial draw's seed. real: bool ``[B, Nk]`` or None (every key real).

    Returns:
        ``(labels int64 [B, H_kv, Nk], centroids [B, H_kv, num_clusters, D])``, centroids in
        float32 (float64 for float64 keys); padding keys get labels too (ignore them).

    Raises:
        ValueError: malformed tensors, ``num_clusters`` outside ``1 .. Nk``, ``iters < 0``.
    """
    check_tensor("key", key, 4, floating=True)
    bsz, h_kv, nk, _ = key.shape
    if not isinstance(num_clusters, int) or not 1 <= num_clusters <= nk:
        fail("num_clusters", num_clusters, f"an int in 1..Nk={nk}")
    if not isinstance(iters, int) or iters < 0:
        fail("iters", iters, "an int >= 0")
    if real is not None:
        check_tensor("real", real, 2)
        check_bool("real", real)
        check_shape("real", real, (bsz, nk), "[B, Nk]")
    x = key.to(torch.promote_types(key.dtype, torch.float32))
    weight = torch.ones(bsz, 1, nk, dtype=x.dtype, device=x.device)
    if real is not None:
        weight = real[:, None, :].to(x.dtype)
    draw = torch.rand(bsz, h_kv, nk, generator=torch.Generator().manual_seed(seed))
    draw = draw.to(x.device).masked_fill(weight.expand(bsz, h_kv, nk) == 0, -1.0)
    start = draw.topk(num_clusters, dim=-1).indices
    centroids = x.gather(2, start[..., None].expand(-1, -1, -1, x.shape[3]))
    for _ in range(iters):
        labels = _nearest(x, centroids)
        onehot = torch.nn.functional.one_hot(labels, num_clusters).to(x.dtype) * weight[..., None]
        counts = onehot.sum(dim=2)[..., None]  # [B, H_kv, C, 1]
        sums = onehot.transpose(-1, -2) @ x
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
    return _nearest(x, centroids), centroids


def _nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, H_kv, Nk]``: the nearest centroid (squared distance) of each key."""
    dist = (centroids * centroids).sum(-1)[:, :, None, :] - 2 * (x @ centroids.transpose(-1, -2))
    return dist.argmin(dim=-1)


def group_visibility(query: torch.Tensor, key: torch.Tensor, window: int,
                     centroids: torch.Tensor, top_groups: int = 1, *, sinks=None,
                     real=None) -> torch.Tensor:  # fmt: skip
    """The near keys and, per key-value head, the distant keys of the ``top_groups`` groups
    whose centroids each query's pooled ``q . c`` (:func:`pooled_scores`) scores highest, a
    key belonging to the group of its nearest centroid (squared distance, ties to the lowest
    index): bool ``[B, H_kv, Nq, Nk]``. ``centroids`` ``[B, H_kv, C, D]``, e.g. those
    :func:`kmeans_keys` fits on the keys of a prompt (then kept while decoding, so that a
    new key joins the group of its nearest centroid).

    Raises:
        ValueError: malformed tensors, ``window`` not an int >= 1, ``top_groups`` outside
            ``1 .. C``.
    """
    _check_inputs(query, key, sinks, real)
    _check_count("window", window)
    check_tensor("centroids", centroids, 4, floating=True)
    bsz, h_kv, _, d = key.shape
    if tuple(centroids.shape[:2]) != (bsz, h_kv) or centroids.shape[3] != d:
        fail("centroids", f"shape {tuple(centroids.shape)}", f"[B={bsz}, H_kv={h_kv}, C, D={d}]")
    if not isinstance(top_groups, int) or not 1 <= top_groups <= centroids.shape[2]:
        fail("top_groups", top_groups, f"an int in 1..C={centroids.shape[2]}")
    ct = torch.promote_types(key.dtype, torch.float32)
    labels = _nearest(key.to(ct), centroids.to(ct))
    mask, distant = _base_mask(query, key, window, sinks, real)
    for start in range(0, query.shape[2], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        scores = pooled_scores(query[:, :, rows], centroids)  # [B, H_kv, rows, C]
        best = scores.topk(top_groups, dim=-1).indices
        member = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)
        index = labels[:, :, None, :].expand(-1, -1, member.shape[2], -1)
        mask[:, :, rows] |= member.gather(-1, index) & distant[:, None, rows]
    return mask


def distant_kept_share(mask: torch.Tensor, window: int, *, sinks=None, real=None) -> float | None:  # fmt: skip
    """The mean, over heads and over the queries with at least one distant key, of the share
    of their distant keys ``mask`` keeps: ``mask`` bool ``[B, Nq, Nk]`` (one for every head)
    or ``[B, H', Nq, Nk]``; None when no query has a distant key.

    Raises:
        ValueError: ``mask`` not a bool tensor of rank 3 or 4.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() not in (3, 4):
        fail("mask", getattr(mask, "shape", type(mask).__name__), "bool [B, (H,) Nq, Nk]")
    m = mask if mask.dim() == 4 else mask[:, None]
    _, distant = near_and_distant(m.shape[2], m.shape[3], window, sinks=sinks, real=real,
                                  device=m.device)  # fmt: skip
    total = distant.sum(dim=-1)[:, None]  # [B or 1, 1, Nq]
    kept = (m & distant[:, None]).sum(dim=-1)  # [B, H', Nq]
    rows = (total > 0).expand_as(kept)
    if not rows.any():
        return None
    return float((kept[rows].double() / total.expand_as(kept)[rows].double()).mean())


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        fail(name, value, "an int >= 1")
