"""The cache plumbing shared by the model and corpus registries: manifests, atomic builds,
sizes, install hints; and the order in which ``focus --help`` lists the asset commands."""

from __future__ import annotations

import json
import os

import pytest

from focus_attention.assets.cache import (
    CACHE_FORMAT,
    MANIFEST_NAME,
    assets_hint,
    build_entry,
    dir_size,
    human_size,
    read_manifest,
    sha256_file,
    verify_entry,
)
from focus_attention.utils.io import UnreadableFileError


def test_human_size_uses_binary_units():
    assert human_size(0) == "0 B"
    assert human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB"
    assert human_size(5 * 1024**2) == "5.0 MiB"
    assert human_size(3 * 1024**4) == "3072.0 GiB"  # GiB is the largest unit


def test_assets_hint_names_the_needed_modules_first():
    hint = "pip install 'focus-attention[assets]'  (installs {})"
    assert assets_hint() == hint.format("gguf, accelerate, rdata")
    assert assets_hint(["rdata"]) == hint.format("rdata, gguf, accelerate")
    assert assets_hint(("gguf", "accelerate")) == hint.format("gguf, accelerate, rdata")


def test_build_entry_writes_the_manifest_last_and_is_idempotent(home):
    final = home / "things" / "one"
    calls = []

    def build(out, scratch):
        calls.append(out)
        assert scratch.is_dir() and not any(out.iterdir())
        (out / "sub").mkdir()
        (out / "sub" / "a.txt").write_text("hello")
        return {"kind": "test", "name": "one"}

    assert build_entry(final, "test-one", build, quiet=True) == final
    manifest = read_manifest(final)
    assert manifest is not None and manifest["format"] == CACHE_FORMAT
    assert manifest["kind"] == "test" and manifest["name"] == "one"
    assert manifest["files"] == {
        "sub/a.txt": {"size": 5, "sha256": sha256_file(final / "sub" / "a.txt")}
    }
    assert dir_size(final) == 5 + (final / MANIFEST_NAME).stat().st_size
    assert build_entry(final, "test-one", build, quiet=True) == final
    assert len(calls) == 1  # complete: not rebuilt
    build_entry(final, "test-one", build, force=True, quiet=True)
    assert len(calls) == 2 and verify_entry(final, full=True) == []
    assert not any((home / ".staging").iterdir())


def test_read_manifest_rejects_incomplete_or_other_format_entries(tmp_path):
    assert read_manifest(tmp_path / "absent") is None
    assert read_manifest(tmp_path) is None  # no manifest: incomplete
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": CACHE_FORMAT + 1}))
    assert read_manifest(tmp_path) is None  # another format: rebuilt by the next prepare
    assert "entry incomplete" in verify_entry(tmp_path)[0]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": CACHE_FORMAT, "files": {}}))
    assert read_manifest(tmp_path) == {"format": CACHE_FORMAT, "files": {}}


def _damage(path, how: str) -> None:
    """Replace the file ``path`` by a damaged one."""
    good = json.dumps({"format": CACHE_FORMAT, "files": {"a.txt": {"size": 5, "sha256": "0"}}})
    if how == "directory":
        path.unlink(missing_ok=True)
        path.mkdir()
        return
    if how == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("running as root: permissions do not stop reads")
        path.write_text(good)
        path.chmod(0)
        return
    path.write_bytes(
        {
            "empty": b"",
            "truncated": good[: len(good) // 2].encode(),
            "garbage": bytes(range(256)),
            "list": b"[1, 2]",
            "bad files": json.dumps(
                {"format": CACHE_FORMAT, "files": {"a": {"size": "5"}}}
            ).encode(),  # fmt: skip
            "no files": json.dumps({"format": CACHE_FORMAT}).encode(),
        }[how]
    )


MANIFEST_DAMAGE = ["empty", "truncated", "garbage", "list", "bad files", "no files", "directory", "unreadable"]  # fmt: skip


@pytest.mark.parametrize("how", MANIFEST_DAMAGE)
def test_a_damaged_manifest_is_one_error_naming_it(home, how):
    """Read, verified or built over without --force, a damaged manifest is an error that
    names the file, says what a manifest holds and how to rebuild; --force rebuilds it."""
    final = home / "things" / "one"
    final.mkdir(parents=True)
    _damage(final / MANIFEST_NAME, how)
    with pytest.raises(UnreadableFileError) as err:
        read_manifest(final)
    message = str(err.value)
    assert message.startswith(f"{final / MANIFEST_NAME}: ") and "\n" not in message
    assert "expected the JSON manifest" in message and "--force" in message
    assert verify_entry(final) == [message]
    assert read_manifest(final, damaged_ok=True) is None
    calls = []

    def build(out, scratch):
        calls.append(out)
        (out / "a.txt").write_text("hello")
        return {"kind": "test"}

    with pytest.raises(UnreadableFileError, match="--force"):
        build_entry(final, "test-one", build, quiet=True)
    assert calls == []
    build_entry(final, "test-one", build, force=True, quiet=True)
    assert len(calls) == 1 and verify_entry(final, full=True) == []


def test_full_verification_detects_changed_content(home):
    final = home / "e"

    def build(out, scratch):
        (out / "f").write_text("abc")
        return {}

    build_entry(final, "e", build, quiet=True)
    assert verify_entry(final, full=True) == []
    (final / "f").write_text("abd")  # same size, other bytes
    assert verify_entry(final) == []
    assert "sha256 differs" in verify_entry(final, full=True)[0]


def test_help_lists_the_asset_commands_in_order(capsys):
    from focus_attention.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    positions = [out.index(f"\n    {cmd} ") for cmd in ("data", "setup", "models")]
    assert positions == sorted(positions)
    assert main(["models"]) == 2 and main(["data"]) == 2
