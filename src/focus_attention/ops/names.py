"""The choices of the ops' settings as plain names, importable without torch (the settings
modules and the command line read them)."""

from __future__ import annotations

#: soft training gates (docs/method.md §4): ``"paper"`` (Eq. 2, multiplicative sigmoid) or
#: ``"log"`` (additive ``log(eps + g_i . g_j)``, whose hard limit is the inference mask)
GATES = ("paper", "log")
