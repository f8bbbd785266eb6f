"""The training losses of ``focus train --objective`` (docs/method.md §6, "Objectives").

Each objective takes one block batch ``x`` (int64 ``[B, N]`` token ids) and returns a
:class:`StepLoss`: the scalar to back-propagate into the routers, the numbers to log and the
routing records for the dominance statistics. Only the routers receive gradients; the base
model stays frozen in every objective.

- ``lm``: next-token cross-entropy of the soft-routed Focus model (the paper's objective).
- ``distill``: ``KL(p_dense || p_focus)`` per token, averaged: the frozen model with Focus
  disabled is the teacher (no extra weights), the soft-routed Focus model the student.
- ``mix``: ``lm + distill_weight * distill``.
- ``distill`` with ``--method head-gates``: the KL plus ``gate_penalty`` times the mean head
  gate (:func:`head_gates_step`); only the gates train.
- ``coverage``: the share of the dense model's attention beyond the window that the soft
  groups drop, averaged over layers (:mod:`focus_attention.ops.coverage`). The dense model
  runs once without gradients; each router then sees the hidden state the dense model gives
  its layer, so no soft attention is computed and the cost is one dense forward plus the
  attention rows of the sampled queries.
- ``attention`` (query-key routers, ``FocusConfig.router_input="query_key"``): per sampled
  query beyond the window and key-value head, ``KL(dense group mass || router)``: the dense
  model's distant attention (maximum over the query heads sharing the key-value head,
  renormalised) summed per group through the keys' soft assignment ``softmax(k . C)``,
  against the query's ``softmax(q . C)``; gradients reach the centroids from both sides.
  Also folds the batch's mean key into each router's ``key_mean``. Cost as ``coverage``.
- ``ranking`` (query-key routers): ``attention``'s KL with the keys' groups
  Sinkhorn-balanced as in ``coverage``, so that the order of the query's groups follows the
  attention's mass per group (its top ``query_top_k`` groups are those attention weighs
  most) while the groups stay about equal in size (:func:`ranking_kl`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ..evaluation.coverage import recorded_distant, recorded_groups
from ..hf.query_key import head_memberships
from ..ops.coverage import distant_attention, hard_coverage, soft_coverage
from .config import QUESTION_TOKENS

__all__ = [
    "StepLoss",
    "attention_kl",
    "coverage_rows",
    "group_kl",
    "head_gates_step",
    "objective_loss",
    "row_weights",
]


@dataclass
class StepLoss:
    """One micro-batch of an objective: ``loss`` (scalar, with gradient to the routers),
    ``metrics`` (floats to log, ``loss`` included) and ``records`` (routing records as
    ``FocusModel.record_routing`` gives them)."""

    loss: torch.Tensor
    metrics: dict[str, float]
    records: list[dict[str, Any]] = field(default_factory=list)


def _check_finite(loss: torch.Tensor, what: str) -> None:
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite training {what} {float(loss)}")


def lm_step(model: Any, x: torch.Tensor, forward: Any = None) -> StepLoss:
    """Next-token cross-entropy (nats/token) of the soft-routed model on ``x``; the forward
    runs through ``forward`` (the model as the engine wraps it, such as DDP's module;
    default ``model``)."""
    with model.record_routing() as records:
        loss = (forward or model)(input_ids=x, labels=x, use_cache=False).loss
    _check_finite(loss, "loss")
    return StepLoss(loss, {"loss": float(loss.detach())}, records)


def distill_step(model: Any, x: torch.Tensor, weight_lm: float, weight_kl: float,
                 forward: Any = None) -> StepLoss:  # fmt: skip
    """``weight_lm * cross-entropy + weight_kl * KL(dense || Focus)`` on ``x``; the KL is
    per token (nats), averaged over every position of the batch. The student's forward runs
    through ``forward`` (as in :func:`lm_step`), the teacher's through ``model``."""
    with torch.no_grad(), model.disable_focus():
        teacher = model(input_ids=x, use_cache=False).logits.float()
    with model.record_routing() as records:
        out = (forward or model)(input_ids=x, labels=x, use_cache=False)
    log_student = torch.log_softmax(out.logits.float(), dim=-1)
    log_teacher = torch.log_softmax(teacher, dim=-1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).sum(-1).mean()
    loss = weight_kl * kl if weight_lm == 0 else out.loss * weight_lm + weight_kl * kl
    _check_finite(loss, "loss")
    metrics = {"loss": float(loss.detach()), "lm_loss": float(out.loss.detach()),
               "distill_kl": float(kl.detach())}  # fmt: skip
    return StepLoss(loss, metrics, records)


def head_gates_step(model: Any, x: torch.Tensor, gates: Any, penalty: float,
                    forward: Any = None) -> StepLoss:  # fmt: skip
    """``KL(dense || gated) + penalty * mean gate`` on ``x`` (``--method head-gates``): the
    KL of :func:`distill_step` (per token, nats) between the dense model and the Focus model
    whose heads ``gates`` (a :class:`~focus_attention.hf.head_gates.HeadGates`, attached)
    mix with their dense outputs, plus the penalty that pushes the gates to Focus."""
    step = distill_step(model, x, 0.0, 1.0, forward)
    mean = gates.mean()
    loss = step.loss + penalty * mean
    _check_finite(loss, "loss")
    metrics = {**step.metrics, "loss": float(loss.detach()), "gate_mean": float(mean.detach()),
               "gates_open": float((gates.values.detach() > 0.5).float().mean())}  # fmt: skip
    return StepLoss(loss, metrics, step.records)


def coverage_rows(num_queries: int, window: int, count: int, generator: torch.Generator,
                  tail: int = 0) -> torch.Tensor:  # fmt: skip
    """Query indices sampled for the coverage and attention objectives: ``count`` distinct
    queries (all when ``count`` is 0 or too large) among those with keys beyond the window
    (positions ``>= window``), and the last ``tail`` of those as well (a needle prompt's
    question), sorted and distinct; int64 ``[R]``."""
    candidates = torch.arange(min(window, num_queries), num_queries)
    if count == 0 or count >= candidates.numel():
        return candidates
    pick = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
    if tail:
        pick = torch.cat([pick, candidates[-tail:]]).unique()
    return pick.sort().values


def row_weights(rows: torch.Tensor, num_queries: int, tail: int, weight: float) -> torch.Tensor:
    """Weights of the sampled query ``rows`` (int64 ``[R]``, :func:`coverage_rows`) in the
    coverage and attention objectives, float32 ``[R, 1]``: ``weight`` for the last ``tail``
    queries of the block (a needle prompt's question), 1 for the others."""
    question = rows >= num_queries - tail  # none with tail 0: every row is < num_queries
    return torch.where(question, float(weight), 1.0).to(torch.float32)[:, None]


def _dense_records(model: Any, x: torch.Tensor) -> list[dict[str, Any]]:
    """One gradient-free dense forward recording every Focus layer's attention inputs."""
    kwargs: dict[str, Any] = {"input_ids": x, "use_cache": False}
    if "logits_to_keep" in inspect.signature(model.base_model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the logits are not needed
    with torch.no_grad(), model.record_dense_attention() as records:
        model(**kwargs)
    return records


def _layer_coverage(model: Any, rec: dict[str, Any], rows: torch.Tensor,
                    weights: torch.Tensor) -> tuple:  # fmt: skip
    """``(soft share kept with gradient, top-k share kept, distant mass per query, routing
    record)`` of one layer, each query row's distant attention scaled by ``weights``
    (:func:`row_weights`)."""
    cfg = model.focus_config
    router = model.routers[str(rec["layer"])]
    real = rec["key_padding"]
    scores = router.scores(rec["hidden"])
    probs, column_bias = router.soft(scores, cfg.sinkhorn_iters, real)
    router.update_bias(column_bias.detach(), real)
    distant = recorded_distant(rec, cfg.window, rows) * weights
    kept, total = soft_coverage(distant, probs, probs, rows)
    q_groups, k_groups = recorded_groups(router, scores.detach(), cfg.top_k, rec)
    hard_kept, _ = hard_coverage(distant, q_groups, k_groups, rows)
    total = total.clamp_min(torch.finfo(total.dtype).tiny)
    mass = float(total) / max(1, distant.shape[0] * rows.numel())
    record = {"probs": probs.detach(), "query_groups": q_groups, "key_padding": real}
    return kept / total, float(hard_kept / total), mass, record


def _query_key_coverage(model: Any, rec: dict[str, Any], rows: torch.Tensor,
                        weights: torch.Tensor) -> tuple:  # fmt: skip
    """:func:`_layer_coverage` of a query-key router: per key-value head, the distant dense
    attention (the maximum over its query heads) that the query's ``softmax(q_bar . C)``
    and the keys' Sinkhorn-balanced groups keep; folds the keys' mean and column bias into
    the router (:meth:`~focus_attention.hf.query_key.QueryKeyRouter.update_key_mean`)."""
    cfg = model.focus_config
    router = model.routers[str(rec["layer"])]
    real, key = rec["key_padding"], rec["pre_rotary_key"]
    distant = _distant_per_kv_head(rec, cfg.window, rows) * weights  # [B, H_kv, R, N]
    key_scores = router.key_scores(key)  # [B, N, H_kv, K]
    key_probs, column_bias = router.balanced_keys(key_scores, cfg.sinkhorn_iters, real)
    query_scores = router.query_scores(rec["pre_rotary_query"][:, :, rows])  # [B, R, H_kv, K]
    pulled = torch.einsum("bhrn,bnhk->brhk", distant, key_probs)
    kept = (torch.softmax(query_scores, dim=-1) * pulled).sum()
    with torch.no_grad():
        hard_kept = _hard_kept(cfg, key_scores, query_scores, distant)
    router.update_key_mean(key, real, column_bias.detach())
    total = distant.sum().clamp_min(torch.finfo(distant.dtype).tiny)
    mass = float(total) / max(1, distant.shape[0] * distant.shape[1] * rows.numel())
    return kept / total, float(hard_kept / total), mass, None


def _hard_kept(cfg: Any, key_scores: torch.Tensor, query_scores: torch.Tensor,
               distant: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The distant attention ``distant [B, H_kv, R, N]`` that inference's hard groups keep:
    the keys' top ``cfg.top_k`` of ``key_scores [B, N, H_kv, K]``, the queries' top
    ``query_top_k`` of ``query_scores [B, R, H_kv, K]`` (a scalar tensor)."""
    key_groups = head_memberships(key_scores, cfg.top_k)
    query_groups = head_memberships(query_scores, cfg.resolved_query_top_k)
    shared = torch.einsum("brhk,bnhk->bhrn", query_groups.float(), key_groups.float()) > 0
    return (distant * shared).sum()


def coverage_step(model: Any, x: torch.Tensor, queries: int, generator: torch.Generator,
                  tail: int = 0, question_weight: float = 1.0) -> StepLoss:  # fmt: skip
    """Mean over Focus layers of the distant dense attention share that soft routing drops
    (``1 - kept / total``), on ``queries`` sampled queries per layer (and the last ``tail``,
    :func:`coverage_rows`, their attention weighted by ``question_weight``); also folds each
    layer's Sinkhorn column bias into its routing bias, as soft training does. Query-key
    routers score each key-value head's attention with Sinkhorn-balanced key groups
    (:func:`_query_key_coverage`)."""
    records = _dense_records(model, x)
    if not records:
        raise RuntimeError("the coverage objective found no Focus layer call to record")
    rows = coverage_rows(x.shape[1], model.focus_config.window, queries, generator, tail)
    weights = row_weights(rows, x.shape[1], tail, question_weight)
    shares, hard, mass, routing = [], [], [], []
    for rec in records:
        query_key = model.routers[str(rec["layer"])].reads_query_key
        layer = _query_key_coverage if query_key else _layer_coverage
        kept_share, hard_share, distant_mass, record = layer(model, rec, rows, weights)
        shares.append(kept_share)
        hard.append(hard_share)
        mass.append(distant_mass)
        if record is not None:
            routing.append(record)
        del rec["query"], rec["key"]
    loss = 1.0 - torch.stack(shares).mean()
    _check_finite(loss, "coverage loss")
    metrics = {"loss": float(loss.detach()), "coverage_soft": 1.0 - float(loss.detach()),
               "coverage_topk": sum(hard) / len(hard),
               "distant_mass": sum(mass) / len(mass)}  # fmt: skip
    return StepLoss(loss, metrics, routing)


def _distant_per_kv_head(rec: dict[str, Any], window: int, rows: torch.Tensor) -> torch.Tensor:
    """The recorded layer's dense attention to distant keys, float32 ``[B, H_kv, R, N]``:
    the maximum over the query heads sharing each key-value head
    (:func:`~focus_attention.ops.coverage.distant_attention`)."""
    return distant_attention(
        rec["query"],
        rec["key"],
        window,
        scale=rec["scale"],
        softcap=rec["softcap"],
        key_padding_mask=rec["key_padding"],
        always_visible=rec["sinks"],
        rows=rows,
        per_kv_head=True,
    ).float()


def attention_kl(router: Any, rec: dict[str, Any], window: int, rows: torch.Tensor,
                 weights: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """``(mean KL with gradient, queries counted)`` of one recorded layer (a
    :class:`~focus_attention.hf.query_key.QueryKeyRouter` and its
    ``record_dense_attention`` record) on the query indices ``rows`` int64 ``[R]``, the
    mean weighted by ``weights`` float ``[R, 1]`` (:func:`row_weights`; default all 1).

    Target: the dense attention of each query row to its distant keys (``i - j >= window``,
    real, not sinks), the maximum over the query heads sharing a key-value head, summed per
    group with the keys' soft assignment ``softmax((k - key_mean) . C)`` and renormalised
    (``[B, H_kv, R, K]``); prediction: ``softmax(q_bar . C)`` of the pooled pre-rotary
    query. Rows without distant mass do not count."""
    distant = _distant_per_kv_head(rec, window, rows)  # [B, H_kv, R, N]
    soft_keys = torch.softmax(router.key_scores(rec["pre_rotary_key"]), dim=-1)  # [B, N, H_kv, K]
    mass = torch.einsum("bhrn,bnhk->bhrk", distant, soft_keys)
    query_scores = router.query_scores(rec["pre_rotary_query"][:, :, rows])
    return group_kl(mass, query_scores, weights)


def group_kl(mass: torch.Tensor, query_scores: torch.Tensor,
             weights: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """``(weighted mean KL with gradient, rows counted)``: ``KL(target || softmax(scores))``
    per query row, the target each row's attention mass per group ``mass`` float ``[B,
    H_kv, R, K]`` renormalised, the scores ``query_scores`` ``[B, R, H_kv, K]``; the mean
    over the rows with mass, weighted by ``weights`` float ``[R, 1]`` (default all 1)."""
    tiny = torch.finfo(mass.dtype).tiny
    total = mass.sum(-1, keepdim=True)
    valid = total[..., 0] > 0
    target = mass / total.clamp_min(tiny)
    log_router = torch.log_softmax(query_scores, -1).transpose(1, 2)  # [B, H_kv, R, K]
    kl = (target * (torch.log(target.clamp_min(tiny)) - log_router)).sum(-1)
    weight = valid.float() if weights is None else valid * weights[:, 0]
    return (kl * weight).sum() / weight.sum().clamp_min(tiny), int(valid.sum())


def attention_step(model: Any, x: torch.Tensor, queries: int, generator: torch.Generator,
                   tail: int = 0, question_weight: float = 1.0) -> StepLoss:  # fmt: skip
    """Mean over Focus layers of :func:`attention_kl` on ``queries`` sampled queries per
    layer and the last ``tail`` (:func:`coverage_rows`, weighted by ``question_weight``;
    query-key routers, docs/method.md §6); each router then folds the batch's mean
    pre-rotary key into its ``key_mean``."""
    records = _dense_records(model, x)
    if not records:
        raise RuntimeError("the attention objective found no Focus layer call to record")
    rows = coverage_rows(x.shape[1], model.focus_config.window, queries, generator, tail)
    weights = row_weights(rows, x.shape[1], tail, question_weight)
    losses, counted = [], 0
    for rec in records:
        router = model.routers[str(rec["layer"])]
        kl, count = attention_kl(router, rec, model.focus_config.window, rows, weights)
        losses.append(kl)
        counted += count
        router.update_key_mean(rec["pre_rotary_key"], rec["key_padding"])
    loss = torch.stack(losses).mean()
    _check_finite(loss, "attention loss")
    metrics = {"loss": float(loss.detach()), "attention_queries": float(counted)}
    return StepLoss(loss, metrics)


def ranking_kl(model: Any, rec: dict[str, Any], rows: torch.Tensor,
               weights: torch.Tensor) -> tuple:  # fmt: skip
    """``(weighted mean KL with gradient, share of the distant attention the hard groups
    keep)`` of one recorded layer of a query-key router on the query indices ``rows`` int64
    ``[R]``, weighted by ``weights`` float ``[R, 1]`` (:func:`row_weights`).

    Target: each query row's distant dense attention per key-value head (the maximum over
    the query heads sharing it) summed per group through the keys' Sinkhorn-balanced soft
    assignment (``QueryKeyRouter.balanced_keys``) and renormalised, ``[B, H_kv, R, K]``;
    prediction: the query's ``softmax(q_bar . C)``. Rows without distant mass do not count.
    Folds the keys' mean and column bias into the router, as ``coverage`` does."""
    cfg = model.focus_config
    router = model.routers[str(rec["layer"])]
    real, key = rec["key_padding"], rec["pre_rotary_key"]
    distant = _distant_per_kv_head(rec, cfg.window, rows)  # [B, H_kv, R, N]
    key_scores = router.key_scores(key)  # [B, N, H_kv, K]
    key_probs, column_bias = router.balanced_keys(key_scores, cfg.sinkhorn_iters, real)
    mass = torch.einsum("bhrn,bnhk->bhrk", distant, key_probs)
    query_scores = router.query_scores(rec["pre_rotary_query"][:, :, rows])  # [B, R, H_kv, K]
    loss, _ = group_kl(mass, query_scores, weights)
    with torch.no_grad():
        hard_kept = _hard_kept(cfg, key_scores, query_scores, distant)
    router.update_key_mean(key, real, column_bias.detach())
    return loss, float(hard_kept / distant.sum().clamp_min(torch.finfo(distant.dtype).tiny))


def ranking_step(model: Any, x: torch.Tensor, queries: int, generator: torch.Generator,
                 tail: int = 0, question_weight: float = 1.0) -> StepLoss:  # fmt: skip
    """Mean over Focus layers of :func:`ranking_kl` on ``queries`` sampled queries per
    layer and the last ``tail`` (:func:`coverage_rows`, weighted by ``question_weight``);
    query-key routers only.

    Raises:
        RuntimeError: no Focus layer call was recorded, or a non-finite loss.
    """
    records = _dense_records(model, x)
    if not records:
        raise RuntimeError("the ranking objective found no Focus layer call to record")
    rows = coverage_rows(x.shape[1], model.focus_config.window, queries, generator, tail)
    weights = row_weights(rows, x.shape[1], tail, question_weight)
    losses, hard = [], []
    for rec in records:
        kl, kept = ranking_kl(model, rec, rows, weights)
        losses.append(kl)
        hard.append(kept)
        del rec["query"], rec["key"]
    loss = torch.stack(losses).mean()
    _check_finite(loss, "ranking loss")
    metrics = {"loss": float(loss.detach()), "coverage_topk": sum(hard) / len(hard)}
    return StepLoss(loss, metrics)


def objective_loss(model: Any, x: torch.Tensor, cfg: Any, generator: torch.Generator,
                   forward: Any = None) -> StepLoss:  # fmt: skip
    """The loss of ``cfg.objective`` (a :class:`~.config.TrainConfig`) on ``x`` int64
    ``[B, N]``; ``forward`` (default ``model``) runs the forward that carries the gradient
    of ``lm``, ``distill`` and ``mix`` (the coverage and attention objectives score the
    routers directly).

    Raises:
        RuntimeError: a non-finite loss.
    """
    if cfg.objective == "lm":
        return lm_step(model, x, forward)
    if cfg.objective == "distill":
        return distill_step(model, x, 0.0, 1.0, forward)
    if cfg.objective == "mix":
        return distill_step(model, x, 1.0, cfg.distill_weight, forward)
    tail = QUESTION_TOKENS if cfg.retrieval_blocks else 0
    step = {"attention": attention_step, "coverage": coverage_step, "ranking": ranking_step}
    step = step[cfg.objective]
    return step(model, x, cfg.coverage_queries, generator, tail, cfg.question_weight)
