"""The modes of ``focus bench needle`` beside dense attention: Focus at a ``top_k``, and the
diagnostic modes (:data:`~focus_attention.bench.settings.NEEDLE_DIAGNOSTICS`) that keep the
adapter's window, sinks and dense layers but choose each query's distant keys otherwise, at
the budget of top-k routing (``ceil(k * distant / K)`` keys, K the adapter's ``num_groups``,
k the command's ``diagnostic_top_k``, 1 by default; a mode at k > 1 is named
``oracle/top-k``):

- ``oracle``: each query's ``ceil(k * distant / K)`` distant keys of highest ``q . k``;
- ``kmeans``: the keys of the prompt grouped by k-means into K groups; each query sees the
  k groups whose centroids its ``q . c`` scores highest;
- ``kmeans-fine``: the same with ``4 K`` groups, each query seeing its best ``4 k``.

Per key-value head, with the queries of the heads sharing it pooled by the maximum of their
scores (:mod:`focus_attention.ops.diagnostic`), on the rotary-embedded queries and keys the
attention sees. They run at every call, the prompt's and each generated token's (a KV cache
holds every key so far): the k-means centroids are fitted on the prompt's keys and kept
while decoding, a new key joining the group of its nearest centroid.

Each mode also measures, on the prompt, the share of distant keys its mask keeps (the mean
over the routed layers, their routed heads and the queries that have distant keys) and, per
routed layer, the share of the needle's tokens the prompt's last query sees (the mean over
its routed heads): the layers where a mode loses the needle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..ops import focus_mask
from ..ops.diagnostic import distant_kept_share, group_visibility, kmeans_keys, oracle_visibility
from ..utils.checks import bad

__all__ = [
    "FINE_GROUPS",
    "KMEANS_ITERS",
    "DiagnosticVisibility",
    "Mode",
    "Measure",
    "needle_modes",
    "needle_seen_share",
    "routing_measure",
]

#: Lloyd rounds of the k-means modes
KMEANS_ITERS = 10
#: ``kmeans-fine``: groups per adapter group, and groups each query sees
FINE_GROUPS = 4
#: ``measure(needle_start, needle_end) -> (distant_kept, needle_seen)`` of the last prompt:
#: the share of distant keys kept (None when nothing was measured) and ``{layer: share of
#: the needle's tokens its last query sees}`` (None for dense attention)
Measure = Callable[[int, int], tuple[float | None, dict[int, float] | None]]
#: ``(name, enter)``: ``enter()`` is a context that sets the model up and yields a
#: :data:`Measure` of the prompt answered inside it
Mode = tuple[str, Callable[[], contextlib.AbstractContextManager]]


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def needle_seen_share(mask: torch.Tensor, start: int, end: int) -> float:
    """The share of the keys ``start:end`` (the needle's tokens) that the last query of
    ``mask`` (bool ``[B, Nq, Nk]`` or ``[B, H', Nq, Nk]``) sees, averaged over batch and
    heads; 1.0 for an empty range."""
    if end <= start:
        return 1.0
    return float(mask[..., -1, start:end].double().mean())


def _prompt_masks(records: list[dict[str, Any]], window: int) -> dict[int, tuple[torch.Tensor, dict]]:  # fmt: skip
    """``{layer: (Focus mask, record)}`` of the prompt: the first call of each layer in the
    records of ``FocusModel.record_routing()`` whose queries are its keys."""
    masks = {}
    for r in records:
        if r["layer"] in masks or r["query_groups"].shape[1] != r["num_keys"]:
            continue
        masks[r["layer"]] = (focus_mask(r["query_groups"], r["key_groups"], window, r["key_padding"]), r)  # fmt: skip
    return masks


def routing_measure(records: list[dict[str, Any]], window: int) -> Measure:
    """The :data:`Measure` of a top-k mode, from the records of
    ``FocusModel.record_routing()`` (the prompt's: the first call of each layer, whose
    queries are its keys), each layer's Focus mask built once: the mean over layers of
    :func:`~focus_attention.ops.diagnostic.distant_kept_share` (None without such records)
    and :func:`needle_seen_share` per layer."""

    def measure(start: int, end: int) -> tuple[float | None, dict[int, float] | None]:
        masks = _prompt_masks(records, window)
        kept = [distant_kept_share(mask, window, sinks=r["sinks"], real=r["key_padding"])
                for mask, r in masks.values()]  # fmt: skip
        seen = {layer: needle_seen_share(mask, start, end) for layer, (mask, _) in sorted(masks.items())}  # fmt: skip
        return _mean(kept), seen

    return measure


class DiagnosticVisibility:
    """The visibility function of one diagnostic mode for
    ``FocusModel.override_visibility()``: ``mode`` one of
    :data:`~focus_attention.bench.settings.NEEDLE_DIAGNOSTICS`, ``num_groups`` K, ``window``
    the adapter's, ``seed`` the k-means draw's, ``top_k`` the budget in groups (module
    docstring). A call whose queries are all its keys (a prompt) fits the layer's k-means
    centroids and measures the kept share."""

    def __init__(self, mode: str, num_groups: int, window: int, seed: int, top_k: int = 1) -> None:  # fmt: skip
        self.mode, self.num_groups, self.window, self.seed = mode, num_groups, window, seed
        self.top_k = top_k
        self.centroids: dict[int, torch.Tensor] = {}
        self.shares: dict[int, float | None] = {}
        self.last_rows: dict[int, torch.Tensor] = {}  # the prompt's last query row per layer

    def __call__(self, layer: int, call: Any) -> torch.Tensor:
        """bool ``[B, H_kv, Nq, Nk]`` mask of ``call``'s heads (module docstring)."""
        q, k, prompt = call.query, call.key, call.query.shape[2] == call.key.shape[2]
        sinks, real = call.sinks, call.real
        if self.mode == "oracle":
            mask = oracle_visibility(q, k, self.window, self.num_groups, top_k=self.top_k,
                                     sinks=sinks, real=real)  # fmt: skip
        else:
            fine = self.mode == "kmeans-fine"
            if prompt or layer not in self.centroids:
                groups = min(self.num_groups * (FINE_GROUPS if fine else 1), k.shape[2])
                self.centroids[layer] = kmeans_keys(k, groups, iters=KMEANS_ITERS,
                                                    seed=self.seed, real=real)[1]  # fmt: skip
            top = min(self.top_k * (FINE_GROUPS if fine else 1), self.centroids[layer].shape[2])
            mask = group_visibility(q, k, self.window, self.centroids[layer], top, sinks=sinks,
                                    real=real)  # fmt: skip
        if prompt:
            self.shares[layer] = distant_kept_share(mask, self.window, sinks=sinks, real=real)
            self.last_rows[layer] = mask[:, :, -1:]
        return mask

    def kept_share(self) -> float | None:
        """The mean over layers of the prompt's kept shares (None before a prompt)."""
        return _mean(list(self.shares.values()))

    def measure(self, start: int, end: int) -> tuple[float | None, dict[int, float]]:
        """The :data:`Measure` of the last prompt."""
        seen = {layer: needle_seen_share(row, start, end)
                for layer, row in sorted(self.last_rows.items())}  # fmt: skip
        return self.kept_share(), seen


def needle_modes(fm: Any, top_k: tuple[int, ...], diagnostics: tuple[str, ...], seed: int,
                 dense: bool = True, diagnostic_top_k: int = 1) -> list[Mode]:  # fmt: skip
    """The :data:`Mode` list of ``focus bench needle``: ``dense`` (kept share 1), Focus at
    each ``top_k`` (named ``top-K``, or ``top-K/qQ`` when its queries keep ``Q`` groups),
    then each diagnostic mode at ``diagnostic_top_k`` groups' budget (named as the mode, or
    ``oracle/top-2`` beyond 1; under top-1 routing, whose cache groups they leave unread).

    Raises:
        ValueError: ``diagnostic_top_k`` above the adapter's ``num_groups``.
    """
    groups = fm.focus_config.num_groups
    if diagnostics and diagnostic_top_k > groups:
        raise bad("NeedleBenchConfig", "diagnostic_top_k", diagnostic_top_k,
                  f"at most the adapter's num_groups = {groups}")  # fmt: skip

    def topk(k: int):
        @contextlib.contextmanager
        def enter() -> Iterator[Measure]:
            fm.set_top_k(k)
            with fm.record_routing() as records:
                yield routing_measure(records, fm.focus_config.window)

        return enter

    def diagnostic(mode: str):
        @contextlib.contextmanager
        def enter() -> Iterator[Measure]:
            fm.set_top_k(1)
            config = fm.focus_config
            visibility = DiagnosticVisibility(mode, config.num_groups, config.window, seed,
                                              diagnostic_top_k)  # fmt: skip
            with fm.override_visibility(visibility):
                yield visibility.measure

        return enter

    @contextlib.contextmanager
    def dense_mode() -> Iterator[Measure]:
        with fm.disable_focus():
            yield lambda start, end: (1.0, None)

    def name(k: int) -> str:
        q = fm.focus_config.query_top_k
        return f"top-{k}" if q is None or q == k else f"top-{k}/q{q}"

    suffix = "" if diagnostic_top_k == 1 else f"/top-{diagnostic_top_k}"
    modes = [(name(k), topk(k)) for k in top_k]
    modes += [(m + suffix, diagnostic(m)) for m in diagnostics]
    return [("dense", dense_mode), *modes] if dense else modes
