"""Corpora: local folders and files, splits, cache atomicity, CLI; plus checks
of the real prepared corpora (marked ``assets``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from tiny import word_tokenizer
from tiny_assets import WORDS

from focus_attention.assets import cache, corpora
from focus_attention.assets.cache import MANIFEST_NAME, read_manifest, verify_entry
from focus_attention.assets.corpora import (
    AUSTEN_BOOKS,
    AUSTEN_SPLIT,
    CORPORA,
    DEFAULT_CORPUS,
    SPLITS,
    Corpus,
    corpus_dir,
    list_corpora,
    load_corpus,
    prepare_corpus,
    split_by_hash_rank,
)
from focus_attention.cli import data as data_cli
from focus_attention.cli import models as models_cli
from focus_attention.cli import setup as setup_cli
from focus_attention.utils.io import focus_home

requires_rdata = pytest.mark.skipif(
    importlib.util.find_spec("rdata") is None,
    reason="needs rdata, from the assets extra: pip install 'focus-attention[assets]'",
)


def _text(seed: int, n_lines: int, words_per_line: int = 9) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(WORDS), (n_lines, words_per_line), generator=g)
    return "".join(" ".join(WORDS[i] for i in row) + "\n" for row in idx.tolist())


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    for i in range(24):
        d = root / ("sub" if i % 3 == 0 else "")
        (d / f"doc{i:02d}.txt").write_text(_text(i, 5), encoding="utf-8")
    (root / ".hidden.txt").write_text("ignored\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "empty.txt").write_text("  \n")
    return root


def _tokenizer():
    return word_tokenizer(WORDS)


# --------------------------------------------------------------------------------------------
# local corpora
# --------------------------------------------------------------------------------------------


def test_default_corpus_is_registered():
    assert DEFAULT_CORPUS == "austen" and DEFAULT_CORPUS in CORPORA
    assert [r["name"] for r in list_corpora() if r["default"]] == [DEFAULT_CORPUS]


def test_focus_home_env(home):
    assert focus_home() == home


def test_local_folder_corpus(home, folder):
    path = prepare_corpus(folder, quiet=True)
    assert path.parent == home / "corpora" and path.name.startswith("local-docs-")
    corpus = load_corpus(folder, quiet=True)
    assert isinstance(corpus, Corpus) and corpus.path == path
    names = {d.name for s in SPLITS for d in corpus.splits[s]}
    expected = {p.relative_to(folder).as_posix() for p in folder.rglob("doc*.txt")}
    assert names == expected  # hidden, binary and empty files skipped
    assert [len(corpus.splits[s]) for s in SPLITS] == [22, 1, 1]  # 24 docs, 5 % -> 1 each
    assignment = split_by_hash_rank(sorted(expected))
    for s in SPLITS:
        assert sorted(d.name for d in corpus.splits[s]) == sorted(assignment[s])
        for d in corpus.splits[s]:
            assert d.text == (folder / d.name).read_text(encoding="utf-8")
    assert corpus.texts("test") == [d.text for d in corpus.splits["test"]]
    assert "sha256" in corpus.split_rule
    assert set(corpus.source["skipped"]) == {"blob.bin", "empty.txt"}
    assert verify_entry(path, full=True) == []
    with pytest.raises(ValueError, match="no split 'dev'"):
        corpus.split("dev")


def test_hash_rank_split_is_deterministic_and_order_free():
    names = [f"file{i}.rst" for i in range(100)]
    a = split_by_hash_rank(names)
    b = split_by_hash_rank(list(reversed(names)))
    assert {s: sorted(v) for s, v in a.items()} == {s: sorted(v) for s, v in b.items()}
    assert [len(a[s]) for s in SPLITS] == [90, 5, 5]
    assert set(a["train"]) | set(a["validation"]) | set(a["test"]) == set(names)
    assert not set(a["test"]) & set(a["validation"])
    with pytest.raises(ValueError, match="at least 3"):
        split_by_hash_rank(["a", "b"])
    with pytest.raises(ValueError, match="unique"):
        split_by_hash_rank(["a", "a", "b"])


def test_single_file_contiguous_split(home, tmp_path):
    text = _text(7, 400)
    f = tmp_path / "book.txt"
    f.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(f), quiet=True)
    parts = [corpus.splits[s] for s in SPLITS]
    assert all(len(p) == 1 and p[0].name == "book.txt" for p in parts)
    joined = "".join(p[0].text for p in parts)
    assert joined == text  # nothing lost, order kept: train | validation | test
    for p in parts[:2]:
        assert p[0].text.endswith("\n")  # cuts at line breaks
    n, line = len(text), max(map(len, text.splitlines())) + 1
    assert abs(len(parts[0][0].text) - 0.9 * n) < line  # a cut moves to the next line break
    assert abs(len(parts[2][0].text) - 0.05 * n) < line
    assert "contiguous" in corpus.split_rule


def test_small_folder_uses_file_rule(home, tmp_path):
    root = tmp_path / "two"
    root.mkdir()
    (root / "a.txt").write_text(_text(1, 100))
    (root / "b.txt").write_text(_text(2, 100))
    corpus = load_corpus(root, quiet=True)
    assert [sorted(d.name for d in corpus.splits[s]) for s in SPLITS] == [["a.txt", "b.txt"]] * 3


def test_too_small_and_missing_corpora(home, tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("one line only\n")
    with pytest.raises(ValueError, match="too little text"):
        prepare_corpus(f, quiet=True)
    with pytest.raises(ValueError, match="austen, linux-docs"):
        prepare_corpus(tmp_path / "does-not-exist", quiet=True)
    with pytest.raises(ValueError, match="not a registered corpus"):
        load_corpus("no-such-corpus", quiet=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no non-empty UTF-8"):
        prepare_corpus(empty, quiet=True)
    assert not (home / "corpora").exists() or not any((home / "corpora").iterdir())


def test_idempotent_and_rebuilt_on_change(home, folder):
    path = prepare_corpus(folder, quiet=True)
    manifest = path / MANIFEST_NAME
    before = manifest.read_text()
    mtime = manifest.stat().st_mtime_ns
    assert prepare_corpus(folder, quiet=True) == path
    assert manifest.stat().st_mtime_ns == mtime  # nothing rebuilt
    target = folder / "doc05.txt"
    target.write_text("changed text here\n" * 3, encoding="utf-8")
    assert prepare_corpus(folder, quiet=True) == path
    assert manifest.read_text() != before
    docs = {d.name: d.text for s in SPLITS for d in load_corpus(folder, quiet=True).splits[s]}
    assert docs["doc05.txt"] == "changed text here\n" * 3
    # forced rebuild gives the same content
    split_before = json.loads(manifest.read_text())["splits"]
    prepare_corpus(folder, force=True, quiet=True)
    assert json.loads(manifest.read_text())["splits"] == split_before
    assert not any((home / ".staging").iterdir())


def test_failure_mid_prepare_leaves_no_half_entry(home, folder, monkeypatch):
    real = corpora._write_documents

    def broken(out, splits):
        real(out, {"train": splits["train"][:3]})  # some files written ...
        raise OSError("disk full (simulated)")  # ... then the run dies

    monkeypatch.setattr(corpora, "_write_documents", broken)
    with pytest.raises(OSError, match="simulated"):
        prepare_corpus(folder, quiet=True)
    assert not any((home / "corpora").iterdir()) if (home / "corpora").exists() else True
    assert not any((home / ".staging").iterdir())
    monkeypatch.setattr(corpora, "_write_documents", real)
    path = prepare_corpus(folder, quiet=True)
    assert verify_entry(path) == []


def test_killed_run_and_half_entry_are_repaired(home, folder):
    name = corpora._resolve(folder)[0]
    stale = home / ".staging" / f"corpus-{name}.abc123"
    (stale / "entry" / "train").mkdir(parents=True)  # a run killed with SIGKILL
    half = corpus_dir(name)
    (half / "train").mkdir(parents=True)  # a directory without manifest
    (half / "train" / "00000.txt").write_text("partial")
    path = prepare_corpus(folder, quiet=True)
    assert path == half and verify_entry(path, full=True) == []
    assert not stale.exists()
    assert len(load_corpus(folder, quiet=True).splits["train"]) == 22


# --------------------------------------------------------------------------------------------
# registered corpora, offline parts
# --------------------------------------------------------------------------------------------


def _fake_janeaustenr(root: Path) -> dict[str, str]:
    """Write a synthetic R lazy-load database shaped like janeaustenr's."""
    import numpy as np
    import rdata

    def serialise(obj) -> bytes:
        return rdata.unparser.unparse_data(rdata.conversion.convert_python_to_r_data(obj))

    d = root / corpora._AUSTEN_DATA
    d.mkdir(parents=True)
    blob, variables, texts = b"", {}, {}
    for i, (key, (title, _)) in enumerate(AUSTEN_BOOKS.items()):
        lines = [title.upper(), "", "", *_text(i, 20).splitlines(), "", ""]
        raw = serialise(np.array(lines, dtype=object))
        rec = struct.pack(">I", len(raw)) + zlib.compress(raw)
        variables[key] = np.array([len(blob), len(rec)], dtype=np.int32)
        blob += rec
        texts[title] = "\n".join(lines).strip("\n") + "\n"
    (d / "Rdata.rdb").write_bytes(blob)
    index = {"variables": variables, "references": {}, "compressed": np.array([True])}
    import gzip

    (d / "Rdata.rdx").write_bytes(gzip.compress(serialise(index)))
    return texts


@requires_rdata
def test_austen_builder_on_synthetic_r_data(home, tmp_path, monkeypatch):
    root = tmp_path / "deb-root"
    texts = _fake_janeaustenr(root)
    monkeypatch.setattr(corpora, "debian_tree", lambda *a, **k: (root, "fake.deb"))
    corpus = load_corpus("austen", quiet=True)
    assert {s: tuple(d.name for d in corpus.splits[s]) for s in SPLITS} == AUSTEN_SPLIT
    for s in SPLITS:
        for d in corpus.splits[s]:
            assert d.text == texts[d.name]
    assert corpus.split_rule.startswith("by whole book: test = Persuasion")
    assert corpus.source["debian_package"] == "r-cran-janeaustenr"
    row = next(r for r in list_corpora() if r["name"] == "austen")
    assert row["prepared"] and row["documents"] == {"train": 4, "validation": 1, "test": 1}


def test_missing_tools_and_modules_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(cache.shutil, "which", lambda tool: None)
    with pytest.raises(RuntimeError, match=r"Debian package r-cran-janeaustenr.*apt-get"):
        cache.debian_tree("r-cran-janeaustenr", "no/such/path", tmp_path, quiet=True)
    monkeypatch.setitem(__import__("sys").modules, "rdata", None)
    with pytest.raises(RuntimeError, match=r"rdata.*pip install 'focus-attention\[assets\]'"):
        corpora._r_lazyload_objects(tmp_path)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="focus")
    sub = p.add_subparsers(dest="command")
    for module in (data_cli, setup_cli, models_cli):
        module.register_cli(sub)
    return p


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


def test_cli_data_and_setup(home, folder, tmp_path, capsys):
    assert _run(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "austen" in out and "linux-docs" in out and "Persuasion" in out
    assert _run(["data", "prepare", str(folder)]) == 0
    assert "local-docs-" in capsys.readouterr().out
    assert _run(["data", "prepare", str(tmp_path / "missing")]) == 1
    assert "not a registered corpus" in capsys.readouterr().err
    model_dir = tmp_path / "some-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert _run(["setup", "--model", str(model_dir), "--corpus", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "summary" in out and str(model_dir) in out


# --------------------------------------------------------------------------------------------
# real assets (prepared by `focus setup` / `focus data prepare linux-docs`)
# --------------------------------------------------------------------------------------------


def _require(name: str) -> None:
    if read_manifest(corpus_dir(name)) is None:
        pytest.skip(
            f"corpus {name!r} is not prepared in {focus_home()}: run `focus data prepare {name}`"
        )


@pytest.mark.assets
def test_real_austen_splits():
    _require("austen")
    corpus = load_corpus("austen", quiet=True)
    assert {s: tuple(d.name for d in corpus.splits[s]) for s in SPLITS} == AUSTEN_SPLIT
    words = {d.name: len(d.text.split()) for s in SPLITS for d in corpus.splits[s]}
    assert 700_000 < sum(words.values()) < 740_000
    assert 75_000 < words["Persuasion"] < 90_000
    assert corpus.splits["test"][0].text.startswith("Persuasion")
    assert "Anne Elliot" in corpus.splits["test"][0].text
    assert "Catherine Morland" in corpus.splits["validation"][0].text
    assert verify_entry(corpus.path) == []


@pytest.mark.assets
def test_real_linux_docs_splits():
    _require("linux-docs")
    corpus = load_corpus("linux-docs", quiet=True)
    names = [d.name for s in SPLITS for d in corpus.splits[s]]
    assert len(names) > 3000
    assignment = split_by_hash_rank(names)
    assert {s: sorted(d.name for d in corpus.splits[s]) for s in SPLITS} == {
        s: sorted(v) for s, v in assignment.items()
    }
    assert verify_entry(corpus.path) == []
