"""CUDA graphs over one decoding step: what a server that captures its steps runs, with the
cost of launching each operation gone (docs/deploy.md, "Speed on a GPU").

:func:`graph_step` captures a call (one step of a model over a static cache, or one attention
call) in a ``torch.cuda.CUDAGraph`` after warm-up calls on a side stream, as PyTorch's
documentation prescribes, and returns the graph's replay. A call that reads a value back to
the host, or whose shapes depend on values, cannot be captured: :func:`capture_refusal`
says why before any capture is tried, from the operations the call dispatched
(:func:`~focus_attention.bench.operations.count_operations`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .operations import count_operations
from .timing import interleaved_median_seconds

__all__ = ["capture_refusal", "graph_step", "timed_steps"]


def capture_refusal(counted: dict[str, Any]) -> str | None:
    """Why a call whose operations were counted (``{"host_syncs", ...}``) cannot be captured
    in a CUDA graph, or None: a call that reads back to the host waits for the device
    inside the capture, which CUDA refuses."""
    syncs = counted.get("host_syncs", 0)
    if syncs:
        return f"not captured: the step reads back to the host {syncs} times"
    return None


def graph_step(call: Callable[[], Any], warmup: int, context: Callable[[], Any] | None = None) -> Callable[[], None]:  # fmt: skip
    """Capture ``call()`` in a CUDA graph and return its replay (a function of no argument).

    ``call`` runs ``max(1, warmup)`` times on a side stream first (lazy initialisations,
    kernel selection and compilation happen there, outside the capture), then once under
    capture, which records its kernels without running them; each replay runs them again
    on the same memory: a step over a static cache advances the cache's length on the
    device at each replay, so the cache needs room for every call. ``context`` (a
    context-manager factory, e.g. a model switched to the row's settings) is entered around
    the warm-up and the capture; the replay needs none.

    Raises:
        RuntimeError: the capture failed (CUDA's or PyTorch's message; the graph is not
            usable).
    """
    enter = context or contextlib.nullcontext
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), enter():
        for _ in range(max(1, warmup)):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with enter(), torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize()
    return graph.replay


def timed_steps(
    calls: dict[str, Callable[[], Any]],
    contexts: dict[str, Callable[[], Any]],
    *,
    steps: int,
    warmup: int,
    graphs: bool,
    refusals: dict[str, str | None] | None = None,
    synchronize: Callable[[], Any] | None = None,
) -> tuple[dict[str, tuple[float, list]], dict[str, dict[str, Any]], dict[str, str | None]]:
    """Count, capture and time the rows of one cell, in turns.

    Each call runs once, eagerly, under :func:`~.operations.count_operations` (inside its
    context); with ``graphs``, each call that neither ``refusals`` (a reason per name, e.g.
    a cache that changes shape) nor its count (:func:`capture_refusal`) rules out is
    captured (:func:`graph_step`), a failed capture leaving it eager with the error as its
    note; then every row is timed in turns
    (:func:`~.timing.interleaved_median_seconds`), graphs as replays.

    Returns:
        ``(timed, counts, notes)``: ``{name: (median seconds, every timing)}``, the
        operation counts of one eager call, and per name None (captured, or ``graphs``
        off) or why the row stayed eager.
    """
    counts = {name: count_operations(call, contexts.get(name)) for name, call in calls.items()}
    timed_calls, notes = dict(calls), {name: None for name in calls}
    if graphs:
        for name, call in calls.items():
            note = (refusals or {}).get(name) or capture_refusal(counts[name])
            if note is None:
                try:
                    timed_calls[name] = graph_step(call, warmup, contexts.get(name))
                except RuntimeError as err:
                    note = f"capture failed: {str(err).strip().splitlines()[0]}"
            notes[name] = note
    timed = interleaved_median_seconds(timed_calls, steps, warmup, contexts, synchronize=synchronize)  # fmt: skip
    return timed, counts, notes
