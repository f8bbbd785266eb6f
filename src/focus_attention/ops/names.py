"""The choices of the ops' settings as plain names, importable without torch (the settings
modules and the command line read them)."""

from __future__ import annotations

#: soft training gates (docs/method.md §4): ``"paper"`` (Eq. 2, multiplicative sigmoid) or
#: ``"log"`` (additive ``log(eps + g_i . g_j)``, whose hard limit is the inference mask)
GATES = ("paper", "log")

#: ``backend=`` values of :func:`~focus_attention.ops.sparse_attention`'s built-in backends,
#: ``"auto"`` first, then ``"auto"``'s order (docs/method.md §5, "Backends"); a backend
#: registered later is valid too. The registry (:func:`~focus_attention.ops.backend_names`)
#: is the source: written out here to stay importable without torch, and checked against
#: the registry by tests/ops/test_sparse_backends.py
SPARSE_BACKENDS = ("auto", "triton", "gather", "masked", "cpu_fused", "cpu_flash", "flex", "math")
