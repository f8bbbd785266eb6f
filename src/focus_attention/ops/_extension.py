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

from .._files import file_lock, focus_home

SOURCE = Path(__file__).with_name("csrc") / "focus_cpu.cpp"
#: compiler flags: the kernel is built on the machine that runs it, so -march=native is safe
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def build_directory() -> Path:
    """Where the kernel for this source text, torch, Python and machine is built."""
    digest = hashlib.sha256(
        SOURCE.read_bytes()
        + repr((torch.__version__, sys.version, platform.machine(), CFLAGS)).encode()
    ).hexdigest()[:16]
    return focus_home() / "extensions" / digest


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
        no C++ compiler, Python headers or ninja, or the build or load failed, e.g. a torch
        without MKL's ``sgemm_``); the reason is in :func:`unavailable_reason` and was
        warned once.
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
            try:
                from torch.utils import cpp_extension

                _ensure_ninja()
                build = build_directory()
                # torch's builder waits forever on the "lock" file an interrupted build
                # leaves behind; under our own lock no other process is building, so a
                # leftover one is stale and removed
                with file_lock(build / ".focus-build.lock"):
                    (build / "lock").unlink(missing_ok=True)
                    module = cpp_extension.load(
                        name=f"focus_cpu_{build.name}",
                        sources=[str(SOURCE)],
                        extra_cflags=CFLAGS,
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(build),
                        verbose=False,
                    )
            except Exception as err:  # any build/load failure: fall back, say why once
                lines = str(err).strip().splitlines()
                reason = f"{type(err).__name__}: {lines[-1] if lines else 'no message'}"
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
