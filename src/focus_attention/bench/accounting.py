"""What a decoding step must read from device memory, and the time that sets: the floor a
memory-bound step cannot go below, and the ideal speed-up of Focus over dense attention that
follows from the bytes each reads (docs/deploy.md, "Speed on a GPU").

A decoding step reads the model's weights once (every matrix but the input embedding, of
which it reads ``B`` rows; a tied embedding is read as the output projection) and, in every
layer, the cached keys and values it attends: dense attention every cached key; a Focus
layer its window and the keys of its query's groups, listed in its groups' buckets (an
``int32`` position per entry, :data:`BUCKET_INDEX_BYTES`; a key reached through a second
group of the query has its ``int64`` group code read to skip it when an earlier group
already gave it, :data:`GROUP_CODE_BYTES`), and a dense layer or a dense head every key.
Activations, the query and the output are left out (a few hidden vectors per token).

The floor of a step is its bytes over the device's copy bandwidth, measured once per run
(:func:`copy_bandwidth`: a device-to-device copy, read and write bytes over the median time).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .timing import device_synchronize, median_seconds

__all__ = [
    "BUCKET_INDEX_BYTES",
    "GROUP_CODE_BYTES",
    "bucket_entries",
    "copy_bandwidth",
    "crossovers",
    "kv_bytes",
    "routed_reads",
    "step_bytes",
    "visible_keys",
    "weights_bytes",
]

#: bytes of one bucket entry: the ``int32`` position of a key in one of its groups
BUCKET_INDEX_BYTES = 4
#: bytes of one key's group code (``int64``), read for the keys of a query's later groups
GROUP_CODE_BYTES = 8


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters one decoding step reads: every parameter of ``model`` (each
    tied tensor once) but the input embedding table, unless it is tied to the output
    projection (a step reads ``B`` of its rows, left out)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = None
    if embedding is not None and (output is None or output.weight is not embedding.weight):
        skip = embedding.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not skip)


def kv_bytes(batch: int, kv_heads: int, keys: float, head_dim: int, itemsize: int) -> float:
    """Bytes of ``keys`` cached keys and their values, per row, over ``batch`` rows and
    ``kv_heads`` key-value heads of ``head_dim`` values of ``itemsize`` bytes."""
    return 2.0 * batch * kv_heads * keys * head_dim * itemsize


def visible_keys(query_groups: torch.Tensor, key_groups: torch.Tensor, window: int) -> float:
    """Keys the last query sees: bool ``query_groups [K]``, ``key_groups [N, K]`` (the
    query's key last, sinks in every group), or per key-value head ``[H_kv, K]`` and ``[N,
    H_kv, K]`` (query-key routing), averaged over the heads: the last ``window`` keys, and
    before them those sharing a group with the query."""
    n = key_groups.shape[0]
    seen = (key_groups & query_groups).any(dim=-1)  # [N] or [N, H_kv]
    seen[max(0, n - window) :] = True
    return float(seen.sum(dim=0, dtype=torch.float64).mean())


def bucket_entries(query_groups: torch.Tensor, key_groups: torch.Tensor, window: int) -> tuple[int, int]:  # fmt: skip
    """``(entries, later)``: the bucket entries a decoding query reads (the memberships, in
    the query's groups, of the keys older than the window: a key in two of them is listed
    twice) and those of them in a group after the query's first (whose group codes are read
    too); per key-value head memberships sum their heads' entries. Shapes as
    :func:`visible_keys`."""
    older = key_groups[: max(0, key_groups.shape[0] - window)]
    if query_groups.dim() == 1:  # one set of groups for every head
        query_groups, older = query_groups[None], older[:, None]
    entries = later = 0
    for head, groups in enumerate(query_groups):
        per_group = older[:, head, groups].sum(dim=0)
        count = int(per_group.sum())
        entries += count
        later += count - (int(per_group[0]) if per_group.numel() else 0)
    return entries, later


def step_bytes(
    *,
    weights: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    keys_per_layer: Sequence[float],
    entries_per_layer: Sequence[tuple[float, float]] = (),
) -> dict[str, float]:
    """Bytes one decoding step reads (module docstring).

    Args:
        weights: :func:`weights_bytes` of the model.
        batch, kv_heads, head_dim, itemsize: the cache's shape and element size.
        keys_per_layer: per layer, the keys one row reads (a dense layer: every cached key;
            a Focus layer: its visible keys, a dense head's share counting every key).
        entries_per_layer: per Focus layer, ``(entries, later)`` of one row
            (:func:`bucket_entries`); empty for dense attention.

    Returns:
        ``{"weights_bytes", "kv_bytes", "index_bytes", "bytes_read"}`` (floats).
    """
    kv = sum(kv_bytes(batch, kv_heads, keys, head_dim, itemsize) for keys in keys_per_layer)
    index = batch * sum(e * BUCKET_INDEX_BYTES + later * GROUP_CODE_BYTES
                        for e, later in entries_per_layer)  # fmt: skip
    return {"weights_bytes": float(weights), "kv_bytes": kv, "index_bytes": float(index),
            "bytes_read": weights + kv + index}  # fmt: skip


def routed_reads(records: Iterable[dict[str, Any]], window: int, dense_share: dict[int, float]) -> dict[int, dict[str, float]]:  # fmt: skip
    """Per routed layer, what one row of a decoding step reads, averaged over the records
    (:meth:`~focus_attention.hf.FocusModel.record_routing`, one per layer and step) and the
    batch rows: ``{layer: {"keys", "cached", "entries", "later", "share"}}``: the keys read
    (a dense head's share, ``dense_share[layer]`` of the key-value heads, counting every
    key), the keys cached, the bucket entries (:func:`bucket_entries`) and the share of
    the cached keys read."""
    names = ("keys", "cached", "entries", "later", "share")
    sums: dict[int, list[float]] = {}
    for record in records:
        layer, dense = record["layer"], dense_share.get(record["layer"], 0.0)
        n = int(record.get("num_keys") or record["key_groups"].shape[1])
        for q_groups, k_groups in zip(record["query_groups"], record["key_groups"], strict=True):
            q, k = q_groups[-1].cpu(), k_groups[:n].cpu()
            keys = dense * n + (1.0 - dense) * visible_keys(q, k, window)
            entries, later = bucket_entries(q, k, window)
            row = [keys, n, (1.0 - dense) * entries, (1.0 - dense) * later, keys / n, 1.0]
            sums[layer] = [a + b for a, b in zip(sums.get(layer, [0.0] * 6), row, strict=True)]
    return {layer: {name: v / s[-1] for name, v in zip(names, s[:-1], strict=True)}
            for layer, s in sums.items()}  # fmt: skip


def copy_bandwidth(device: str | torch.device, nbytes: int | None = None, repeats: int = 5) -> dict[str, Any]:  # fmt: skip
    """The device's memory bandwidth as a device-to-device copy measures it: ``nbytes``
    (default 1 GiB on CUDA, 64 MiB elsewhere) copied ``repeats`` times after one warm-up
    copy; bytes moved (read + write) over the median seconds.

    Returns:
        ``{"bytes_per_second", "copy_bytes", "seconds", "method"}``.
    """
    device = torch.device(device)
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**26)
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds, _ = median_seconds(lambda: target.copy_(source), repeats,
                                synchronize=device_synchronize(device))  # fmt: skip
    return {"bytes_per_second": 2 * nbytes / seconds, "copy_bytes": nbytes, "seconds": seconds,
            "method": "device-to-device copy_ of copy_bytes: 2 x copy_bytes / median seconds"}  # fmt: skip


def crossovers(rows: list[dict[str, Any]], device_name: str) -> list[dict[str, Any]]:
    """Per level, batch size and top_k of the Focus rows: the smallest cached length from
    which Focus's step is at least as fast as its reference dense step (``reference_seconds``
    of the row) at every longer length measured, or None when it is slower at the longest.

    Returns:
        ``[{"level", "batch_size", "top_k", "crossover_N", "contexts", "device"}]``, the
        contexts being those measured for that group, in order.
    """
    groups: dict[tuple, list[tuple[int, bool]]] = {}
    for row in rows:
        if row["method"] != "focus" or row.get("reference_seconds") is None:
            continue
        key = (row["level"], row.get("batch_size", 1), row["top_k"])
        groups.setdefault(key, []).append((row["N"], row["seconds"] <= row["reference_seconds"]))
    out = []
    for (level, batch, top_k), points in sorted(groups.items(), key=lambda kv: str(kv[0])):
        points.sort()
        found = None
        for n, faster in reversed(points):
            if not faster:
                break
            found = n
        out.append({"level": level, "batch_size": batch, "top_k": top_k, "crossover_N": found,
                    "contexts": [n for n, _ in points], "device": device_name})  # fmt: skip
    return out
