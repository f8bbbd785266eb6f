"""Just-in-time build and loading of the ``cpu_fused`` kernel (``csrc/focus_cpu.cpp``).

The kernel is compiled with ``torch.utils.cpp_extension`` (needs a C++ compiler, the Python
headers and ninja) into ``focus_home()/extensions/<key>/``, where ``<key>`` is a digest of
everything that goes into the library (:func:`build_ingredients`: the source's text, the
compiler and its version, the flags, torch's version and C++ ABI, Python's ABI, the CPU), and
loaded from there afterwards. Nothing else selects the folder: another clone of the source, a
virtual environment activated or not, another ninja or working folder load the same library
instead of rebuilding it, while a change of any ingredient builds a library of its own beside
the others.

A build (about a minute) says so on stderr, with its reason, whenever it starts; it runs in a
temporary folder under a lock (another process waits, then loads the result) and the library
is moved into place in one rename, so that no process ever loads a partial file and a loaded
library is never rewritten. Where the kernel cannot be built or loaded, :func:`load` returns
None, says why once (a ``RuntimeWarning``), and ``"auto"`` uses calls of PyTorch's CPU flash
kernel instead: slower, equally exact. ``FOCUS_NO_EXTENSION=1`` skips the build
(docs/method.md §5, "Backends").
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ...utils.io import file_lock, focus_home, write_json_atomic

try:  # the ninja wheel (a dependency): its binary may sit outside PATH
    import ninja  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - ninja from the system instead
    ninja = None

__all__ = [
    "CFLAGS",
    "ExtensionBuildError",
    "LDFLAGS",
    "SOURCE",
    "build_directory",
    "build_ingredients",
    "load",
    "load_library",
    "unavailable_reason",
]

SOURCE = Path(__file__).with_name("csrc") / "focus_cpu.cpp"
#: compiler flags: the kernel is built on the machine that runs it, so -march=native is safe
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
#: linker flags
LDFLAGS = ["-fopenmp"]
#: the record of what a library was built from, beside it in its folder
MANIFEST_NAME = "build.json"
#: the full output of a failed build, in the folder its library would have gone to
ERROR_LOG_NAME = "build-error.log"

_lock = threading.Lock()


class ExtensionBuildError(RuntimeError):
    """A build of a C++ extension failed; the message is its first error and the file
    holding its full output."""


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


def _compiler() -> tuple[str, str]:
    """The C++ compiler torch's builder runs (``$CXX``, else ``c++`` on PATH) as
    ``(resolved path, first line of --version)``; the name as given and ``""`` when it is
    not found (its build then fails and says so)."""
    name = os.environ.get("CXX", "c++")
    found = shutil.which(name)
    if found is None:
        return name, ""
    path = os.path.realpath(found)
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = (done.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        version = ""
    return path, version


def build_ingredients(
    source: Path = SOURCE, cflags: list[str] = CFLAGS, ldflags: list[str] = LDFLAGS
) -> dict[str, Any]:
    """What goes into the library built from ``source`` with ``cflags`` and ``ldflags``,
    and nothing else: the source's SHA-256, the compiler (resolved path and version), the
    flags, torch's version and C++ ABI, Python's extension ABI (``SOABI``), the machine and
    a digest of the CPU's feature flags. Paths of the source, of the virtual environment or
    of ninja are not ingredients (they do not change the library).

    Raises:
        OSError: ``source`` cannot be read.
    """
    compiler, version = _compiler()
    return {
        "source": source.name,
        "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "compiler": compiler,
        "compiler_version": version,
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "torch": torch.__version__,
        "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
        "python": sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag,
        "machine": platform.machine(),
        "cpu_features_sha256": hashlib.sha256(_cpu_features().encode()).hexdigest(),
    }


def _key(ingredients: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()[:16]


def build_directory(
    source: Path = SOURCE, cflags: list[str] = CFLAGS, ldflags: list[str] = LDFLAGS
) -> Path:
    """The folder of the library built from ``source`` (``extensions/<key>`` under
    ``focus_home()``, ``<key>`` the digest of :func:`build_ingredients`)."""
    return focus_home() / "extensions" / _key(build_ingredients(source, cflags, ldflags))


def _stacklevel() -> int:
    """Stack level of the first caller outside this package and torch (the frames of
    ``torch.compiler.disable`` sit between the user and this module)."""
    ours = str(Path(__file__).resolve().parents[2])  # the focus_attention package
    theirs = str(Path(torch.__file__).resolve().parent)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((ours, theirs)):
        frame, level = frame.f_back, level + 1
    return level


def _failure(err: Exception, folder: Path | None) -> str:
    """A one-line reason (the first compiler error if there is one), the full text saved
    to :data:`ERROR_LOG_NAME` in ``folder`` where possible."""
    text = str(err).strip()
    lines = text.splitlines()
    errors = [line.strip() for line in lines if "error" in line.lower()]
    reason = f"{type(err).__name__}: {(errors or lines or ['no message'])[0]}"
    if folder is not None:
        try:
            log = folder / ERROR_LOG_NAME
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


def _why_build(folder: Path, ingredients: dict[str, Any]) -> str:
    """Why the library of ``folder`` is built now: its last build failed, or no library of
    this source was built with these ingredients (naming those that differ from the most
    recent build of the same source file)."""
    if (folder / ERROR_LOG_NAME).exists():
        return f"the last build failed (its output: {folder / ERROR_LOG_NAME})"
    others = []
    for manifest in folder.parent.glob(f"*/{MANIFEST_NAME}"):
        try:
            found = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and found.get("source") == ingredients["source"]:
            others.append((manifest.stat().st_mtime, found))
    if not others:
        return "no library of it was built here yet"
    latest = max(others, key=lambda pair: pair[0])[1]
    changed = sorted(k for k, v in ingredients.items() if latest.get(k) != v)
    return f"the last library here was built with another {', '.join(changed) or 'record'}"


def _import(name: str, path: Path) -> ModuleType:
    """The extension module ``name`` of the library file ``path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as the module {name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, source: Path, folder: Path, cflags: list[str], ldflags: list[str]) -> ModuleType:  # fmt: skip
    """Build ``source`` as the module ``name`` in a temporary folder inside ``folder`` and
    move the library to ``folder/<name>.so`` in one rename; returns the loaded module."""
    # optional: the C++ build tools (torch's builder needs setuptools); the caller turns
    # a failure to import or build into its fall back
    from torch.utils import cpp_extension

    _ensure_ninja()
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(staging),
            verbose=False,
        )
        os.replace(staging / f"{name}.so", folder / f"{name}.so")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return module


def load_library(
    source: Path,
    stem: str,
    cflags: list[str] = CFLAGS,
    ldflags: list[str] = LDFLAGS,
) -> ModuleType:
    """The extension module built from the C++ file ``source`` (named
    ``<stem>_<key>``, its ``TORCH_EXTENSION_NAME``), built first when no library of these
    :func:`build_ingredients` exists (a line on stderr says so, with its reason).

    Raises:
        ExtensionBuildError: the build failed (the message: its first error and the file
            holding its full output, :data:`ERROR_LOG_NAME` of the library's folder).
        Exception: whatever importing a built library raises.
    """
    ingredients = build_ingredients(source, cflags, ldflags)
    key = _key(ingredients)
    folder = focus_home() / "extensions" / key
    name = f"{stem}_{key}"
    library = folder / f"{name}.so"
    if library.is_file():
        return _import(name, library)
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".build.lock"):  # another process building it: wait, then load
        if library.is_file():
            return _import(name, library)
        print(
            f"focus_attention: building the C++ extension {source.name} in {folder}: "
            f"{_why_build(folder, ingredients)} (about a minute, once per compiler, torch "
            "and Python)",
            file=sys.stderr,
            flush=True,
        )
        try:
            module = _build(name, source, folder, cflags, ldflags)
        except Exception as err:
            raise ExtensionBuildError(_failure(err, folder)) from err
        (folder / ERROR_LOG_NAME).unlink(missing_ok=True)
        write_json_atomic(folder / MANIFEST_NAME, ingredients)
        return module


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
                module = load_library(SOURCE, "focus_cpu")
            except Exception as err:  # any build/load failure: fall back, say why once
                reason = str(err) if isinstance(err, ExtensionBuildError) else _failure(err, None)
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
