"""Crash-safe writes shared by the package: files replaced atomically, directories built
under a temporary name and renamed into place, and an inter-process lock.

A reader never sees a half-written file or directory: content is written to a temporary
name next to its destination (same file system), flushed to disk, then moved over the
destination with ``os.replace``; on any error the temporary is removed and the destination
is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: the settings of the training run that wrote an adapter, saved beside it
TRAIN_CONFIG_NAME = "train_config.json"


def _umask() -> int:
    """The process umask (read from ``/proc`` where possible: setting it to read it back
    is not thread-safe)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], object]) -> None:
    """Create or replace the file ``path`` atomically.

    ``write(tmp)`` writes the content to ``tmp``, a fresh path in the same directory with the
    same suffix (so writers that infer a format from it still work); ``tmp`` is then fsynced
    and renamed to ``path``. The parent directory must exist.

    The file gets the permissions a plain ``open(path, "w")`` would give it: those of the
    file it replaces, or ``0o666`` less the process umask for a new file (whatever mode the
    writer created ``tmp`` with; safetensors, for one, creates ``0o600`` files).

    Raises:
        whatever ``write`` raises (``path`` is then unchanged and ``tmp`` removed).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp{path.suffix}")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:  # a new file
        mode = 0o666 & ~_umask()
    try:
        write(tmp)
        os.chmod(tmp, mode)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Create or replace the text file ``path`` (UTF-8) atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically, creating its parent
    directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive POSIX advisory lock on the file ``path`` (created, with its parent
    directories) for the duration of the block; a no-op where ``fcntl`` is unavailable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def staged_directory(
    final: str | os.PathLike[str], staging_root: str | os.PathLike[str], prefix: str
) -> Iterator[Path]:
    """Build a directory under a temporary name, then rename it to ``final``.

    Yields an empty directory to fill. It lies in a fresh directory
    ``staging_root/<prefix><random>`` that is private to this build (the caller may put
    scratch files next to it, in ``out.parent``) and removed on exit. When the block ends
    normally, an existing ``final`` is moved aside and removed, and the filled directory is
    renamed to ``final``; when it raises, ``final`` is left as it was. ``staging_root`` must
    be on the file system of ``final`` (it is created if needed).
    """
    final = Path(final)
    root = Path(staging_root)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    try:
        out = staging / "entry"
        out.mkdir()
        yield out
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists() or final.is_symlink():  # incomplete, outdated or forced
            os.replace(final, staging / "old")
        os.replace(out, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def focus_home() -> Path:
    """Root of the asset cache.

    Returns:
        ``Path(os.environ["FOCUS_HOME"])`` when set (``~`` expanded), else
        ``~/.cache/focus-attention``. The directory is not created here.
    """
    env = os.environ.get("FOCUS_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "focus-attention"
