"""Crash-safe writes shared by the package: files replaced atomically, directories built
under a temporary name and renamed into place, and an inter-process lock.

A reader never sees a half-written file or directory: content is written to a temporary
name next to its destination (same file system), flushed to disk, then moved over the
destination with ``os.replace``; on any error the temporary is removed and the destination
is left as it was.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import uuid
import zipfile
import zlib
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


#: a JSON number in a shape (:func:`shape_mismatch`): an int or a float, never a bool
NUMBER = (int, float)
#: what each JSON value is called in a message
_KINDS = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (str, "a string"),
          (list, "a JSON array"), (dict, "a JSON object"), (type(None), "null"))  # fmt: skip


def _kind(value: Any) -> str:
    return next((name for t, name in _KINDS if isinstance(value, t)), type(value).__name__)


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if object in types:
        return True
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _names(types: tuple[type, ...]) -> str:
    names = [name for t, name in _KINDS if t in types]
    return " or ".join(dict.fromkeys(names)) or "/".join(t.__name__ for t in types)


def shape_mismatch(value: Any, shape: Any, where: str = "") -> str | None:
    """Where the parsed JSON ``value`` does not have ``shape``, as a phrase (``"rows[2]: no
    key 'N'"``, ``"config.window is a string, not an integer or a number"``); None when it
    has it.

    A shape is one of:

    - a type or tuple of types: the value's (``bool`` is no ``int`` here, ``float`` takes
      an ``int``, ``type(None)`` allows ``null``, ``object`` anything; :data:`NUMBER` is
      any number);
    - a dict: a JSON object holding at least these keys, each value of its own shape; a
      key written with a trailing ``?`` may be missing (its shape is checked when present);
      the key ``"*"`` gives the shape of every other value of the object, whatever its
      key;
    - a one-item list: a JSON array whose items all have that item's shape.

    Args:
        value: the parsed JSON.
        shape: its expected shape.
        where: the path of ``value`` in its document, for the phrase (``""``: the whole
            document).
    """
    at = where or "the document"
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{at} is {_kind(value)}, not a JSON object"
        if "*" in shape:
            named = {key.removesuffix("?") for key in shape}
            for name, item in value.items():
                if name in named:
                    continue
                found = shape_mismatch(item, shape["*"], f"{where}.{name}" if where else name)
                if found is not None:
                    return found
        for key, inner in shape.items():
            if key == "*":
                continue
            name = key.removesuffix("?")
            if name not in value:
                if key.endswith("?"):
                    continue
                return f"{where}: no key {name!r}" if where else f"no key {name!r}"
            found = shape_mismatch(value[name], inner, f"{where}.{name}" if where else name)
            if found is not None:
                return found
        return None
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{at} is {_kind(value)}, not a JSON array"
        for i, item in enumerate(value):
            found = shape_mismatch(item, shape[0], f"{where}[{i}]")
            if found is not None:
                return found
        return None
    types = shape if isinstance(shape, tuple) else (shape,)
    return None if _is(value, types) else f"{at} is {_kind(value)}, not {_names(types)}"


def check_shape(path: str | os.PathLike[str], value: Any, shape: Any, expected: str) -> None:
    """Check that ``value``, read from the file ``path``, has ``shape``
    (:func:`shape_mismatch`).

    Raises:
        UnreadableFileError: it has not; the message names ``path``, where the document
            differs and ``expected``.
    """
    why = shape_mismatch(value, shape)
    if why is not None:
        raise unreadable(path, why, expected)


def read_json_record(path: str | os.PathLike[str], expected: str, shape: Any = dict) -> Any:
    """The parsed content of the JSON file ``path``, checked to have ``shape``
    (:func:`shape_mismatch`; by default any JSON object).

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: empty, not UTF-8, not valid JSON, a directory, unreadable, or
            without the shape (a JSON array for an object, a missing key, a value of another
            type); the message names the file, what is wrong and ``expected``.
    """
    data = read_json_file(path, expected)
    check_shape(path, data, shape, expected)
    return data


def read_jsonl(path: str | os.PathLike[str], expected: str) -> list[dict[str, Any]]:
    """The JSON objects of the JSON-lines file ``path``, one per line (blank lines
    skipped). A last line without its newline that is not a JSON object, the line a kill
    cut while it was written, is dropped.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: a directory, unreadable, or a line (other than such a last
            one) that is not a JSON object in UTF-8; the message names the file, the line
            and ``expected``.
    """
    lines = read_file_bytes(path, expected).split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError as err:  # not UTF-8, or not JSON
            row, why = None, f"line {number} is not valid JSON ({err})"
        else:
            why = f"line {number} is {_kind(row)}, not a JSON object"
        if isinstance(row, dict):
            rows.append(row)
        elif number < len(lines):  # a whole line: damage, not a cut end
            raise unreadable(path, why, expected)
    return rows


def check_zip_file(path: str | os.PathLike[str], expected: str) -> None:
    """Check that the file ``path`` is a whole zip archive (the format of ``torch.save``):
    its directory readable and every member's data matching its CRC (the file is read
    once, without unpickling anything).

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: a directory, unreadable, empty, truncated or damaged; the
            message names the file and ``expected``.
    """
    path = Path(path)
    if path.is_dir():
        raise unreadable(path, "a directory", expected)
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path} not found; expected {expected}") from err
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError) as err:
        why = "empty file" if path.is_file() and path.stat().st_size == 0 else (
            f"truncated or not a torch.save file ({err})")  # fmt: skip
        raise unreadable(path, why, expected) from err
    if damaged is not None:
        raise unreadable(path, f"its member {damaged} is damaged (CRC mismatch)", expected)


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


class FolderInUseError(RuntimeError):
    """A folder that another process is writing (a second run of the same training,
    study or sweep): the message names the folder, the process that holds it and what it
    runs. A ``RuntimeError``, so the ``focus`` commands report it on one line (exit status
    1)."""


def _lock_holder(fd: int) -> str:
    """The holder a lock file records (:func:`exclusive_lock`), as a phrase."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return (f"process {holder['pid']} on {holder['host']} ({holder['owner']}, since "
                f"{holder['since']})")  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):  # written at this very moment
        return "another process"


def _created_folders(folder: Path) -> list[Path]:
    """The folders ``folder.mkdir(parents=True)`` would create, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _acquire(path: Path, owner: str) -> int:
    """A descriptor of the lock file ``path``, locked (:func:`exclusive_lock`)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise FolderInUseError(
                f"{os.fspath(path.parent)} is in use by {holder}: {owner} would write the same "
                f"files; wait for that run to end (or stop it), or write elsewhere"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # its holder removed it as we opened it
            same = False
        if same:
            return fd
        os.close(fd)  # a file its last holder removed: lock the new one


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike[str], owner: str) -> Iterator[None]:
    """Hold the lock file ``path`` while the block runs, or refuse at once when another
    process (or another run in this one) holds it: so that two runs never write the same
    folder together.

    The file (its missing parent folders created) records the holder: ``owner`` (what it
    runs, such as ``"focus train --out runs/austen"``), its process id, host and start
    time, which a refusal names. It is removed when the block ends, and so are the folders
    created for it if they are left empty; a killed holder leaves it behind, unlocked (the
    operating system drops the lock with the process), and the next run takes it over.
    Where ``fcntl`` is unavailable (Windows) nothing is locked.

    Raises:
        FolderInUseError: another holder; the message names the folder and the holder.
    """
    path = Path(path)
    created = _created_folders(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    try:
        fd = _acquire(path, owner)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        record = {"owner": owner, "pid": os.getpid(), "host": socket.gethostname(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
        yield
    finally:
        path.unlink(missing_ok=True)  # while it is still held: no one else holds this file
        os.close(fd)
        _remove_empty(created)


def _remove_empty(folders: list[Path]) -> None:
    """Remove each of ``folders`` (deepest first) that is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty, or already gone
            return


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
