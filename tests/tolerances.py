"""How close two results must be, by dtype and by what is compared: the one table the tests
take their ``atol``/``rtol`` from (``torch.testing.assert_close(a, b, **tolerance("oracle"))``).

The rule behind it is that of tests/ops/helpers.py: a result is compared with an exact
reference (float64, or written independently of the code under test), and a half-precision
result may be off by at most twice the error of the same computation done in that dtype by
a reference implementation (:func:`ops.helpers.low_precision_bound`): that bound depends on
the inputs, so the half-precision rows here hold only what needs no reference.
"""

from __future__ import annotations

import torch

__all__ = ["DIFFERENT", "TOLERANCE", "tolerance"]

#: ``(atol, rtol)`` by dtype, then by what is compared:
#:
#: - ``"bitwise"``: the same operations in the same order (a reload, a replay, a rerun);
#: - ``"rounding"``: the same sums in another order, or one rounding-level operation against
#:   its float64 value (chunks, splits, a batch against its rows, a resumed run);
#: - ``"reordered"``: the same long sums in another order (over keys, tokens, steps): a few
#:   roundings relative to the values' size;
#: - ``"oracle"``: against an independent reference (the float64 oracle, another backend,
#:   the reference model's logits, decoding through a cache against one forward pass);
#: - ``"log"``: log-domain values against their reference (log-sum-exp, routing scores and
#:   biases), whose size grows with the logits;
#: - ``"gradient"``: gradients, and the weights they train, against the float64 reference or
#:   another order of the same backward pass (relative: they span orders of magnitude);
#: - ``"device"``: the same float32 computation on a CUDA device against the CPU (its
#:   kernels sum in another order and fuse differently).
TOLERANCE: dict[torch.dtype, dict[str, tuple[float, float]]] = {
    torch.float64: {
        "bitwise": (0.0, 0.0),
        "rounding": (1e-12, 0.0),
    },
    torch.float32: {
        "bitwise": (0.0, 0.0),
        "rounding": (1e-6, 0.0),
        "reordered": (1e-6, 1e-5),
        "oracle": (1e-5, 0.0),
        "log": (1e-4, 0.0),
        "gradient": (1e-6, 1e-4),
        "device": (1e-4, 0.0),
    },
    torch.bfloat16: {"bitwise": (0.0, 0.0)},
    torch.float16: {"bitwise": (0.0, 0.0)},
}

#: ``torch.allclose`` keywords of the guards that show an equality check can fail: two
#: results a test expects to differ (e.g. a model with and without a setting) differ by more
#: than this. Not a dtype tolerance: far above float32 rounding, far below a changed result.
DIFFERENT = {"atol": 1e-4, "rtol": 1e-5}


def tolerance(kind: str, dtype: torch.dtype = torch.float32, *, scale: float = 1.0) -> dict:
    """``{"atol": ..., "rtol": ...}`` of :data:`TOLERANCE` for ``kind`` of comparison of
    ``dtype`` results, both multiplied by ``scale`` (a named factor at the call site, for a
    test that keeps a bound of its own, with its reason).

    Raises:
        KeyError: a dtype or kind the table does not hold (half precision: see
            :func:`ops.helpers.low_precision_bound`).
    """
    atol, rtol = TOLERANCE[dtype][kind]
    return {"atol": atol * scale, "rtol": rtol * scale}
