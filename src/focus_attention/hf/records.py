"""What a Focus layer appends to the recorders of ``FocusModel.record_routing()`` and
``FocusModel.record_dense_attention()`` (docs/method.md §7): for inspection, evaluation and
distillation, never read by the layer itself."""

from __future__ import annotations

from typing import Any

import torch

from .layer_call import LayerCall, resolve_call
from .route import Routing

__all__ = ["dense_record", "routing_record"]


def routing_record(layer_idx: int, mode: str, call: LayerCall, routing: Routing) -> dict[str, Any]:  # fmt: skip
    """The record of one routed call: ``layer``, ``mode``, ``probs`` (soft routing), the
    detached ``query_groups`` ``[B, Nq, K]`` and ``key_groups`` ``[B, Nk, K]`` it attended with
    (None under soft routing without straight-through), ``key_padding`` ``[B, Nk]``, ``sinks``
    and ``num_keys``. A static cache's groups are read back from it (records are for
    inspection, not for steps captured in a CUDA graph)."""
    record: dict[str, Any] = {"layer": layer_idx, "mode": mode}
    if routing.probs is not None:
        record["probs"] = routing.probs
    key_groups, padding = None, call.real
    if routing.attends_key_groups:
        key_groups, padding = call.cache.key_groups(call.real)
    record.update(
        query_groups=routing.query_groups.detach(),
        key_groups=None if key_groups is None else key_groups.detach(),
        key_padding=padding,
        sinks=call.sinks,
        num_keys=call.key.shape[2] if key_groups is None else key_groups.shape[1],
    )
    return record


def dense_record(handle: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 attention_mask: Any, scaling: float | None, kwargs: dict, hidden: Any,
                 cache: Any) -> dict[str, Any]:  # fmt: skip
    """The record of one call of ``record_dense_attention()``: the inputs of the layer's
    dense attention (``hidden``, ``query``, ``key`` detached, ``scale``, ``softcap``,
    ``key_padding``, ``sinks``), which the base implementation then runs; for a query-key
    router also ``pre_rotary_query`` ``[B, H, N, D]`` and ``pre_rotary_key``
    ``[B, H_kv, N, D]``, the states it routes by.

    Raises:
        ValueError: a call with a KV cache (the records are of whole sequences); see also
            :func:`~.layer_call.resolve_call`.
    """
    if cache is not None:
        raise ValueError(
            "record_dense_attention() records whole sequences: call the model with "
            "use_cache=False inside it"
        )
    call = resolve_call(handle, module, query, key, key, attention_mask, scaling, kwargs, hidden, None)  # fmt: skip
    record = {}
    if handle.router.reads_query_key:  # a query-key router's inputs
        with torch.no_grad():
            pre_query, pre_key = handle.router.query_key(module, call.hidden)
        record = {"pre_rotary_query": pre_query.detach(), "pre_rotary_key": pre_key.detach()}
    return {
        **record,
        "layer": handle.layer_idx,
        "hidden": call.hidden.detach(),
        "query": call.query.detach(),
        "key": call.key.detach(),
        "scale": call.scale,
        "softcap": call.softcap,
        "key_padding": call.real,
        "sinks": call.sinks,
    }
