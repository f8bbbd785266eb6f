"""Text corpora for Focus: registered corpora that install offline from Debian packages, any
local text file or folder, and a deterministic train/validation/test split by whole document
(their tokenisation into fixed-length blocks is :mod:`focus_attention.assets.blocks`).

Registered corpora:

* ``austen`` (default): Jane Austen's six novels from the Debian package
  ``r-cran-janeaustenr`` (Project Gutenberg texts with their original line breaks, like
  PG-19). Split by whole book: **test = Persuasion** (the held-out book of the
  README's results), **validation = Northanger Abbey** (the other short, late novel),
  **train = Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma**.
* ``linux-docs``: the Linux kernel documentation reST sources from the Debian package
  ``linux-doc-6.1`` (``usr/share/doc/linux-doc-6.1/html/_sources/**/*.rst.txt``), one document
  per file, split by whole document with the hash-rank rule below (90 % / 5 % / 5 %).

Local corpora:

* a folder: every non-hidden UTF-8 text file below it (recursively) is one document, named by
  its relative path; split with the hash-rank rule. A folder with fewer than 3 documents is
  split like single files, document by document.
* a single file: cut into contiguous parts, the first 90 % of its characters for train, the
  next 5 % for validation and the last 5 % for test; each cut moves forward to the next line
  break so no line is split.

Hash-rank rule: documents are ordered by ``sha256("focus-split:" + name)``; the first
``max(1, round(0.05 n))`` are test, the next ``max(1, round(0.05 n))`` validation, the rest
train. It depends only on the document names, never on their order on disk or on a seed.

Prepared corpora are cached as plain text (one file per document) under
``focus_home()/corpora/<name>/{train,validation,test}/NNNNN.txt`` with a manifest
(``focus-manifest.json``: document names, split rule, source, sha256 of every file) written
last; entries are built in a staging directory and renamed into place, so an interrupted
prepare never leaves a half entry. Local corpora are cached as ``local-<stem>-<hash of the
path>`` and rebuilt when a file's size or modification time changes.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import lzma
import os
import re
import struct
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils.io import focus_home
from .cache import assets_hint, build_entry, debian_tree, dir_size, log, read_manifest

__all__ = [
    "AUSTEN_BOOKS",
    "AUSTEN_SPLIT",
    "CORPORA",
    "DEFAULT_CORPUS",
    "SPLITS",
    "Corpus",
    "CorpusSpec",
    "Document",
    "corpus_dir",
    "list_corpora",
    "load_corpus",
    "prepare_corpus",
    "split_by_hash_rank",
]

#: the corpus used when none is given
DEFAULT_CORPUS = "austen"
#: split names, in this order everywhere
SPLITS = ("train", "validation", "test")
#: fractions of documents (hash-rank rule) or characters (single-file rule) for test/validation
HELD_OUT_FRACTION = 0.05


@dataclass(frozen=True)
class Document:
    """One document of a corpus: ``name`` (title or relative path) and its full ``text``."""

    name: str
    text: str


@dataclass
class Corpus:
    """A prepared corpus.

    Attributes:
        name: registered name or ``local-...`` cache name.
        path: cache directory.
        splits: ``{"train": [...], "validation": [...], "test": [...]}`` of documents.
        split_rule: human-readable description of how documents were assigned to splits.
        source: where the text came from (package and version, or local path).
    """

    name: str
    path: Path
    splits: dict[str, list[Document]]
    split_rule: str
    source: dict[str, Any] = field(default_factory=dict)

    def split(self, split: str) -> list[Document]:
        """Documents of one split. Raises ValueError for an unknown split name."""
        if split not in self.splits:
            raise ValueError(
                f"corpus {self.name!r} has no split {split!r} (has {list(self.splits)})"
            )
        return self.splits[split]

    def texts(self, split: str) -> list[str]:
        """Texts of one split's documents, in the corpus order."""
        return [d.text for d in self.split(split)]

    def num_chars(self, split: str | None = None) -> int:
        """Characters in one split, or in all splits when ``split`` is None."""
        names = SPLITS if split is None else (split,)
        return sum(len(d.text) for s in names for d in self.splits.get(s, []))


@dataclass(frozen=True)
class CorpusSpec:
    """A registered corpus: ``name``, ``description``, Debian ``package``, ``split_rule``."""

    name: str
    description: str
    package: str
    split_rule: str
    license: str = ""


#: R object name in janeaustenr -> (title, year of first publication), publication order
AUSTEN_BOOKS: dict[str, tuple[str, int]] = {
    "sensesensibility": ("Sense and Sensibility", 1811),
    "prideprejudice": ("Pride and Prejudice", 1813),
    "mansfieldpark": ("Mansfield Park", 1814),
    "emma": ("Emma", 1815),
    "northangerabbey": ("Northanger Abbey", 1817),
    "persuasion": ("Persuasion", 1817),
}
#: whole-book split of the six novels: test = Persuasion, validation = Northanger Abbey (the
#: other short, late novel), train = the other four
AUSTEN_SPLIT: dict[str, tuple[str, ...]] = {
    "train": ("Sense and Sensibility", "Pride and Prejudice", "Mansfield Park", "Emma"),
    "validation": ("Northanger Abbey",),
    "test": ("Persuasion",),
}

_HASH_RULE = (
    "by whole document: documents ordered by sha256('focus-split:' + name); the first "
    "max(1, round(0.05 n)) are test, the next max(1, round(0.05 n)) validation, the rest train"
)
_FILE_RULE = (
    "by contiguous parts of each file: first 90% of the characters train, next 5% validation, "
    "last 5% test; each cut moved forward to the next line break"
)

_AUSTEN = CorpusSpec(
    name="austen",
    description="Jane Austen's six novels (Project Gutenberg texts), 717k words",
    package="r-cran-janeaustenr",
    split_rule="by whole book: test = Persuasion, validation = Northanger Abbey, "
    "train = Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma",
    license="public domain texts (package: MIT)",
)
_LINUX_DOCS = CorpusSpec(
    name="linux-docs",
    description="Linux 6.1 kernel documentation, reST sources (~3,180 documents, 3.1M words)",
    package="linux-doc-6.1",
    split_rule=_HASH_RULE,
    license="GPL-2.0",
)
#: the registered corpora by name, in the order ``focus data list`` shows them
CORPORA: dict[str, CorpusSpec] = {spec.name: spec for spec in (_AUSTEN, _LINUX_DOCS)}

_LINUX_DOC_SOURCES = "usr/share/doc/linux-doc-6.1/html/_sources"
_AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data"


def corpus_dir(name: str) -> Path:
    """Cache directory of a corpus (``focus_home()/corpora/<name>``); may not exist."""
    return focus_home() / "corpora" / name


# ---------------------------------------------------------------------------------------------
# split rules
# ---------------------------------------------------------------------------------------------


def split_by_hash_rank(
    names: Sequence[str], held_out_fraction: float = HELD_OUT_FRACTION
) -> dict[str, list[str]]:
    """Assign documents to splits by the hash-rank rule (see the module docstring).

    Args:
        names: unique document names (at least 3).
        held_out_fraction: fraction of documents for test, and again for validation.

    Returns:
        ``{"train": [...], "validation": [...], "test": [...]}``; each list keeps the order of
        ``names``. Deterministic: depends only on the names.

    Raises:
        ValueError: fewer than 3 documents or duplicate names.
    """
    if len(set(names)) != len(names):
        raise ValueError("document names must be unique")
    n = len(names)
    if n < 3:
        raise ValueError(f"the hash-rank split needs at least 3 documents, got {n}")
    n_held = max(1, round(held_out_fraction * n))
    ranked = sorted(names, key=lambda s: hashlib.sha256(f"focus-split:{s}".encode()).hexdigest())
    test, val = set(ranked[:n_held]), set(ranked[n_held : 2 * n_held])
    return {
        "train": [s for s in names if s not in test and s not in val],
        "validation": [s for s in names if s in val],
        "test": [s for s in names if s in test],
    }


def _split_text_contiguous(text: str, held_out_fraction: float = HELD_OUT_FRACTION) -> list[str]:
    """Cut a text into [train, validation, test] parts by the single-file rule."""
    n = len(text)

    def cut(pos: int) -> int:
        nl = text.find("\n", pos)
        return n if nl < 0 else nl + 1

    a = cut(round((1 - 2 * held_out_fraction) * n))
    b = cut(max(a, round((1 - held_out_fraction) * n)))
    return [text[:a], text[a:b], text[b:]]


# ---------------------------------------------------------------------------------------------
# R data of the janeaustenr package
# ---------------------------------------------------------------------------------------------


def _r_lazyload_objects(data_dir: Path) -> dict[str, Any]:
    """Read every object of an R lazy-load database (``Rdata.rdx`` + ``Rdata.rdb``).

    The index is a gzip'd serialized R list whose ``variables`` map names to
    ``(offset, length)`` in the .rdb; each stored object is a 4-byte big-endian uncompressed
    length followed by zlib data (R's ``compress=TRUE``; type-tagged bzip2/xz/none variants
    are handled too) holding a serialized R object, parsed with the ``rdata`` package.
    """
    try:
        import rdata  # optional: the assets extra, needed for the austen corpus only
    except ImportError as e:
        raise RuntimeError(
            f"reading the austen corpus needs the Python package rdata: {assets_hint(['rdata'])}"
        ) from e

    def parse(raw: bytes) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    blob = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        rec = blob[int(offset) : int(offset) + int(length)]
        (size,) = struct.unpack(">I", rec[:4])
        try:
            raw = zlib.decompress(rec[4:])
        except zlib.error:
            kind, body = rec[4:5], rec[5:]
            decoders = {b"Z": lzma.decompress, b"2": bz2.decompress, b"1": zlib.decompress}
            raw = body if kind == b"0" else decoders[kind](body)
        if len(raw) != size:
            raise RuntimeError(f"R object {name}: {len(raw)} bytes, the index says {size}")
        out[str(name)] = parse(raw)
    return out


# ---------------------------------------------------------------------------------------------
# building entries
# ---------------------------------------------------------------------------------------------


def _write_documents(out: Path, splits: dict[str, list[Document]]) -> dict[str, list[dict]]:
    """Write documents as UTF-8 text files; return the manifest's ``splits`` section."""
    section: dict[str, list[dict]] = {}
    for split in SPLITS:
        docs = splits.get(split, [])
        (out / split).mkdir(parents=True, exist_ok=True)
        rows = []
        for i, doc in enumerate(docs):
            rel = f"{split}/{i:05d}.txt"
            (out / rel).write_text(doc.text, encoding="utf-8", newline="")
            rows.append({"name": doc.name, "file": rel, "chars": len(doc.text)})
        section[split] = rows
    return section


def _summary(splits: dict[str, list[Document]]) -> str:
    """One line for the log: documents and words per split."""
    return ", ".join(
        f"{s} {len(splits[s])} docs / {sum(len(d.text.split()) for d in splits[s]) / 1e3:.0f}k words"
        for s in SPLITS
    )


def _build_austen(out: Path, scratch: Path, *, quiet: bool) -> dict[str, Any]:
    """Write the six novels, split by :data:`AUSTEN_SPLIT`; return manifest fields."""
    spec = _AUSTEN
    root, origin = debian_tree(spec.package, _AUSTEN_DATA + "/Rdata.rdb", scratch, quiet=quiet)
    objects = _r_lazyload_objects(root / _AUSTEN_DATA)
    missing = sorted(set(AUSTEN_BOOKS) - set(objects))
    if missing:
        raise RuntimeError(f"{spec.package}: novels missing from the R data: {missing}")
    by_title = {}
    for key, (title, _year) in AUSTEN_BOOKS.items():
        lines = ["" if not isinstance(x, str) else x.rstrip() for x in objects[key]]
        by_title[title] = "\n".join(lines).strip("\n") + "\n"
    splits = {s: [Document(t, by_title[t]) for t in AUSTEN_SPLIT[s]] for s in SPLITS}
    log(f"  {_summary(splits)}", quiet=quiet)
    return {
        "split_rule": spec.split_rule,
        "source": {"debian_package": spec.package, "origin": origin, "license": spec.license},
        "splits": _write_documents(out, splits),
    }


def _build_linux_docs(out: Path, scratch: Path, *, quiet: bool) -> dict[str, Any]:
    """Write the kernel documentation, one document per reST source, split by the hash-rank
    rule; return manifest fields."""
    spec = _LINUX_DOCS
    root, origin = debian_tree(spec.package, _LINUX_DOC_SOURCES, scratch, quiet=quiet)
    base = root / _LINUX_DOC_SOURCES
    files = sorted(p for p in base.rglob("*.rst.txt") if p.is_file())
    docs = {}
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs[p.relative_to(base).as_posix()[: -len(".rst.txt")]] = text
    if len(docs) < 3:
        raise RuntimeError(f"{spec.package}: only {len(docs)} documents under {_LINUX_DOC_SOURCES}")
    assignment = split_by_hash_rank(list(docs))
    splits = {s: [Document(n, docs[n]) for n in assignment[s]] for s in SPLITS}
    log(f"  {_summary(splits)}", quiet=quiet)
    return {
        "split_rule": spec.split_rule,
        "source": {"debian_package": spec.package, "origin": origin, "license": spec.license},
        "splits": _write_documents(out, splits),
    }


#: registered corpus name -> builder ``(out, scratch, *, quiet) -> manifest fields``
_BUILDERS = {_AUSTEN.name: _build_austen, _LINUX_DOCS.name: _build_linux_docs}


def _read_text_file(path: Path) -> str | None:
    """UTF-8 text of a file, or None for binary / non-UTF-8 / empty files."""
    raw = path.read_bytes()
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n") if text.strip() else None


def _local_files(root: Path) -> list[Path]:
    """The file ``root`` itself, or every non-hidden file below the folder ``root``, sorted."""
    if root.is_file():
        return [root]
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def _local_stamp(root: Path) -> str:
    """Hash of the names, sizes and modification times of a local corpus's files."""
    h = hashlib.sha256()
    for p in _local_files(root):
        st = p.stat()
        rel = p.name if root.is_file() else p.relative_to(root).as_posix()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _build_local(root: Path, out: Path, *, quiet: bool) -> dict[str, Any]:
    """Write a local file or folder as a corpus (hash-rank rule from 3 documents, else the
    single-file rule per document); return manifest fields."""
    docs: dict[str, str] = {}
    skipped = []
    for p in _local_files(root):
        rel = p.name if root.is_file() else p.relative_to(root).as_posix()
        text = _read_text_file(p)
        if text is None:
            skipped.append(rel)
        else:
            docs[rel] = text
    if skipped:
        log(
            f"  skipped {len(skipped)} empty, binary or non-UTF-8 file(s): {skipped[:5]}",
            quiet=quiet,
        )
    if not docs:
        raise ValueError(f"{root}: no non-empty UTF-8 text files to use as a corpus")
    if len(docs) >= 3:
        rule = _HASH_RULE
        assignment = split_by_hash_rank(list(docs))
        splits = {s: [Document(n, docs[n]) for n in assignment[s]] for s in SPLITS}
    else:
        rule = _FILE_RULE
        splits = {s: [] for s in SPLITS}
        for name, text in docs.items():
            for s, part in zip(SPLITS, _split_text_contiguous(text), strict=True):
                if part.strip():
                    splits[s].append(Document(name, part))
    empty = [s for s in SPLITS if not splits[s]]
    if empty:
        total = sum(len(t) for t in docs.values())
        raise ValueError(
            f"{root}: too little text to split ({total} characters): the {', '.join(empty)} "
            "split(s) would be empty. Use more text or a folder of at least 3 documents."
        )
    log(f"  {_summary(splits)}", quiet=quiet)
    return {
        "split_rule": rule,
        "source": {"local_path": str(root), "skipped": skipped},
        "splits": _write_documents(out, splits),
    }


def _local_name(root: Path) -> str:
    """Cache name of a local corpus: ``local-<stem>-<first 10 hex of sha256(path)>``."""
    stem = (
        root.name[: -len("".join(root.suffixes))] if root.is_file() and root.suffixes else root.name
    )
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "corpus"
    return f"local-{slug}-{hashlib.sha256(str(root).encode()).hexdigest()[:10]}"


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def _resolve(name_or_path: str | os.PathLike[str]) -> tuple[str, Path | None]:
    """``(cache name, None)`` for a registered corpus, ``(cache name, resolved path)`` for a
    local one. Registered names win over same-named local paths."""
    text = os.fspath(name_or_path)
    if not isinstance(name_or_path, os.PathLike) and text in CORPORA:
        return text, None
    path = Path(text).expanduser()
    if path.exists():
        root = path.resolve()
        return _local_name(root), root
    raise ValueError(
        f"corpus {text!r}: not a registered corpus ({', '.join(CORPORA)}) "
        "and no such local text file or folder"
    )


def prepare_corpus(
    name_or_path: str | os.PathLike[str] = DEFAULT_CORPUS,
    *,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Make a corpus available in the cache and return its directory.

    Args:
        name_or_path: a registered name (``austen``, ``linux-docs``; see ``CORPORA``) or a
            local text file or folder. Registered names take precedence over same-named
            paths (use ``./austen`` for a local folder of that name).
        force: rebuild even when the entry is complete and up to date.
        quiet: no progress messages on stderr.

    Returns:
        ``focus_home()/corpora/<name>``; registered corpora are fetched once from Debian
        (``apt-get download`` + ``dpkg -x``, or the installed package files), local ones are
        rebuilt when their files' sizes or modification times change. Idempotent; a
        complete entry costs one manifest read.

    Raises:
        ValueError: unknown name / missing path, or a local corpus too small to split.
        RuntimeError: apt-get/dpkg missing, the package could not be downloaded, or the
            ``rdata`` module is missing (each message says what to install).
    """
    name, root = _resolve(name_or_path)
    final = corpus_dir(name)
    if root is None:
        builder = _BUILDERS[name]

        def build(out: Path, scratch: Path) -> dict[str, Any]:
            return {"kind": "corpus", "name": name, **builder(out, scratch, quiet=quiet)}

        return build_entry(
            final, f"corpus-{name}", build, force=force, quiet=quiet, label=f"corpus {name}"
        )

    stamp = _local_stamp(root)
    manifest = read_manifest(final, damaged_ok=True)
    if not force and manifest is not None and manifest.get("source", {}).get("stamp") == stamp:
        return final
    log(f"preparing local corpus {root} into {final}", quiet=quiet)

    def build_local(out: Path, scratch: Path) -> dict[str, Any]:
        fields = _build_local(root, out, quiet=quiet)
        fields["source"]["stamp"] = stamp
        return {"kind": "corpus", "name": name, **fields}

    return build_entry(final, f"corpus-{name}", build_local, force=True, quiet=quiet)


def load_corpus(
    name_or_path: str | os.PathLike[str] = DEFAULT_CORPUS, *, quiet: bool = False
) -> Corpus:
    """Prepare (if needed) and read a corpus.

    Args:
        name_or_path: as for :func:`prepare_corpus`.
        quiet: no progress messages.

    Returns:
        A :class:`Corpus` whose ``splits`` map ``train``/``validation``/``test`` to
        :class:`Document` lists (texts as stored, ``\\n`` line ends), with ``split_rule``
        and ``source`` from the manifest.

    Raises:
        ValueError / RuntimeError: as :func:`prepare_corpus`, or when the cache entry is
        damaged (a file listed in the manifest is missing).
    """
    path = prepare_corpus(name_or_path, quiet=quiet)
    manifest = read_manifest(path)
    if manifest is None:  # pragma: no cover - prepare_corpus guarantees it
        raise RuntimeError(f"{path}: incomplete corpus entry")
    splits: dict[str, list[Document]] = {}
    for split in SPLITS:
        docs = []
        for row in manifest["splits"].get(split, []):
            try:
                text = (path / row["file"]).read_text(encoding="utf-8")
            except OSError as e:
                raise RuntimeError(
                    f"{path}: damaged corpus entry ({e}); rebuild it with "
                    f"`focus data prepare --force {os.fspath(name_or_path)}`"
                ) from e
            docs.append(Document(row["name"], text))
        splits[split] = docs
    return Corpus(
        name=manifest["name"],
        path=path,
        splits=splits,
        split_rule=manifest["split_rule"],
        source=manifest.get("source", {}),
    )


def list_corpora() -> list[dict[str, Any]]:
    """One dict per registered corpus: ``name``, ``description``, ``package``,
    ``split_rule``, ``license``, ``default``, ``prepared``, ``path``, ``size_bytes`` and
    ``documents`` (per split; empty when not prepared)."""
    rows = []
    for spec in CORPORA.values():
        path = corpus_dir(spec.name)
        manifest = read_manifest(path)
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "package": spec.package,
                "split_rule": spec.split_rule,
                "license": spec.license,
                "default": spec.name == DEFAULT_CORPUS,
                "prepared": manifest is not None,
                "path": str(path),
                "size_bytes": dir_size(path) if manifest else 0,
                "documents": {s: len(v) for s, v in manifest["splits"].items()} if manifest else {},
            }
        )
    return rows
