"""The modes of ``focus bench needle`` beside dense attention: Focus at a ``top_k``, and the
diagnostic modes (:data:`~focus_attention.bench.settings.NEEDLE_DIAGNOSTICS`) that keep the
adapter's window, sinks and dense layers but choose each query's distant keys otherwise, at
the budget of top-1 routing (``ceil(distant / K)`` keys, K the adapter's ``num_groups``):

- ``oracle``: each query's ``ceil(distant / K)`` distant keys of highest ``q . k``;
- ``kmeans``: the keys of the prompt grouped by k-means into K groups; each query sees the
  group whose centroid its ``q . c`` scores highest;
- ``kmeans-fine``: the same with ``4 K`` groups, each query seeing its best 4.

Per key-value head, with the queries of the heads sharing it pooled by the maximum of their
scores (:mod:`focus_attention.ops.diagnostic`), on the rotary-embedded queries and keys the
attention sees. They run at every call, the prompt's and each generated token's (a KV cache
holds every key so far): the k-means centroids are fitted on the prompt's keys and kept
while decoding, a new key joining the group of its nearest centroid.

Each mode also measures the share of distant keys its mask keeps on the prompt: the mean
over the routed layers, their routed heads and the queries that have distant keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..ops import focus_mask
from ..ops.diagnostic import distant_kept_share, group_visibility, kmeans_keys, oracle_visibility

__all__ = [
    "FINE_GROUPS",
    "KMEANS_ITERS",
    "DiagnosticVisibility",
    "Mode",
    "needle_modes",
    "routing_kept_share",
]

#: Lloyd rounds of the k-means modes
KMEANS_ITERS = 10
#: ``kmeans-fine``: groups per adapter group, and groups each query sees
FINE_GROUPS = 4
#: ``(name, enter)``: ``enter()`` is a context that sets the model up and yields a function
#: giving the share of distant keys kept on the last prompt (None when nothing was measured)
Mode = tuple[str, Callable[[], contextlib.AbstractContextManager]]


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def routing_kept_share(records: list[dict[str, Any]], window: int) -> float | None:
    """The share of distant keys the Focus mask keeps on the prompt, from the records of
    ``FocusModel.record_routing()`` (the first call of each layer, whose queries are its
    keys): the mean over layers of :func:`~focus_attention.ops.diagnostic.distant_kept_share`;
    None without such records."""
    shares = {}
    for r in records:
        if r["layer"] in shares or r["query_groups"].shape[1] != r["num_keys"]:
            continue
        mask = focus_mask(r["query_groups"], r["key_groups"], window, r["key_padding"])
        shares[r["layer"]] = distant_kept_share(mask, window, sinks=r["sinks"], real=r["key_padding"])  # fmt: skip
    return _mean(list(shares.values()))


class DiagnosticVisibility:
    """The visibility function of one diagnostic mode for
    ``FocusModel.override_visibility()``: ``mode`` one of
    :data:`~focus_attention.bench.settings.NEEDLE_DIAGNOSTICS`, ``num_groups`` K, ``window``
    the adapter's, ``seed`` the k-means draw's. A call whose queries are all its keys (a
    prompt) fits the layer's k-means centroids and measures the kept share."""

    def __init__(self, mode: str, num_groups: int, window: int, seed: int) -> None:
        self.mode, self.num_groups, self.window, self.seed = mode, num_groups, window, seed
        self.centroids: dict[int, torch.Tensor] = {}
        self.shares: dict[int, float | None] = {}

    def __call__(self, layer: int, call: Any) -> torch.Tensor:
        """bool ``[B, H_kv, Nq, Nk]`` mask of ``call``'s heads (module docstring)."""
        q, k, prompt = call.query, call.key, call.query.shape[2] == call.key.shape[2]
        sinks, real = call.sinks, call.real
        if self.mode == "oracle":
            mask = oracle_visibility(q, k, self.window, self.num_groups, sinks=sinks, real=real)
        else:
            fine = self.mode == "kmeans-fine"
            if prompt or layer not in self.centroids:
                groups = min(self.num_groups * (FINE_GROUPS if fine else 1), k.shape[2])
                self.centroids[layer] = kmeans_keys(k, groups, iters=KMEANS_ITERS,
                                                    seed=self.seed, real=real)[1]  # fmt: skip
            top = min(FINE_GROUPS if fine else 1, self.centroids[layer].shape[2])
            mask = group_visibility(q, k, self.window, self.centroids[layer], top, sinks=sinks,
                                    real=real)  # fmt: skip
        if prompt:
            self.shares[layer] = distant_kept_share(mask, self.window, sinks=sinks, real=real)
        return mask

    def kept_share(self) -> float | None:
        """The mean over layers of the prompt's kept shares (None before a prompt)."""
        return _mean(list(self.shares.values()))


def needle_modes(fm: Any, top_k: tuple[int, ...], diagnostics: tuple[str, ...], seed: int,
                 dense: bool = True) -> list[Mode]:  # fmt: skip
    """The :data:`Mode` list of ``focus bench needle``: ``dense`` (kept share 1), Focus at
    each ``top_k`` (named ``top-K``, or ``top-K/qQ`` when its queries keep ``Q`` groups),
    then each diagnostic mode (under top-1 routing, whose cache groups they leave unread)."""

    def topk(k: int):
        @contextlib.contextmanager
        def enter() -> Iterator[Callable[[], float | None]]:
            fm.set_top_k(k)
            with fm.record_routing() as records:
                yield lambda: routing_kept_share(records, fm.focus_config.window)

        return enter

    def diagnostic(mode: str):
        @contextlib.contextmanager
        def enter() -> Iterator[Callable[[], float | None]]:
            fm.set_top_k(1)
            config = fm.focus_config
            visibility = DiagnosticVisibility(mode, config.num_groups, config.window, seed)
            with fm.override_visibility(visibility):
                yield visibility.kept_share

        return enter

    @contextlib.contextmanager
    def dense_mode() -> Iterator[Callable[[], float | None]]:
        with fm.disable_focus():
            yield lambda: 1.0

    def name(k: int) -> str:
        q = fm.focus_config.query_top_k
        return f"top-{k}" if q is None or q == k else f"top-{k}/q{q}"

    modes = [(name(k), topk(k)) for k in top_k] + [(m, diagnostic(m)) for m in diagnostics]
    return [("dense", dense_mode), *modes] if dense else modes
