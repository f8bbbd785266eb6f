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
    NUMBER,
    FolderInUseError,
    UnreadableFileError,
    atomic_write,
    atomic_write_files,
    check_zip_file,
    exclusive_lock,
    file_lock,
    read_file_bytes,
    read_json_file,
    read_json_record,
    read_jsonl,
    replace_entries,
    shape_mismatch,
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


# ---------------------------------------------------------------------------------------------
# shapes of the files read back, and the lock of a folder a run writes
# ---------------------------------------------------------------------------------------------

RESULT = {"config": {"window": 64}, "rows": [{"N": 128, "speedup": 1.5}, {"N": 256, "speedup": 2}]}
SHAPE = {"config": {"window": int, "dtype?": str}, "rows": [{"N": int, "speedup": NUMBER}]}


@pytest.mark.parametrize("change, why", [
    (lambda d: d.pop("rows"), "no key 'rows'"),
    (lambda d: d["rows"][1].pop("N"), "rows[1]: no key 'N'"),
    (lambda d: d["rows"][0].update(N="128"), "rows[0].N is a string, not an integer"),
    (lambda d: d["rows"][0].update(N=True), "rows[0].N is true or false, not an integer"),
    (lambda d: d["rows"][0].update(speedup=None), "rows[0].speedup is null, not an integer or a number"),  # noqa: E501
    (lambda d: d.update(rows={"N": 1}), "rows is a JSON object, not a JSON array"),
    (lambda d: d["config"].update(dtype=16), "config.dtype is an integer, not a string"),
    (lambda d: d.update(config=[]), "config is a JSON array, not a JSON object"),
])  # fmt: skip
def test_a_shape_mismatch_says_where_and_what(change, why):
    data = json.loads(json.dumps(RESULT))
    assert shape_mismatch(data, SHAPE) is None
    change(data)
    assert shape_mismatch(data, SHAPE) == why


def test_shapes_of_any_key_and_any_value():
    shape = {"*": {"*": NUMBER}, "meta?": object}
    assert shape_mismatch({"a": {"x": 1}, "b": {}, "meta": None}, shape) is None
    assert shape_mismatch({"a": {"x": "1"}}, shape) == "a.x is a string, not an integer or a number"  # fmt: skip
    assert shape_mismatch([1], shape) == "the document is a JSON array, not a JSON object"


def test_a_record_of_another_shape_is_named_with_what_was_expected(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps([RESULT]))
    with pytest.raises(UnreadableFileError) as err:
        read_json_record(path, "a kernel result", SHAPE)
    assert str(err.value) == f"{path}: the document is a JSON array, not a JSON object; expected a kernel result"  # fmt: skip
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(UnreadableFileError, match=r"r\.json: no key 'config'; expected a kernel"):
        read_json_record(path, "a kernel result", SHAPE)


def test_a_jsonl_file_drops_only_a_last_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert read_jsonl(path, "a log") == [{"step": 1}, {"step": 2}]
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": \xc3')  # cut inside a character
    assert read_jsonl(path, "a log") == [{"step": 1}, {"step": 2}]
    for damaged, line in ((b'{"step": 1}\n{"st\n{"step": 3}\n', 2), (b'[1]\n{"step": 2}\n', 1),
                          (b'{"step": 1}\n\xff\xfe\n', 2)):  # fmt: skip
        path.write_bytes(damaged)
        with pytest.raises(UnreadableFileError, match=rf"log\.jsonl: line {line} is .*; expected a log"):  # fmt: skip
            read_jsonl(path, "a log")


def test_a_torch_file_is_checked_whole_without_loading_it(tmp_path):
    path = tmp_path / "optimizer.pt"
    torch.save({"state": {0: {"exp_avg": torch.arange(4096.0)}}}, path)
    check_zip_file(path, "an optimizer state")
    whole = path.read_bytes()
    at = whole.index(torch.arange(4096.0).numpy().tobytes()[:64]) + 100  # inside the tensor's bytes
    path.write_bytes(whole[:at] + bytes([whole[at] ^ 0xFF]) + whole[at + 1 :])
    with pytest.raises(UnreadableFileError, match=r"optimizer\.pt: its member .* is damaged \(CRC mismatch\); expected an optimizer state"):  # fmt: skip
        check_zip_file(path, "an optimizer state")
    for damaged, why in ((whole[: len(whole) // 2], "truncated or not a torch.save file"),
                         (b"", "empty file"), (b'{"a": 1}', "truncated or not a torch.save file")):  # fmt: skip
        path.write_bytes(damaged)
        with pytest.raises(UnreadableFileError, match=rf"optimizer\.pt: {re.escape(why)}"):
            check_zip_file(path, "an optimizer state")
    path.unlink()
    path.mkdir()
    with pytest.raises(UnreadableFileError, match=r"optimizer\.pt: a directory"):
        check_zip_file(path, "an optimizer state")
    with pytest.raises(FileNotFoundError, match=r"missing\.pt not found; expected an optimizer"):
        check_zip_file(tmp_path / "missing.pt", "an optimizer state")


HOLD = """
import sys, time
from focus_attention.utils.io import exclusive_lock
with exclusive_lock(sys.argv[1], "focus train --out elsewhere"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    lock = tmp_path / "new" / "run" / ".focus-train.lock"
    with exclusive_lock(lock, "focus train --out run"):
        assert json.loads(lock.read_text())["owner"] == "focus train --out run"
        with pytest.raises(FolderInUseError) as err, exclusive_lock(lock, "focus sweep"):
            pass
        message = str(err.value)
        assert message.startswith(f"{lock.parent} is in use by process {os.getpid()} on ")
        assert "(focus train --out run, since " in message and "focus sweep would write" in message  # fmt: skip
        assert lock.is_file()  # the refusal leaves the holder's file alone
    assert not (tmp_path / "new").exists()  # removed with the folders made for it
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("x")
    with exclusive_lock(tmp_path / "kept" / ".lock", "a"):
        pass
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["mine.txt"]


def test_a_lock_held_by_another_process_refuses_and_one_left_by_a_killed_process_is_taken(tmp_path):  # fmt: skip
    import subprocess
    import sys

    lock = tmp_path / "run" / ".focus-train.lock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = rf"in use by process {holder.pid} on .*focus train --out elsewhere"
        with pytest.raises(FolderInUseError, match=refused), exclusive_lock(lock, "focus train"):
            pass
    finally:
        holder.kill()
        holder.wait()
    assert lock.is_file()  # a killed holder leaves its file, unlocked
    with exclusive_lock(lock, "focus train --out run"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()
