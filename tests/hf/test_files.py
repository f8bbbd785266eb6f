"""Adapter files under failure: a save is all-or-nothing, a load refuses a config and
weights that do not belong together, and every damaged or unreadable file is one error
that names the file and says what was expected (docs/method.md §8, "Files and failures")."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import save_file
from tiny import ARCHS, build_model, focus, ids

from focus_attention.hf import CONFIG_NAME, TRAINER_WEIGHTS_NAME, WEIGHTS_NAME, FocusModel
from focus_attention.hf import files as hf_files
from focus_attention.utils.io import UnreadableFileError

X = ids(2, 24, seed=5)


def logits(fm: FocusModel) -> torch.Tensor:
    with torch.no_grad():
        return fm(input_ids=X).logits


def old_and_new(arch: str = "llama"):
    """Two adapters of one base that differ in settings and in every router tensor: the
    first (window 8, top_k 1) saved is the "old" one, the second (window 16, top_k 2) is
    about to replace it."""
    _, fm = focus(arch, window=8, top_k=1)
    old = logits(fm)
    old_routers = {k: v.clone() for k, v in fm.routers.state_dict().items()}
    with torch.no_grad():
        for p in fm.routers.parameters():
            p.add_(0.5 * torch.randn_like(p))
    fm.focus_config = fm.focus_config.replace(window=16, top_k=2)
    return fm, old, old_routers, logits(fm)


def folder_bytes(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def load(directory: pathlib.Path, arch: str = "llama") -> FocusModel:
    return FocusModel.from_pretrained(build_model(arch), directory)


# --------------------------------------------------------------------------------------------
# a save is all-or-nothing
# --------------------------------------------------------------------------------------------


def _failing_after(monkeypatch, owner, name: str, calls: int) -> None:
    """Make the ``calls``-th call of ``owner.name`` raise ENOSPC ("disk full")."""
    real, seen = getattr(owner, name), []

    def fail(*args, **kwargs):
        seen.append(1)
        if len(seen) == calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, fail)


#: every step of a save that can fail: the weights writer, the config writer, the flush of
#: each temporary file, and each of the two renames into place
FAILURES = [
    ("weights writer", hf_files, "save_file", 1),
    ("config writer", pathlib.Path, "write_text", 1),
    ("first fsync", os, "fsync", 1),
    ("second fsync", os, "fsync", 2),
    ("first rename", os, "replace", 1),
    ("second rename", os, "replace", 2),
]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("step, owner, name, calls", FAILURES, ids=[f[0] for f in FAILURES])
def test_a_save_that_fails_at_any_step_leaves_the_previous_adapter(
    tmp_path, monkeypatch, arch, step, owner, name, calls
):
    fm, old, old_routers, new = old_and_new(arch)
    assert not torch.equal(old, new)
    new_routers = new_routers_of(fm)
    directory = tmp_path / "adapter"
    load_routers_state(fm, old_routers, window=8, top_k=1).save_pretrained(directory)
    (directory / "train_config.json").write_text("{}")  # another tool's file, left alone
    before = folder_bytes(directory)
    load_routers_state(fm, new_routers, window=16, top_k=2)
    with monkeypatch.context() as mp:
        _failing_after(mp, owner, name, calls)
        with pytest.raises(OSError, match="No space left"):
            fm.save_pretrained(directory)
    assert folder_bytes(directory) == before, step  # byte for byte, no temporaries left
    again = load(directory, arch)
    assert (again.focus_config.window, again.focus_config.top_k) == (8, 1)
    assert torch.equal(logits(again), old)
    fm.save_pretrained(directory)  # the same save, without the failure
    again = load(directory, arch)
    assert (again.focus_config.window, again.focus_config.top_k) == (16, 2)
    assert torch.equal(logits(again), new)
    names = [hf_files.CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, "train_config.json"]
    assert sorted(folder_bytes(directory)) == sorted(names)


def new_routers_of(fm: FocusModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fm.routers.state_dict().items()}


def load_routers_state(fm: FocusModel, state: dict, **settings) -> FocusModel:
    """``fm`` with these router tensors and settings (the adapter a test saves)."""
    fm.routers.load_state_dict(state)
    fm.focus_config = fm.focus_config.replace(**settings)
    return fm


# --------------------------------------------------------------------------------------------
# a load refuses files that do not belong together
# --------------------------------------------------------------------------------------------


def _two_adapters(tmp_path, arch: str = "llama"):
    fm, _, old_routers, _ = old_and_new(arch)
    new_routers = new_routers_of(fm)
    a, b = tmp_path / "a", tmp_path / "b"
    load_routers_state(fm, old_routers, window=8, top_k=1).save_pretrained(a)
    load_routers_state(fm, new_routers, window=16, top_k=2).save_pretrained(b)
    return a, b


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stale", [CONFIG_NAME, WEIGHTS_NAME])
def test_a_torn_adapter_is_refused_naming_both_files(tmp_path, arch, stale):
    """A crash between the two renames of a save leaves one file of each adapter: every
    reader refuses it, naming both files and the settings that differ."""
    a, b = _two_adapters(tmp_path, arch)
    shutil.copyfile(a / stale, b / stale)
    match = rf"{CONFIG_NAME} and .*{WEIGHTS_NAME} do not belong together.*window=(8|16)"
    with pytest.raises(ValueError, match=match) as err:
        load(b, arch)
    assert str(b / CONFIG_NAME) in str(err.value) and str(b / WEIGHTS_NAME) in str(err.value)
    _, fm = focus(arch, window=8, top_k=1)
    with pytest.raises(ValueError, match=match):
        fm.load_routers(b)


def test_weights_saved_with_the_same_settings_on_another_base_are_refused(tmp_path):
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path / "a")
    _, other = focus("llama", seed=1)  # same structure, other weights: another fingerprint
    other.save_pretrained(tmp_path / "b")
    shutil.copyfile(tmp_path / "a" / WEIGHTS_NAME, tmp_path / "b" / WEIGHTS_NAME)
    with pytest.raises(ValueError, match="do not belong together.*base-model fingerprint"):
        load(tmp_path / "b")


def test_a_weights_file_without_its_config_copy_is_refused(tmp_path):
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path)
    save_file(fm.focus_state_dict(), str(tmp_path / WEIGHTS_NAME))  # no metadata
    with pytest.raises(UnreadableFileError, match=rf"{WEIGHTS_NAME}: .*no copy of the adapter"):
        load(tmp_path)


def test_an_adapter_whose_weights_carry_only_the_settings_loads(tmp_path):
    """Adapters saved before the weights carried the whole config document: their copy
    holds the settings only (no fingerprint), and the settings are compared."""
    _, fm = focus("llama", window=8)
    fm.save_pretrained(tmp_path)
    settings = {"format": "pt", "focus_config": fm.focus_config.to_json_string()}
    save_file(fm.focus_state_dict(), str(tmp_path / WEIGHTS_NAME), metadata=settings)
    assert torch.equal(logits(load(tmp_path)), logits(fm))
    edited = fm.focus_config.replace(window=16).to_json_string()
    save_file(fm.focus_state_dict(), str(tmp_path / WEIGHTS_NAME), metadata={"focus_config": edited})  # fmt: skip
    with pytest.raises(ValueError, match="window=8 in focus_config.json, 16 in the weights"):
        load(tmp_path)


def test_the_weights_file_carries_the_config_file(tmp_path):
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path)
    _, metadata = hf_files.read_safetensors(tmp_path / WEIGHTS_NAME, "weights")
    copy = metadata[hf_files.WEIGHTS_CONFIG_METADATA]
    assert copy == (tmp_path / CONFIG_NAME).read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# damaged and unreadable files
# --------------------------------------------------------------------------------------------


def _damage(path: pathlib.Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "garbage":
        path.write_bytes(bytes(range(256)) * 3)
    elif how == "directory":
        path.unlink()
        path.mkdir()
    elif how == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("running as root: permissions do not stop reads")
        path.chmod(0)
    else:
        raise KeyError(how)


DAMAGE = ["empty", "truncated", "garbage", "directory", "unreadable"]


def _saved(tmp_path, layout: str) -> pathlib.Path:
    _, fm = focus("llama")
    if layout == "adapter":
        fm.save_pretrained(tmp_path)
    else:  # what transformers.Trainer writes for a model that is not a PreTrainedModel
        save_file(fm.state_dict(), str(tmp_path / TRAINER_WEIGHTS_NAME), metadata={"format": "pt"})  # fmt: skip
    return tmp_path


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize(
    "layout, name",
    [("adapter", WEIGHTS_NAME), ("adapter", CONFIG_NAME), ("trainer", TRAINER_WEIGHTS_NAME)],
)
def test_a_damaged_file_is_one_error_naming_it(tmp_path, how, layout, name):
    directory = _saved(tmp_path, layout)
    _damage(directory / name, how)
    readers = [lambda: load(directory)]
    if layout == "adapter":
        readers.append(lambda: focus("llama")[1].load_routers(directory))
    for read in readers:
        with pytest.raises(UnreadableFileError) as err:
            read()
        message = str(err.value)
        assert message.startswith(f"{directory / name}: "), message
        assert "expected" in message and "\n" not in message, message


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"num_groups": 4,', "not a valid Focus config file.*invalid JSON"),
        ("[1, 2]", "expected an object"),
        ('{"format_version": 99}', "format_version 99 is not supported"),
        ('{"num_groups": -1}', "num_groups"),
        ('{"windoww": 8}', "windoww"),
    ],
)
def test_an_invalid_config_is_one_error_naming_it(tmp_path, text, match):
    directory = _saved(tmp_path, "adapter")
    (directory / CONFIG_NAME).write_text(text)
    with pytest.raises(UnreadableFileError, match=match) as err:
        load(directory)
    assert str(err.value).startswith(f"{directory / CONFIG_NAME}: ")


def test_a_trainer_file_without_a_focus_state_says_so(tmp_path):
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / TRAINER_WEIGHTS_NAME))
    with pytest.raises(FileNotFoundError, match=f"{TRAINER_WEIGHTS_NAME} holds no Focus state"):
        load(tmp_path)


def test_a_trainer_file_with_a_damaged_config_entry_is_one_error_naming_it(tmp_path):
    _, fm = focus("llama")
    state = fm.state_dict()
    state["focus_config"] = torch.tensor([255, 0, 1], dtype=torch.uint8)
    save_file(state, str(tmp_path / TRAINER_WEIGHTS_NAME))
    with pytest.raises(UnreadableFileError, match="invalid UTF-8") as err:
        load(tmp_path)
    assert str(tmp_path / TRAINER_WEIGHTS_NAME) in str(err.value)


@pytest.mark.parametrize("name", [WEIGHTS_NAME, CONFIG_NAME])
@pytest.mark.parametrize("how", ["empty", "garbage", "directory"])
def test_the_command_line_reports_a_damaged_adapter_on_one_line(
    assets, tmp_path, capsys, how, name
):
    from focus_attention import cli
    from focus_attention.assets.models import load_model
    from focus_attention.hf import FocusConfig, get_focus_model

    base, _ = load_model(str(assets["model"]), quiet=True)
    get_focus_model(base, FocusConfig(num_groups=4)).save_pretrained(tmp_path)
    _damage(tmp_path / name, how)
    rc = cli.main(["eval", "--model", str(assets["model"]), "--adapter", str(tmp_path),
                   "--corpus", str(assets["corpus"]), "--seq-len", "32", "--max-tokens", "64",
                   "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    reported = [line for line in err.splitlines() if line.startswith("focus: error:")]
    assert len(reported) == 1 and err.rstrip().endswith(reported[0])
    assert reported[0].startswith(f"focus: error: {tmp_path / name}: ")


def test_a_file_or_a_sweep_folder_given_as_the_adapter_says_what_to_pass(tmp_path):
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path / "adapter")
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        with pytest.raises(FileNotFoundError, match=rf"{name} is a file, not a folder; expected "
                           rf"an adapter folder .*: pass {tmp_path / 'adapter'}, the folder"):  # fmt: skip
            load(tmp_path / "adapter" / name)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"notes\.txt is a file, not a folder; expected an "
                       r"adapter folder \(focus_config\.json and focus_model\.safetensors\) or the "
                       r"folder of a focus train run$"):  # fmt: skip
        load(tmp_path / "notes.txt")
    sweep = tmp_path / "sweep"
    for cell in ("k8", "k4"):
        (sweep / "cells" / cell).mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=rf"; {sweep} is the output folder of focus sweep: "
                       rf"pass one of its 2 cells, such as {sweep / 'cells' / 'k4'}$"):  # fmt: skip
        load(sweep)
    assert hf_files.sweep_hint(tmp_path / "adapter") == ""
    assert hf_files.check_adapter_folder(str(tmp_path / "none")) == tmp_path / "none"
