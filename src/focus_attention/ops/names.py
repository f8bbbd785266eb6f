"""The choices of the ops' settings as plain names, importable without torch (the settings
modules and the command line read them)."""

from __future__ import annotations

#: soft training gates (docs/method.md §4): ``"paper"`` (Eq. 2, multiplicative sigmoid) or
#: ``"log"`` (additive ``log(eps + g_i . g_j)``, whose hard limit is the inference mask)
GATES = ("paper", "log")

#: ``backend=`` values of :func:`~focus_attention.ops.sparse_attention`'s built-in backends,
#: ``"auto"`` first, then ``"auto"``'s order (docs/method.md §5, "Backends"); a backend
#: registered later is valid too
SPARSE_BACKENDS = ("auto", "gather", "masked", "cpu_fused", "cpu_flash", "flex", "math")
