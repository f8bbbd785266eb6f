"""The crash-safe write helpers shared by models, data, train, bench and the adapter."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from focus_attention.utils.checks import check_int, check_number
from focus_attention.utils.io import atomic_write, file_lock, staged_directory, write_json_atomic


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    write_json_atomic(tmp_path / "sub" / "b.json", {"x": 1})
    assert (tmp_path / "sub" / "b.json").read_text() == '{\n  "x": 1\n}\n'


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_atomic_write_honours_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        # safetensors creates its files 0o600; torch.save and write_text follow the umask
        atomic_write(tmp_path / "w.safetensors", lambda p: save_file({"a": torch.ones(2)}, str(p)))
        atomic_write(tmp_path / "s.pt", lambda p: torch.save({"a": 1}, p))
        write_json_atomic(tmp_path / "c.json", {"x": 1})
    finally:
        os.umask(previous)
    for name in ("w.safetensors", "s.pt", "c.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    # replacing a file keeps its permissions, as open(path, "w") does
    (tmp_path / "w.safetensors").chmod(0o640)
    atomic_write(tmp_path / "w.safetensors", lambda p: save_file({"a": torch.ones(3)}, str(p)))
    assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == 0o640


def test_staged_directory_replaces_or_keeps_the_destination(tmp_path):
    final, staging = tmp_path / "entry", tmp_path / ".staging"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_directory(final, staging, "e.") as out:
        (out / "new.txt").write_text("half")
        raise RuntimeError
    assert [p.name for p in final.iterdir()] == ["old.txt"]
    with staged_directory(final, staging, "e.") as out:
        (out / "new.txt").write_text("new")
        (out.parent / "scratch").mkdir()  # scratch room next to it, removed afterwards
    assert [p.name for p in final.iterdir()] == ["new.txt"]
    assert list(staging.iterdir()) == []


def test_file_lock_creates_its_file(tmp_path):
    with file_lock(tmp_path / "locks" / "k.lock"):
        assert (tmp_path / "locks" / "k.lock").is_file()


def test_checks_name_owner_field_and_expectation():
    check_int("C", "n", None, 1, optional=True)
    check_number("C", "clip", float("inf"), inclusive=True, finite=False)
    with pytest.raises(ValueError, match=r"^C\.n: received True, expected an int >= 1$"):
        check_int("C", "n", True, 1)
    with pytest.raises(ValueError, match=r"^C\.n: received 0, expected None or an int >= 1$"):
        check_int("C", "n", 0, 1, optional=True)
    with pytest.raises(ValueError, match=r"^C\.lr: received inf, expected a finite number > 0$"):
        check_number("C", "lr", float("inf"))
    with pytest.raises(ValueError, match=r"^C\.clip: received nan, expected a number >= 0$"):
        check_number("C", "clip", float("nan"), inclusive=True, finite=False)
