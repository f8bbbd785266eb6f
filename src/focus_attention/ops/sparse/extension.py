"""Just-in-time build and loading of the ``cpu_fused`` kernel (``csrc/focus_cpu.cpp``).

The kernel is compiled once per install (source path and text), torch version and CPU into
``focus_home()/extensions/`` with ``torch.utils.cpp_extension`` (needs a C++ compiler, the
Python headers and ninja) and loaded from there afterwards (~1 minute the first time, then
instant). Where it cannot be built or loaded, :func:`load` returns None, says why once (a
``RuntimeWarning``), and ``"auto"`` uses calls of PyTorch's CPU flash kernel instead: slower,
equally exact. ``FOCUS_NO_EXTENSION=1`` skips the build (docs/method.md §5, "Backends").
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

from ...utils.io import file_lock, focus_home

try:  # the ninja wheel (a dependency): its binary may sit outside PATH
    import ninja  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - ninja from the system instead
    ninja = None

SOURCE = Path(__file__).with_name("csrc") / "focus_cpu.cpp"
#: compiler flags: the kernel is built on the machine that runs it, so -march=native is safe
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_features() -> str:
    """The CPU's feature flags (``-march=native`` code must not run on another CPU)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_directory() -> Path:
    """Where the kernel is built: one directory per source file (path and text), torch,
    Python, compiler flags and CPU, so that two installs, or two CPUs sharing a home
    directory, never rebuild or load each other's library."""
    key = (
        str(SOURCE.resolve()),
        torch.__version__,
        sys.version,
        platform.machine(),
        _cpu_features(),
        CFLAGS,
    )
    digest = hashlib.sha256(SOURCE.read_bytes() + repr(key).encode()).hexdigest()[:16]
    return focus_home() / "extensions" / digest


def _stacklevel() -> int:
    """Stack level of the first caller outside this package and torch (the frames of
    ``torch.compiler.disable`` sit between the user and this module)."""
    ours = str(Path(__file__).resolve().parents[2])  # the focus_attention package
    theirs = str(Path(torch.__file__).resolve().parent)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((ours, theirs)):
        frame, level = frame.f_back, level + 1
    return level


def _failure(err: Exception, build: Path | None) -> str:
    """A one-line reason (the first compiler error if there is one), the full text saved
    to ``build-error.log`` in the build directory where possible."""
    text = str(err).strip()
    lines = text.splitlines()
    errors = [line.strip() for line in lines if "error" in line.lower()]
    reason = f"{type(err).__name__}: {(errors or lines or ['no message'])[0]}"
    if build is not None:
        try:
            log = build / "build-error.log"
            log.write_text(f"{type(err).__name__}\n{text}\n")
            reason += f"; full output in {log}"
        except OSError:
            pass
    return reason


def _ensure_ninja() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel may sit beside Python."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    if getattr(ninja, "BIN_DIR", None) is not None:
        candidates.insert(0, Path(ninja.BIN_DIR))
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
            build = None
            try:
                # optional: the C++ build tools (torch's builder needs setuptools); any
                # failure to import or build falls back to the flash kernel
                from torch.utils import cpp_extension

                _ensure_ninja()
                build = build_directory()
                name = f"focus_cpu_{build.name}"
                # torch's builder waits forever on the "lock" file an interrupted build
                # leaves behind; under our own lock no other process is building, so a
                # leftover one is stale and removed
                with file_lock(build / ".focus-build.lock"):
                    (build / "lock").unlink(missing_ok=True)
                    if not (build / f"{name}.so").exists():
                        print(
                            f"focus_attention: building the fused CPU kernel in {build} "
                            "(once per install, about a minute)",
                            file=sys.stderr,
                            flush=True,
                        )
                    module = cpp_extension.load(
                        name=name,
                        sources=[str(SOURCE)],
                        extra_cflags=CFLAGS,
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(build),
                        verbose=False,
                    )
            except Exception as err:  # any build/load failure: fall back, say why once
                reason = _failure(err, build if build is not None and build.is_dir() else None)
                module = None
        if reason is not None:
            warnings.warn(
                f"focus_attention: fused CPU kernel unavailable ({reason}); sparse_attention "
                "uses PyTorch's CPU flash kernel instead (exact, slower)",
                RuntimeWarning,
                stacklevel=_stacklevel(),
            )
        _state["module"], _state["reason"] = module, reason
        return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None if it has not run or the kernel loaded)."""
    return _state.get("reason")  # type: ignore[return-value]
