"""Just-in-time build of the fused CPU kernel (``csrc/focus_cpu.cpp``).

The kernel is compiled once per machine, torch version and source text into
``focus_home()/extensions/`` with ``torch.utils.cpp_extension`` (needs a C++ compiler, the
Python headers and ninja) and loaded from there afterwards (~1 minute the first time, then
instant). Where it cannot be built or loaded, :func:`load` returns None, says why once (a
``RuntimeWarning``), and the op uses calls of PyTorch's CPU flash kernel instead: slower,
equally exact. ``FOCUS_NO_EXTENSION=1`` skips the build. Product decision.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .._files import focus_home

SOURCE = Path(__file__).with_name("csrc") / "focus_cpu.cpp"
#: compiler flags: the kernel is built on the machine that runs it, so -march=native is safe
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _build_dir(tag: str) -> Path:
    return focus_home() / "extensions" / tag


def _ensure_ninja() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel may sit beside Python."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def load() -> ModuleType | None:
    """The compiled kernel module, building it on first use; None if unavailable.

    Returns:
        A module with ``focus_forward(...)`` or None (disabled by ``FOCUS_NO_EXTENSION=1``,
        not a Linux/x86-64 or similar platform with a compiler, or the build failed; the
        reason is in :func:`unavailable_reason` and was warned once).
    """
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module, reason = None, None
        if os.environ.get("FOCUS_NO_EXTENSION", "") not in ("", "0"):
            reason = "disabled by FOCUS_NO_EXTENSION"
        elif not SOURCE.exists():
            reason = f"kernel source {SOURCE} is missing from the installation"
        else:
            text = SOURCE.read_bytes()
            digest = hashlib.sha256(
                text + repr((torch.__version__, sys.version, platform.machine(), CFLAGS)).encode()
            ).hexdigest()[:16]
            try:
                from torch.utils import cpp_extension

                _ensure_ninja()
                build = _build_dir(digest)
                build.mkdir(parents=True, exist_ok=True)
                module = cpp_extension.load(
                    name=f"focus_cpu_{digest}",
                    sources=[str(SOURCE)],
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build),
                    verbose=False,
                )
            except Exception as err:  # any build/load failure: fall back, say why once
                reason = f"{type(err).__name__}: {str(err).strip().splitlines()[-1:]}"
                module = None
        if reason is not None:
            warnings.warn(
                f"focus_attention: fused CPU kernel unavailable ({reason}); sparse_attention "
                "uses PyTorch's CPU flash kernel instead (exact, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
        _state["module"], _state["reason"] = module, reason
        return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None if it has not run or the kernel loaded)."""
    return _state.get("reason")  # type: ignore[return-value]
