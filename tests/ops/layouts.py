"""The memory layouts real callers hand the attention op, and the check of one backend on one
layout against the float64 oracle (``dense_attention`` under ``focus_mask``), meant to run in
a child process (tests/ops/test_layouts.py): a kernel that writes past its buffers aborts the
child, and the test that launched it fails, not the session.

Each layout builds query, key and value as views of *storage* tensors (the leaves whose
gradients are compared), as a model hands them over:

- ``fused-qkv-split``: GPT-2's ``c_attn(x).split(...)`` of one fused projection ``[B, N,
  (H + 2 H_kv) D]``, each part ``.view(B, N, heads, D).transpose(1, 2)`` (gaps between rows);
- ``transposed``: separate projections ``[B, N, heads, D]`` transposed to ``[B, heads, N, D]``
  (LLaMA's layout: dense, not contiguous);
- ``cache-slice``: keys and values ``cache[:, :, :Nk]`` of a preallocated ``[B, H_kv, C, D]``
  cache (a static cache), a chunk of 6 queries, left padding;
- ``expanded-heads``: one key-value head expanded to every query head (a stride of 0);
- ``expanded-batch``: one row's keys and values shared by the batch (a stride of 0 along B);
- ``one-query``: a decoding step, the query ``[B, 1, H * D]`` viewed as ``[B, H, 1, D]``,
  keys and values slices of a cache;
- ``strided-last-dim``: keys stored ``[B, H_kv, D, N]`` and transposed, values every other
  element of a wider buffer, queries transposed from ``[B, H, D, N]``: no last dimension is
  contiguous, so a kernel that reads rows must copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from focus_attention.ops import dense_attention, focus_mask, sparse_attention

from .helpers import FP32_ATOL, FP32_LSE_ATOL, padding_mask, topk_groups

#: batch, query heads, key-value heads, head size, tokens, groups, top_k, window
B, H, H_KV, D, N, K, TOP_K, WINDOW = 2, 4, 2, 16, 24, 4, 2, 5
#: spare cache slots beyond the keys of the cache layouts
SPARE = 8


@dataclass(frozen=True)
class Layout:
    """Storage shapes, how query/key/value are viewed from them, the number of queries and
    whether the keys carry left padding; ``expect`` checks that the views have the layout's
    property (so that a change of the builders cannot make the grid trivial)."""

    storages: dict[str, tuple[int, ...]]
    views: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    queries: int
    expect: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool]
    padded: bool = False


def _fused(s):
    q, k, v = s["qkv"].split([H * D, H_KV * D, H_KV * D], dim=-1)
    return tuple(x.view(B, N, -1, D).transpose(1, 2) for x in (q, k, v))


def _transposed(s):
    return tuple(s[name].transpose(1, 2) for name in ("q", "k", "v"))


def _cache_slice(s):
    return s["q"].transpose(1, 2), s["k"][:, :, :N], s["v"][:, :, :N]


def _expanded_heads(s):
    return s["q"].transpose(1, 2), s["k"].expand(B, H, N, D), s["v"].expand(B, H, N, D)


def _expanded_batch(s):
    return s["q"].transpose(1, 2), s["k"].expand(B, H_KV, N, D), s["v"].expand(B, H_KV, N, D)


def _one_query(s):
    return s["q"].view(B, 1, H, D).transpose(1, 2), s["k"][:, :, :N], s["v"][:, :, :N]


def _strided(s):
    return s["q"].transpose(-1, -2), s["k"].transpose(-1, -2), s["v"][..., ::2]


def _gapped(*xs: torch.Tensor) -> bool:
    """No tensor is contiguous, nor a permutation of a contiguous buffer (rows with gaps)."""
    return all(not x.is_contiguous() and x.stride(-1) == 1 for x in xs)


LAYOUTS: dict[str, Layout] = {
    "fused-qkv-split": Layout(
        {"qkv": (B, N, (H + 2 * H_KV) * D)}, _fused, N, lambda q, k, v: _gapped(q, k, v)
    ),  # fmt: skip
    "transposed": Layout(
        {"q": (B, N, H, D), "k": (B, N, H_KV, D), "v": (B, N, H_KV, D)},
        _transposed,
        N,
        lambda q, k, v: not q.is_contiguous(),
    ),  # fmt: skip
    "cache-slice": Layout(
        {"q": (B, 6, H, D), "k": (B, H_KV, N + SPARE, D), "v": (B, H_KV, N + SPARE, D)},
        _cache_slice,
        6,
        lambda q, k, v: _gapped(k, v),
        padded=True,
    ),  # fmt: skip
    "expanded-heads": Layout(
        {"q": (B, N, H, D), "k": (B, 1, N, D), "v": (B, 1, N, D)},
        _expanded_heads,
        N,
        lambda q, k, v: k.stride(1) == 0,
    ),  # fmt: skip
    "expanded-batch": Layout(
        {"q": (B, N, H, D), "k": (1, H_KV, N, D), "v": (1, H_KV, N, D)},
        _expanded_batch,
        N,
        lambda q, k, v: k.stride(0) == 0,
    ),  # fmt: skip
    "one-query": Layout(
        {"q": (B, 1, H * D), "k": (B, H_KV, N + SPARE, D), "v": (B, H_KV, N + SPARE, D)},
        _one_query,
        1,
        lambda q, k, v: _gapped(k, v) and q.shape[2] == 1,
    ),  # fmt: skip
    "strided-last-dim": Layout(
        {"q": (B, H, D, N), "k": (B, H_KV, D, N), "v": (B, H_KV, N, 2 * D)},
        _strided,
        N,
        lambda q, k, v: all(x.stride(-1) != 1 for x in (q, k, v)),
    ),  # fmt: skip
}


@dataclass
class _Problem:
    storages: dict[str, torch.Tensor]  # float64, the values every dtype starts from
    query_groups: torch.Tensor
    key_groups: torch.Tensor
    padding: torch.Tensor | None
    cotangent: torch.Tensor  # float64 [B, H, Nq, D]


def _problem(layout: Layout, seed: int = 0) -> _Problem:
    g = torch.Generator().manual_seed(seed)
    storages = {name: torch.randn(*shape, generator=g, dtype=torch.float64)
                for name, shape in layout.storages.items()}  # fmt: skip
    key_groups = topk_groups(g, B, N, K, TOP_K)
    query_groups = key_groups[:, N - layout.queries :].clone()
    padding = padding_mask(g, B, N, "left", [N, N - 7]) if layout.padded else None
    cotangent = torch.randn(B, H, layout.queries, D, generator=g, dtype=torch.float64)
    return _Problem(storages, query_groups, key_groups, padding, cotangent)


def _run(layout: Layout, problem: _Problem, dtype, device, backend: str | None, grad: bool):
    """``(out, lse, storage gradients or None)``: the op on ``backend``, or the float64
    oracle when ``backend`` is None."""
    storages = {n: x.to(device, dtype).requires_grad_(grad) for n, x in problem.storages.items()}
    q, k, v = layout.views(storages)
    qg, kg = problem.query_groups.to(device), problem.key_groups.to(device)
    padding = None if problem.padding is None else problem.padding.to(device)
    with torch.set_grad_enabled(grad):
        if backend is None:
            mask = focus_mask(qg, kg, WINDOW, padding)
            out, lse = dense_attention(q, k, v, mask)
        else:
            assert layout.expect(q, k, v), "the views lack the layout's property"
            out, lse = sparse_attention(q, k, v, qg, kg, WINDOW, key_padding_mask=padding,
                                        backend=backend, return_lse=True)  # fmt: skip
    if not grad:
        return out, lse, None
    loss = (out * problem.cotangent.to(device, out.dtype)).sum()
    grads = torch.autograd.grad(loss, list(storages.values()))
    return out, lse, dict(zip(storages, grads, strict=True))


def check_layout(name: str, backend: str, direction: str, device: str = "cpu") -> list[tuple]:
    """Run ``backend`` on layout ``name`` in float32 (``direction``: ``"forward"`` without
    gradients, ``"backward"`` with them) and compare with the float64 oracle. Returns
    ``(what, error, bound)`` rows: the output and log-sum-exp (max abs error within
    ``FP32_ATOL`` / ``FP32_LSE_ATOL``), and each storage's gradient (within
    ``FP32_ATOL * max(1, max |reference|)``), the ``-inf`` pattern of the log-sum-exp as an
    error of 0 or inf."""
    torch.set_num_threads(1)
    layout = LAYOUTS[name]
    problem = _problem(layout)
    problem.storages = {n: x.float().double() for n, x in problem.storages.items()}
    grad = direction == "backward"
    ref_out, ref_lse, ref_grads = _run(layout, problem, torch.float64, "cpu", None, grad)
    out, lse, grads = _run(layout, problem, torch.float32, device, backend, grad)
    out, lse = out.detach().cpu().double(), lse.detach().cpu().double()
    finite = torch.isfinite(ref_lse)
    same_pattern = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    rows = [("out", _err(out, ref_out), FP32_ATOL),
            ("lse", _err(lse[finite], ref_lse[finite]), FP32_LSE_ATOL),
            ("lse -inf pattern", 0.0 if same_pattern else math.inf, 0.0)]  # fmt: skip
    for storage, ref in (ref_grads or {}).items():
        got = grads[storage].cpu().double()
        rows.append((f"grad {storage}", _err(got, ref), FP32_ATOL * max(1.0, ref.abs().max().item())))  # fmt: skip
    return rows


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` (0 for empty tensors; inf where a value is not finite)."""
    if a.numel() == 0:
        return 0.0
    if not torch.isfinite(a).all():
        return math.inf
    return (a - b).abs().max().item()


def check_every_layout(device: str, backends: tuple[str, ...], differentiable: tuple[str, ...]):
    """:func:`check_layout` for every layout and backend on ``device`` (backward too for the
    ``differentiable`` ones): rows ``(layout, backend, direction, what, error, bound)``."""
    rows = []
    for name in LAYOUTS:
        for backend in backends:
            for direction in ("forward", "backward") if backend in differentiable else ("forward",):
                rows += [(name, backend, direction, *row)
                         for row in check_layout(name, backend, direction, device)]  # fmt: skip
    return rows
