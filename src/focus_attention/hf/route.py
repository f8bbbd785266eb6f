"""Which groups a Focus layer's new tokens join: the one routing policy of a Focus-layer call
(docs/method.md §2-§4 and §6).

:func:`route` covers every routing a call can take:

- top-k (inference): causal (each token's own scores plus the calibrated routing bias), the
  paper's sequence-wide Sinkhorn (not causal: no KV cache), or streaming (no key joins a
  group; each query sees its window and the sinks). A token joins its ``top_k`` best groups
  as a key and its ``query_top_k`` best as a query.
- soft (training): Sinkhorn rows gate the distant logits of a dense attention; with
  ``straight_through`` the rows are the causal top-k memberships in value and the Sinkhorn
  rows in gradient. The routing bias folds this batch in once per model call.

Padding tokens join no group; the sinks are added by the cache
(:class:`~focus_attention.hf.focus_cache.FocusCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ops import straight_through, topk_memberships
from .layer_call import LayerCall
from .paged import PagedGroups, soft_routing_error

__all__ = ["Routing", "check_cache_routing", "check_query_key_routing", "route"]


@dataclass(frozen=True)
class Routing:
    """The groups of one call's ``Nq`` new tokens.

    Attributes:
        query_groups: bool ``[B, Nq, K]``, the memberships as queries; None under soft
            routing when nothing reads them (no cache, no recorder).
        key_groups: bool ``[B, Nq, K]``, the memberships as keys (sinks not added), or None
            as ``query_groups``.
        soft_rows: under soft routing, the float32 rows ``(queries, keys)`` ``[B, Nq, K]``
            that gate the attention (Sinkhorn rows, or straight-through ones); None under
            top-k routing.
        probs: under soft routing, the Sinkhorn rows (detached), for the routing record.
        attends_key_groups: whether the attention reads ``key_groups`` (top-k and
            straight-through routing) rather than the Sinkhorn rows (a routing record then
            holds no key groups).
    """

    query_groups: torch.Tensor | None
    key_groups: torch.Tensor | None  # [B, Nq, H_kv, K] both, from a query-key router
    soft_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    probs: torch.Tensor | None = None
    attends_key_groups: bool = True


def route(router: Any, call: LayerCall, config: Any, mode: str, needs_groups: bool) -> Routing:
    """The :class:`Routing` of ``call``'s new tokens by ``router`` under ``config`` (a
    :class:`~focus_attention.hf.config.FocusConfig`) in ``mode`` (``"soft"`` or ``"topk"``);
    ``needs_groups``: whether soft routing must also give hard groups (a cache or a routing
    recorder reads them).

    A query-key router (``router.reads_query_key``) gives memberships per key-value head,
    bool ``[B, Nq, H_kv, K]`` (:meth:`~.query_key.QueryKeyRouter.group_sets`).

    Raises:
        ValueError: soft routing, or ``inference_routing="sequence"``, with a KV cache; what
            a query-key router cannot run (:func:`check_query_key_routing`); NaN
            routing scores where they are checked (:func:`~focus_attention.hf.router.checks_nan`);
            settings straight-through routing cannot run with.
    """
    if router.reads_query_key:
        check_query_key_routing(mode, config)
    if mode == "soft":
        return _soft(router, call, config, needs_groups)
    top_ks = (config.top_k, config.resolved_query_top_k)
    if config.inference_routing == "streaming":
        keys, queries = _streaming_groups(call, router.num_groups)
    elif router.reads_query_key:
        keys, queries = router.group_sets(call.module, call.hidden, top_ks)
    elif config.inference_routing == "sequence":
        keys, queries = _sequence_groups(router, call, config, top_ks)
    else:
        keys, queries = router.topk_group_sets(call.hidden, top_ks)
    return Routing(call.real_only(queries), call.real_only(keys))


def _streaming_groups(call: LayerCall, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key memberships, query memberships)`` bool ``[B, Nq, K]`` of
    ``inference_routing="streaming"``: no key joins a group and every query joins group 0,
    which then holds the sink tokens only (the cache puts them in every group), so a query
    sees its window and the sinks."""
    bsz, nq = call.hidden.shape[:2]
    keys = torch.zeros(bsz, nq, num_groups, dtype=torch.bool, device=call.hidden.device)
    queries = keys.clone()
    queries[..., 0] = True
    return keys, queries


def _sequence_groups(router: Any, call: LayerCall, config: Any, top_ks: tuple[int, int]):
    """``(key memberships, query memberships)`` of the paper's sequence-wide Sinkhorn: the
    top-k of the Sinkhorn rows, which is the top-k of the scores plus the sequence's column
    bias."""
    if call.cache.is_cache:
        raise ValueError("inference_routing='sequence' cannot use a KV cache")
    scores = router.scores(call.hidden)
    _, column_bias = router.soft(scores, config.sinkhorn_iters, call.real_q)
    biased = scores + column_bias[:, None, :]
    groups = {k: topk_memberships(biased, k) for k in set(top_ks)}
    return groups[top_ks[0]], groups[top_ks[1]]


def _soft(router: Any, call: LayerCall, config: Any, needs_groups: bool) -> Routing:
    """Soft Sinkhorn routing (docs/method.md §2-§3, and §6 for straight-through routing)."""
    scores = router.scores(call.hidden)  # [B, Nq, K] fp32
    nq, nk = call.query.shape[2], call.key.shape[2]
    if nk != nq:
        raise ValueError(
            "soft (Sinkhorn) routing normalises over the whole sequence and cannot "
            f"continue from a KV cache holding {nk - nq} tokens; use eval() or "
            "set_routing('topk') to decode"
        )
    probs, column_bias = router.soft(scores, config.sinkhorn_iters, call.real_q)
    bias = _routing_bias_of_call(router, call, column_bias)
    if config.straight_through:  # the hard groups it attends with
        queries, keys = _straight_through_groups(router, scores, bias, config)
        rows = (straight_through(queries, probs), straight_through(keys, probs))
        return Routing(call.real_only(queries), call.real_only(keys), rows, probs.detach())
    if not needs_groups:
        return Routing(None, None, (probs, probs), probs.detach(), False)
    # the causal top-k groups keep a cache consistent should decoding continue in top-k mode
    groups = call.real_only(router.causal_groups(scores.detach(), config.top_k))
    return Routing(groups, groups, (probs, probs), probs.detach(), False)


def _routing_bias_of_call(router: Any, call: LayerCall, column_bias: torch.Tensor):
    """The routing bias ``[K]`` float32 a soft call routes with: in training, the bias before
    this call's batch is folded in (the fold happens here, once per model call); in the
    recomputed forward of activation checkpointing, the same bias the first forward used,
    without folding the batch in again (docs/method.md §6)."""
    if not router.training:
        return router.routing_bias
    saved = call.state.get(router.layer_idx)
    if saved is not None:  # the recomputed forward
        return saved
    bias = router.routing_bias.detach().clone()
    call.state[router.layer_idx] = bias
    router.update_bias(column_bias.detach(), call.real_q)
    return bias


def _straight_through_groups(router: Any, scores: torch.Tensor, bias: torch.Tensor, config):
    """``(query groups, key groups)`` bool ``[B, N, K]`` of straight-through routing
    (docs/method.md §6): the causal top-k memberships of ``scores + bias`` (the routing bias
    before this batch's update), ``query_top_k`` groups for the queries and ``top_k`` for the
    keys.

    Raises:
        ValueError: settings it cannot run with (:meth:`FocusConfig.check_straight_through`).
    """
    config.check_straight_through()
    keys = router.causal_groups(scores.detach(), config.top_k, bias)
    if config.resolved_query_top_k == config.top_k:
        return keys, keys
    return router.causal_groups(scores.detach(), config.resolved_query_top_k, bias), keys


def check_query_key_routing(mode: str, config: Any) -> None:
    """Refuse what query-key routers (``FocusConfig.router_input="query_key"``,
    docs/method.md §4) cannot run: soft routing (they train with ``focus train --objective
    attention`` or ``coverage``), ``inference_routing="sequence"`` and ``dense_heads``.

    Raises:
        ValueError: naming the setting and what to use instead.
    """
    what = None
    if mode == "soft":
        what = ("soft (Sinkhorn) routing: it trains with focus train --objective attention or "
                "coverage; use eval() or set_routing('topk')")  # fmt: skip
    elif config.inference_routing == "sequence":
        what = "inference_routing='sequence' (no Sinkhorn): use 'causal'"
    elif config.dense_heads:
        what = "dense_heads (its groups are per key-value head): use dense_layers"
    if what is not None:
        raise ValueError(f"FocusConfig.router_input='query_key' cannot run {what}")


def check_cache_routing(mode: str, config: Any, cache: Any) -> None:
    """Refuse, before the attention module runs, a routing its KV cache cannot take.

    Raises:
        ValueError: ``inference_routing="sequence"`` (not causal) with a KV cache; soft
            routing filling a static cache or under continuous batching; what query-key
            routers cannot run (:func:`check_query_key_routing`).
    """
    if config.router_input == "query_key":
        check_query_key_routing(mode, config)
    if mode == "topk" and config.inference_routing == "sequence":
        raise ValueError(
            "inference_routing='sequence' (the paper's sequence-wide Sinkhorn) is not causal: "
            "a token's groups depend on later tokens, so it cannot use a KV cache. Call the "
            "model with use_cache=False, or use inference_routing='causal'."
        )
    if mode == "soft" and isinstance(cache, PagedGroups):
        raise soft_routing_error()
    if mode == "soft" and getattr(cache, "static", False):
        raise ValueError(
            "soft (Sinkhorn) routing cannot fill a static KV cache: use eval() or "
            "set_routing('topk') to decode with it"
        )
