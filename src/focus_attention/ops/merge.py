"""The log-sum-exp merge of two partial attention results (docs/method.md §5).

Softmax attention over the union of two disjoint key sets ``A`` and ``B`` follows exactly
from the attention over each set alone and each set's log-sum-exp of logits.
"""

from __future__ import annotations

import math

import torch

from .checks import fail

__all__ = ["merge_partials"]


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the attention results of two disjoint key sets into that of their union.

    With ``m = max(lse_a, lse_b)`` (the maximum of *both* parts):

        w_p = exp(lse_p - m)
        out = (w_a out_a + w_b out_b) / (w_a + w_b)
        lse = m + log(w_a + w_b)

    Every exponent is at most 0, so the merge stays exact however far apart the two parts
    are (using the log-sum-exp of one part only overflows float32 once the other exceeds it
    by about 88). A part with no key has ``lse = -inf`` and contributes nothing (its weight
    is exactly 0, so its output must be finite: zeros, as every backend gives); when both
    parts are empty the output is 0 and the log-sum-exp ``-inf`` (never NaN). NaN in a
    non-empty part propagates. Differentiable (the maximum
    ``m`` cancels out of the result and is taken without gradient).

    Args:
        out_a, out_b: ``[..., D]`` outputs of each part, any floating dtype.
        lse_a, lse_b: ``[...]`` (``out``'s shape without ``D``) float32 or float64
            log-sum-exp of each part's logits (natural log; ``-inf`` = no key).

    Returns:
        ``(out [..., D], lse [...])``, both in the log-sum-exp dtype (float32, or float64
        when either ``lse`` is float64).

    Raises:
        ValueError: mismatched shapes, or a log-sum-exp that is not float32 or float64.
    """
    _check_part("a", out_a, lse_a, out_b)
    _check_part("b", out_b, lse_b, out_a)
    ct = torch.promote_types(lse_a.dtype, lse_b.dtype)
    lse_a, lse_b = lse_a.to(ct), lse_b.to(ct)
    peak = torch.maximum(lse_a, lse_b).detach()
    # both empty: any finite peak gives weights exp(-inf) = 0 (a NaN peak stays NaN)
    peak = torch.where(peak == -math.inf, torch.zeros_like(peak), peak)
    w_a, w_b = torch.exp(lse_a - peak), torch.exp(lse_b - peak)  # in [0, 1], one of them 1
    den = w_a + w_b
    empty = den == 0  # both parts empty (False for NaN)
    den = torch.where(empty, torch.ones_like(den), den)
    lse = torch.where(empty, torch.full_like(peak, -math.inf), peak + torch.log(den))
    out = (w_a / den)[..., None] * out_a.to(ct) + (w_b / den)[..., None] * out_b.to(ct)
    return out, lse


def _check_part(name: str, out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor) -> None:
    if lse.dtype not in (torch.float32, torch.float64):
        fail(f"lse_{name}", f"dtype {lse.dtype}", "float32 or float64")
    if out.shape != other.shape or tuple(lse.shape) != tuple(out.shape[:-1]):
        fail(
            f"out_{name}/lse_{name}",
            f"shapes {tuple(out.shape)}/{tuple(lse.shape)}",
            f"[..., D] and [...] matching the other part's {tuple(other.shape)}",
        )
