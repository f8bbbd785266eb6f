"""The trainer state of a ``focus train`` checkpoint: read back as saved, and a damaged or
unreadable state file is one error that names it (docs/method.md §8, "Files and failures")."""

from __future__ import annotations

import os

import pytest
import torch

from focus_attention.training.checkpoint import STATE_NAME, load_state
from focus_attention.utils.io import UnreadableFileError


def _state(directory, **extra):
    from focus_attention.training.checkpoint import STATE_FORMAT

    state = {"format": STATE_FORMAT, "step": 3, "elapsed": 1.5, **extra}
    torch.save(state, directory / STATE_NAME)
    return state


def test_a_saved_state_reads_back(tmp_path):
    state = _state(tmp_path, rng=torch.arange(4))
    got = load_state(tmp_path)
    assert got.keys() == state.keys() and torch.equal(got["rng"], state["rng"])
    _state(tmp_path, format=-1)
    with pytest.raises(ValueError, match="trainer state format -1 unsupported"):
        load_state(tmp_path)


@pytest.mark.parametrize("how", ["empty", "truncated", "garbage", "not a dict", "directory", "unreadable"])  # fmt: skip
def test_a_damaged_state_is_one_error_naming_it(tmp_path, how):
    path = tmp_path / STATE_NAME
    _state(tmp_path)
    raw = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "garbage":
        path.write_bytes(bytes(range(256)) * 2)
    elif how == "not a dict":
        torch.save([1, 2], path)
    elif how == "directory":
        path.unlink()
        path.mkdir()
    else:
        if os.geteuid() == 0:
            pytest.skip("running as root: permissions do not stop reads")
        path.chmod(0)
    with pytest.raises(UnreadableFileError) as err:
        load_state(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "expected the trainer state" in message
    assert "\n" not in message


def test_a_missing_state_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_state(tmp_path)


@pytest.mark.parametrize(
    "method, name",
    [("focus+lora", "lora/adapter_model.safetensors"), ("focus+lora", "focus_model.safetensors"),
     ("lora", "lora/adapter_model.safetensors")],
)  # fmt: skip
def test_a_damaged_weights_file_of_a_checkpoint_is_one_error_naming_it(tmp_path, method, name):
    from tiny import FOCUS_DEFAULTS, build_model

    from focus_attention.hf import FocusConfig
    from focus_attention.training.config import TrainConfig
    from focus_attention.training.methods import build_trainee

    base_lr = 1e-3 if method == "focus+lora" else None
    cfg = TrainConfig(method=method, seq_len=32, steps=1, base_lr=base_lr,
                      focus=FocusConfig(**FOCUS_DEFAULTS))  # fmt: skip
    build_trainee(cfg, build_model("llama"), None, None, 0).save_pretrained(tmp_path)
    path = tmp_path / name
    path.write_bytes(path.read_bytes()[:40])  # cut short
    trainee = build_trainee(cfg, build_model("llama"), None, None, 0)
    with pytest.raises(UnreadableFileError) as err:
        trainee.load_checkpoint(tmp_path)
    assert str(err.value).startswith(f"{path}: not a readable safetensors file")
