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
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

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


def _temporary(path: Path, kind: str = "tmp") -> Path:
    """A fresh name next to ``path`` (same directory, so a rename is atomic) that keeps its
    suffix (so writers that infer a format from it still work)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:12]}.{kind}{path.suffix}")


def _new_file_mode(path: Path) -> int:
    """The permissions a plain ``open(path, "w")`` would give ``path``: those of the file it
    replaces, or ``0o666`` less the process umask for a new file."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:  # a new file
        return 0o666 & ~_umask()


def _write_synced(path: Path, tmp: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)``, then give ``tmp`` the mode of ``path`` and flush it to disk."""
    mode = _new_file_mode(path)
    write(tmp)
    os.chmod(tmp, mode)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_directory(directory: Path) -> None:
    """Flush a directory's entries (its renames) to disk where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse it
        pass
    finally:
        os.close(fd)


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
    atomic_write_files({path: write})


def atomic_write_files(writes: Mapping[str | os.PathLike[str], Callable[[Path], object]]) -> None:
    """Create or replace several files together: every one gets its new content, or none.

    Each ``write(tmp)`` writes one file's content to a temporary name next to it, which is
    fsynced (permissions as :func:`atomic_write` gives them). Only when every file is
    written are the destinations replaced, in the order given, each by one atomic rename;
    the file each rename replaces is kept (hard link, or a copy) until all are in place.
    An error at any step (a writer, a full disk, a rename) puts back every file already
    replaced and removes every temporary, so the destinations are left as they were.

    A crash of the machine between two renames can still leave some files new and some
    old: readers of files that must belong together check that they do (the Focus adapter
    loader compares the config copy inside the weights file with the config file).

    Raises:
        whatever a writer or a rename raises, after the rollback.
    """
    items = [(Path(p), write) for p, write in writes.items()]
    leftovers: list[Path] = []  # temporaries and backups to remove at the end
    replaced: list[tuple[Path, Path | None]] = []  # (destination, backup of its old file)
    try:
        staged = []
        for path, write in items:
            tmp = _temporary(path)
            leftovers.append(tmp)
            _write_synced(path, tmp, write)
            staged.append((path, tmp))
        for path, tmp in staged:
            backup = _keep_old(path)
            if backup is not None:
                leftovers.append(backup)
            os.replace(tmp, path)
            replaced.append((path, backup))
    except BaseException:
        for path, backup in reversed(replaced):
            if backup is None:
                path.unlink(missing_ok=True)
            else:
                os.replace(backup, path)
        raise
    finally:
        for p in leftovers:
            if p.exists():
                p.unlink()
    for parent in {p.parent for p, _ in items}:
        _fsync_directory(parent)


def _keep_old(path: Path) -> Path | None:
    """A second name for the file ``path`` is about to replace (a hard link, or a copy where
    links are not supported); None when there is no such file."""
    if not path.is_file():
        return None
    backup = _temporary(path, "old")
    try:
        os.link(path, backup)
    except OSError:
        shutil.copy2(path, backup)
    return backup


class UnreadableFileError(ValueError):
    """A file that is there but cannot be read as what it should be: empty, truncated,
    garbage, of another format or format version, a directory in its place, or not
    readable by this process. The message names the file and what was expected; it is a
    ``ValueError``, so the ``focus`` commands report it on one line (exit status 1)."""


def unreadable(path: str | os.PathLike[str], why: str, expected: str) -> UnreadableFileError:
    """The :class:`UnreadableFileError` ``"<path>: <why>; expected <expected>"``, on one
    line (runs of whitespace in ``why``, such as a library's multi-line message, become one
    space; a ``why`` longer than 300 characters is cut there)."""
    why = " ".join(why.split())
    why = why if len(why) <= 300 else why[:297] + "..."
    return UnreadableFileError(f"{os.fspath(path)}: {why}; expected {expected}")


def read_file_bytes(path: str | os.PathLike[str], expected: str) -> bytes:
    """The bytes of the file ``path``.

    Args:
        path: the file.
        expected: what it should hold, for the error message (e.g. ``"the JSON results of
            focus eval"``).

    Raises:
        FileNotFoundError: no such file (the message names it).
        UnreadableFileError: a directory in its place, or it cannot be read (permissions,
            an I/O error).
    """
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path} not found; expected {expected}") from err
    except IsADirectoryError as err:
        raise unreadable(path, "a directory", expected) from err
    except OSError as err:
        raise unreadable(path, f"cannot be read ({err.strerror or err})", expected) from err


def read_json_file(path: str | os.PathLike[str], expected: str) -> Any:
    """The parsed content of the UTF-8 JSON file ``path``.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: empty, not UTF-8, not valid JSON (a truncated or garbage file),
            a directory, or unreadable; the message names the file and ``expected``.
    """
    raw = read_file_bytes(path, expected)
    if not raw.strip():
        raise unreadable(path, "empty file", expected)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise unreadable(
            path, f"not UTF-8 text ({err.reason} at byte {err.start})", expected
        ) from err
    except json.JSONDecodeError as err:
        raise unreadable(
            path, f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno})", expected
        ) from err


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Create or replace the text file ``path`` (UTF-8) atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically, creating its parent
    directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _check_writable_place(path: Path, start: Path, name: str, expected: str) -> None:
    """The nearest existing folder at or above ``start`` (``path`` or its parent) is a folder
    that accepts a new file (a probe file is created there and removed).

    Raises:
        ValueError: a file stands there, or no file can be created (permissions, a
            read-only or virtual file system); the message names ``name`` and ``path``.
    """
    folder = start
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{name}: received {os.fspath(path)!r}, but {os.fspath(folder)!r} is "
                         f"a file, not a folder; {expected}")  # fmt: skip
    try:
        fd, probe = tempfile.mkstemp(prefix=".focus-probe-", dir=folder)
    except OSError as err:
        raise ValueError(f"{name}: received {os.fspath(path)!r}, but no file can be created in "
                         f"{os.fspath(folder)!r} ({err.strerror or err}); {expected}, in a "
                         "writable place") from err  # fmt: skip
    os.close(fd)
    os.unlink(probe)


def check_output_file(path: str | os.PathLike[str], name: str) -> Path:
    """Check, before any work, that the file ``path`` can be written (created or replaced,
    its missing parent folders created): so that a long computation is not lost to an
    output path found wrong at its end.

    Args:
        path: the file a command will write.
        name: how the user gave it, for the message (a flag such as ``"--json"``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``path`` is a directory, or a file stands where one of its parent
            folders should be, or the nearest existing folder above it refuses a new file
            (permissions, a read-only or virtual file system); the message names ``name``
            and ``path``.
    """
    path = Path(path)
    expected = "expected the path of a file to write"
    if path.is_dir():
        raise ValueError(f"{name}: received {os.fspath(path)!r}, a directory; {expected}")
    _check_writable_place(path, path.parent, name, expected)
    return path


def check_output_folder(path: str | os.PathLike[str], name: str) -> Path:
    """Check, before any work, that ``path`` can be the folder a command writes its files
    into: an existing folder, or a new one (with its missing parents) under a folder that
    accepts new files.

    Args:
        path: the folder.
        name: how the user gave it, for the message (a flag such as ``"--out"``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``path`` or one of its parents is not a folder (a file, a device such
            as ``/dev/null``), or no file can be created where the folder is or would be
            (permissions, a read-only or virtual file system); the message names ``name``
            and ``path``.
    """
    path = Path(path)
    expected = "expected a folder to write the results into (created when missing)"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}: received {os.fspath(path)!r}, which is not a folder; {expected}")
    _check_writable_place(path, path, name, expected)
    return path


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive POSIX advisory lock on the file ``path`` (created, with its parent
    directories) for the duration of the block; a no-op where ``fcntl`` is unavailable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - Windows
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
    renamed to ``final``; when it raises (or either rename fails), ``final`` is left as it
    was. ``staging_root`` must
    be on the file system of ``final`` (it is created if needed).

    Raises:
        OSError: ``staging_root`` cannot be created or written (the message names
            ``final``; the subclass follows the error number, e.g. ``PermissionError``).
    """
    final = Path(final)
    root = Path(staging_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    except OSError as err:  # name what the caller asked for, not the staging name
        raise OSError(err.errno, f"cannot write {final}: {err.strerror} (in {root})") from err
    try:
        out = staging / "entry"
        out.mkdir()
        yield out
        final.parent.mkdir(parents=True, exist_ok=True)
        _swap_in(out, final, staging / "old")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(new: Path, final: Path, aside: Path) -> None:
    """Rename ``new`` to ``final``, an existing ``final`` first renamed to ``aside``; when
    the second rename fails (or Ctrl-C arrives between the two), ``final`` is put back."""
    moved = final.exists() or final.is_symlink()  # incomplete, outdated or forced
    if moved:
        os.replace(final, aside)
    try:
        os.replace(new, final)
    except BaseException:
        if moved:
            os.replace(aside, final)
        raise


def replace_entries(staged: str | os.PathLike[str], dest: str | os.PathLike[str]) -> list[Path]:
    """Move every entry (file or directory) of the directory ``staged`` into ``dest``,
    replacing entries of the same names, all of them or none.

    Each old entry is renamed aside first and removed only once every new entry is in
    place; an error at any rename puts the old entries back and removes the new ones, so
    ``dest`` holds either all the new entries or its old ones. ``staged`` must be on the file
    system of ``dest`` (a directory inside it, from :func:`staged_directory` or
    :func:`tempfile.mkdtemp`); it is left empty on success.

    Returns:
        the paths of the new entries in ``dest``, in name order.

    Raises:
        whatever a rename raises, after the rollback.
    """
    staged, dest = Path(staged), Path(dest)
    names = sorted(p.name for p in staged.iterdir())
    aside = Path(tempfile.mkdtemp(prefix=".old-", dir=dest))
    moved: list[str] = []  # names whose new entry is in place
    try:
        for name in names:
            if (dest / name).exists() or (dest / name).is_symlink():
                os.replace(dest / name, aside / name)
            os.replace(staged / name, dest / name)
            moved.append(name)
    except BaseException:
        for name in reversed(names):
            if name in moved:
                os.replace(dest / name, staged / name)
            if (aside / name).exists() or (aside / name).is_symlink():
                os.replace(aside / name, dest / name)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_directory(dest)
    return [dest / name for name in names]


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


def read_toml(path: str | os.PathLike[str], kind: str) -> dict[str, Any]:
    """The document of TOML file ``path`` (``tomllib`` on Python 3.11+, ``tomli`` before).

    Args:
        path: the file.
        kind: what the file should be, for the error message (e.g. ``"settings file"``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not valid TOML (the message names the file and ``kind``).
    """
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not a valid TOML {kind} ({err})") from err
