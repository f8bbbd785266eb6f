"""Timing and memory measurement shared by the benchmarks. Timings live in benchmarks and
their JSON results, never in pass/fail tests."""

from __future__ import annotations

import contextlib
import gc
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "available_bytes",
    "cuda_peak_extra_bytes",
    "device_synchronize",
    "interleaved_median_seconds",
    "median_seconds",
    "peak_extra_bytes",
    "release_cached_memory",
]


def _no_sync() -> None:
    return None


def device_synchronize(device: Any) -> Callable[[], Any] | None:
    """The ``synchronize`` argument of the timings for calls on ``device`` (a
    ``torch.device`` or its name): ``torch.cuda.synchronize`` on CUDA, so that the device's
    queued work falls inside each timing; None elsewhere."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else None


def median_seconds(
    fn: Callable[[], Any],
    repeats: int,
    warmup: int = 1,
    synchronize: Callable[[], Any] | None = None,
) -> tuple[float, list]:
    """Median wall-clock seconds of ``repeats`` calls after ``warmup`` calls, and every
    timed call's seconds.

    ``synchronize`` (for example ``torch.cuda.synchronize``) is called before the clock
    starts and before it stops, so that asynchronous device work is inside each timing."""
    return interleaved_median_seconds({"call": fn}, repeats, warmup, synchronize=synchronize)["call"]  # fmt: skip


def interleaved_median_seconds(
    calls: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    contexts: dict[str, Callable[[], Any]] | None = None,
    synchronize: Callable[[], Any] | None = None,
) -> dict[str, tuple[float, list]]:
    """:func:`median_seconds` of several calls timed in turns: each of ``warmup + repeats``
    rounds calls every one once, in order, so that a slow spell of a shared machine falls on
    all of them alike rather than on whichever ran then.

    ``contexts`` maps a name to a context-manager factory entered around that call (its
    set-up, outside the clock; e.g. a model switched to the call's settings).
    ``synchronize`` is called as in :func:`median_seconds`.

    Returns:
        ``{name: (median seconds, every timed call's seconds)}``.
    """
    contexts = contexts or {}
    sync = synchronize or _no_sync
    times: dict[str, list] = {name: [] for name in calls}
    for round_ in range(warmup + repeats):
        for name, fn in calls.items():
            with contexts.get(name, contextlib.nullcontext)():
                sync()
                start = time.perf_counter()
                fn()
                sync()
                seconds = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(seconds)
    return {name: (statistics.median(t), t) for name, t in times.items()}


def _status_kib(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), or None."""
    try:
        with open("/proc/self/status") as fh:
            match = re.search(rf"{key}:\s+(\d+)", fh.read())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def peak_extra_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak resident memory (bytes) that one call of ``fn`` adds above the memory held
    before it, on Linux via ``/proc/self/clear_refs`` (resets the peak) and ``VmHWM``;
    ``None`` where that is unavailable. Measures the whole process, whose allocator may
    reuse memory freed earlier: call it in a fresh process
    (:func:`focus_attention.bench.kernel.kernel_peak_memory`)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    if before is None or peak is None:
        return None
    return max(0, peak - before) * 1024


def cuda_peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """Peak CUDA memory (bytes) that one call of ``fn`` allocates above the memory allocated
    before it, from the caching allocator's statistics (``torch.cuda.max_memory_allocated``
    after ``reset_peak_memory_stats``): live tensors, not the allocator's reserve."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return max(0, peak - before)


def available_bytes(device: Any) -> int | None:
    """Memory free for new tensors on ``device``: the CUDA device's free memory, or the
    host's ``MemAvailable``; None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_cached_memory(device: Any) -> None:
    """Give the memory of freed tensors (and CUDA graphs) that the CUDA caching allocator
    keeps back to the device, so that :func:`available_bytes` sees it free; nothing on other
    devices."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
