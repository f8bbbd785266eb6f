"""The crash-safe write helpers shared by models, data, train, bench and the adapter, and
the readers that turn a damaged or unreadable file into one error naming it."""

from __future__ import annotations

import errno
import json
import os
import re
import stat

import pytest
import torch
from safetensors.torch import save_file

from focus_attention.utils.checks import check_int, check_number
from focus_attention.utils.io import (
    UnreadableFileError,
    atomic_write,
    atomic_write_files,
    file_lock,
    read_file_bytes,
    read_json_file,
    replace_entries,
    staged_directory,
    write_json_atomic,
)


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


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), OSError(28, "No space left on device")])
@pytest.mark.parametrize("at", [0, 1])
def test_staged_directory_stopped_at_either_rename_keeps_the_destination(tmp_path, monkeypatch, at, stop):  # fmt: skip
    """Ctrl-C or a failure at the rename that sets the old directory aside, or at the one
    that moves the new one in: the old directory is in place, whole."""
    final, staging = tmp_path / "entry", tmp_path / ".staging"
    final.mkdir()
    (final / "old.txt").write_text("old")
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(1)
        if len(calls) - 1 == at:
            raise stop
        return real(a, b)

    with pytest.raises(type(stop)), staged_directory(final, staging, "e.") as out:
        (out / "new.txt").write_text("new")
        monkeypatch.setattr(os, "replace", replace)
    monkeypatch.undo()
    assert [p.name for p in final.iterdir()] == ["old.txt"]
    assert not any(staging.iterdir())


def test_staged_directory_that_cannot_be_made_names_the_destination(tmp_path):
    (tmp_path / "a-file").write_text("x")
    final = tmp_path / "a-file" / "out"  # its parent is a file
    with pytest.raises(OSError, match=f"cannot write {re.escape(str(final))}: "):  # noqa: SIM117
        with staged_directory(final, final.parent, ".out.export-"):
            pass


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


# --------------------------------------------------------------------------------------------
# several files, all or nothing
# --------------------------------------------------------------------------------------------


def _pair(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.txt"
    a.write_text("old a")
    b.write_text("old b")
    b.chmod(0o640)
    return a, b


def _disk_full(tmp):
    tmp.write_text("half")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_writer_leaves_every_file_as_it_was(tmp_path, failing):
    a, b = _pair(tmp_path)
    writers = [lambda t: t.write_text("new a"), lambda t: t.write_text("new b")]
    writers[failing] = _disk_full
    with pytest.raises(OSError, match="No space left"):
        atomic_write_files({a: writers[0], b: writers[1]})
    assert (a.read_text(), b.read_text()) == ("old a", "old b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.txt"]


@pytest.mark.parametrize("new_second", [False, True])
def test_a_failed_rename_puts_back_the_files_already_replaced(tmp_path, monkeypatch, new_second):
    a, b = _pair(tmp_path)
    if new_second:
        b.unlink()  # the second file is new: the rollback removes it
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output"):
        atomic_write_files({a: lambda t: t.write_text("new a"), b: lambda t: t.write_text("new b")})
    monkeypatch.undo()
    assert a.read_text() == "old a"
    assert b.exists() is not new_second and (new_second or b.read_text() == "old b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"] + ([] if new_second else ["b.txt"])  # fmt: skip


def test_every_file_is_replaced_and_keeps_its_mode(tmp_path):
    a, b = _pair(tmp_path)
    c = tmp_path / "c.txt"
    atomic_write_files({a: lambda t: t.write_text("new a"), b: lambda t: t.write_text("new b"),
                        c: lambda t: t.write_text("new c")})  # fmt: skip
    assert [p.read_text() for p in (a, b, c)] == ["new a", "new b", "new c"]
    assert stat.S_IMODE(b.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.txt", "c.txt"]


# --------------------------------------------------------------------------------------------
# damaged and unreadable files
# --------------------------------------------------------------------------------------------

EXPECTED = "the JSON results of a test"


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "empty file"),
        (b"  \n", "empty file"),
        (b'{"ppl": {"1": 3.', "not valid JSON"),
        (bytes(range(128, 256)), "not UTF-8 text"),
        (b"{'ppl': 1}", "not valid JSON"),
    ],
)
def test_a_damaged_json_file_is_one_error_naming_it(tmp_path, content, why):
    path = tmp_path / "result.json"
    path.write_bytes(content)
    with pytest.raises(UnreadableFileError) as err:
        read_json_file(path, EXPECTED)
    message = str(err.value)
    assert message.startswith(f"{path}: {why}") and message.endswith(f"; expected {EXPECTED}")
    assert "\n" not in message and isinstance(err.value, ValueError)


def test_a_directory_or_an_unreadable_file_is_one_error_naming_it(tmp_path):
    path = tmp_path / "result.json"
    path.mkdir()
    with pytest.raises(UnreadableFileError, match=rf"^{path}: a directory; expected {EXPECTED}$"):
        read_json_file(path, EXPECTED)
    path.rmdir()
    path.write_text(json.dumps({"ppl": 3.5}))
    assert read_json_file(path, EXPECTED) == {"ppl": 3.5}
    if os.geteuid() != 0:  # root reads files whatever their permissions
        path.chmod(0)
        with pytest.raises(UnreadableFileError, match=rf"^{path}: cannot be read"):
            read_file_bytes(path, EXPECTED)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'absent'} not found; expected"):
        read_json_file(tmp_path / "absent", EXPECTED)


def test_without_hard_links_the_old_files_are_copied_for_the_rollback(tmp_path, monkeypatch):
    a, b = _pair(tmp_path)

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_files({a: lambda t: t.write_text("new a"), b: _disk_full})
    assert (a.read_text(), b.read_text()) == ("old a", "old b")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output"):
        atomic_write_files({a: lambda t: t.write_text("new a"), b: lambda t: t.write_text("new b")})
    monkeypatch.setattr(os, "replace", real)
    assert (a.read_text(), b.read_text()) == ("old a", "old b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.txt"]


def _entries(root):
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fail_at", [None, 1, 2, 3, 4, 5])  # the n-th of 5 renames
def test_replace_entries_moves_files_and_folders_all_or_none(tmp_path, monkeypatch, fail_at):
    """The new entries (a file, a folder, a new name) replace the old ones together; a
    rename that fails at any point leaves the destination as it was and no staging behind."""
    dest, staged = tmp_path / "out", tmp_path / "out" / ".staged"
    (dest / "lora").mkdir(parents=True)
    (dest / "lora" / "w.bin").write_text("old lora")
    (dest / "adapter.json").write_text("old adapter")
    (dest / "log.jsonl").write_text("kept")
    staged.mkdir()
    (staged / "lora").mkdir()
    (staged / "lora" / "w.bin").write_text("new lora")
    (staged / "adapter.json").write_text("new adapter")
    (staged / "result.json").write_text("new result")
    before = _entries(dest)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    if fail_at is None:
        got = replace_entries(staged, dest)
        assert [p.name for p in got] == ["adapter.json", "lora", "result.json"]
        assert _entries(dest) == {"adapter.json": "new adapter", "log.jsonl": "kept",
                                  "lora/w.bin": "new lora", "result.json": "new result"}  # fmt: skip
        assert list(staged.iterdir()) == []
    else:
        with pytest.raises(OSError, match="No space"):
            replace_entries(staged, dest)
        assert _entries(dest) == before
    assert sorted(p.name for p in dest.iterdir() if p.name.startswith(".old-")) == []


def test_check_output_file_accepts_a_new_or_existing_file_and_missing_folders(tmp_path):
    from focus_attention.utils.io import check_output_file

    existing = tmp_path / "old.json"
    existing.write_text("{}")
    for path in (tmp_path / "new.json", existing, tmp_path / "a" / "b" / "c.json"):
        assert check_output_file(path, "--json") == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # nothing left behind


def test_check_output_file_refuses_what_cannot_be_written(tmp_path):
    from focus_attention.utils.io import check_output_file

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--json: .*a directory; expected the path of a file"):
        check_output_file(tmp_path, "--json")
    with pytest.raises(ValueError, match=r"--plot: .*afile' is a file, not a folder"):
        check_output_file(tmp_path / "afile" / "p.png", "--plot")
    with pytest.raises(ValueError, match=r"--json: .*no file can be created in '/proc'"):
        check_output_file("/proc/x.json", "--json")
