"""What a result was measured with, without torch: the package's own version, library
versions, the CPU model and the git commit of the code (:mod:`.env` adds the torch side:
threads, the CUDA device and weight digests)."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PACKAGE_VERSION", "RESULT_DISTRIBUTIONS", "cpu_name", "git_commit", "library_versions"]

#: the version of this package (``focus_attention.__version__``)
PACKAGE_VERSION = "0.1.0"
#: distributions whose versions every result file records
RESULT_DISTRIBUTIONS = (
    "focus-attention",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
)


def library_versions(dists: Iterable[str] = RESULT_DISTRIBUTIONS) -> dict[str, str | None]:
    """The Python version and the installed version of each distribution in ``dists``.

    Returns:
        ``{"python": "3.11.7", dist: version or None (not installed), ...}``.
    """
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def cpu_name() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (or what :mod:`platform` knows)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            names = re.findall(r"model name\s*:\s*(.+)", fh.read())
        if names:
            cpu = names[0].strip()
    except OSError:
        pass
    return cpu


def git_commit() -> str | None:
    """HEAD of the git checkout this package runs from, with ``+dirty`` when tracked files
    have uncommitted changes; ``None`` outside a checkout or without git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
