"""Every file the package reads back, damaged every way: truncated, of another JSON type,
without a key its readers need, empty, a directory in its place (and, for a checkpoint's
states, missing). Each reader answers with one error that names the file and what was
expected (:class:`~focus_attention.utils.io.UnreadableFileError`, a ``ValueError`` the
``focus`` commands print on one line), never a traceback of another kind.

Each :class:`Reader` writes a valid file, reads it back (which must work), then reads each
damaged copy; a reader of the package added without a row here is a gap in this test."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tiny import focus
from tiny_assets import train_config

from focus_attention.bench.results import read_result
from focus_attention.experiments.grid import read_cell, read_eval_result
from focus_attention.experiments.report import report_markdown
from focus_attention.experiments.runner import step_plan
from focus_attention.experiments.study import load_study
from focus_attention.hf.files import read_adapter
from focus_attention.training.outputs import (
    Checkpoint,
    check_checkpoint,
    read_log,
    read_train_result,
    write_run_state,
)
from focus_attention.training.run import saved_config
from focus_attention.utils.io import UnreadableFileError, write_json_atomic

KERNEL = {
    "benchmark": "kernel",
    "config": {"num_groups": 4, "window": 8, "num_heads": 2, "num_key_value_heads": 1, "head_dim": 8},  # fmt: skip
    "rows": [{"N": 64, "top_k": 1, "dense_s": 0.2, "sparse_s": 0.1, "speedup": 2.0, "density": 0.4,
              "ideal_speedup": 2.5, "efficiency": 0.8, "dense_peak_bytes": None,
              "sparse_peak_bytes": 1024}],
}  # fmt: skip
TRAIN_RESULT = {"steps": 6, "trainable_parameters": 576, "train_seconds": 1.5,
                "extra": {"interrupted": False}, "config": {"steps": 6}}  # fmt: skip
EVAL = {"ppl": {"base": 9.0, "focus_topk": {"1": 9.5}}, "pairs_retained": {"1": 0.3},
        "dominance": {"topk": {"1": 0.5}}, "tokens": 64}  # fmt: skip
CELL = {"slug": "a", "dir": "x", "train_config": {}, "train_seconds": 1.0,
        "evals": {"eval": {"eval_config": {}, "ppl": {"base": 9.0}, "pairs_retained": {}}}}  # fmt: skip


@dataclass(frozen=True)
class Reader:
    """A file the package reads back: ``make(folder) -> (the file, read)`` writes a valid
    one and returns the call that reads it; ``drop``, a key path (``"rows"``,
    ``"extra.interrupted"``) to remove for the "missing key" damage (None: every key of the
    file has a default, or it is not JSON); ``damages``, those that apply."""

    make: Callable[[Path], tuple[Path, Callable[[], Any]]]
    drop: str | None
    damages: tuple[str, ...] = ("truncated", "wrong type", "missing key", "empty", "directory")


def _json(path: Path, data: Any) -> Path:
    write_json_atomic(path, data)
    return path


def _bench(folder):
    path = _json(folder / "kernel.json", KERNEL)
    return path, lambda: read_result(path)


def _merged(folder):
    path = _json(folder / "merged.json", {"benchmark": "kernel", "merged": True, "parts": [KERNEL, KERNEL]})  # fmt: skip
    return path, lambda: read_result(path)


def _train_result(folder):
    path = _json(folder / "train_result.json", TRAIN_RESULT)
    return path, lambda: read_train_result(path)


def _train_config(folder):
    cfg = train_config(model="m", corpus="c", out=str(folder), steps=6)
    path = _json(folder / "train_config.json", cfg.to_dict())
    return path, lambda: saved_config(folder)


def _log(folder):
    path = folder / "log.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 2.0, "seconds": 0.1 * s}) + "\n" for s in (1, 2)))  # fmt: skip
    return path, lambda: read_log(path)


def _checkpoint(name):
    def make(folder):
        ckpt = folder / "checkpoints" / "checkpoint-2"
        ckpt.mkdir(parents=True)
        for state in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            torch.save({"state": torch.arange(64.0)}, ckpt / state)
        _json(ckpt / "trainer_state.json", {"global_step": 2, "log_history": []})
        write_run_state(ckpt, world_size=1, phase=1, step_offset=0)
        return ckpt / name, lambda: check_checkpoint(Checkpoint(ckpt, 2, 1, 2, 1))

    return make


def _adapter(name):
    def make(folder):
        _, fm = focus("llama", window=8, top_k=1)
        fm.save_pretrained(folder / "adapter")
        return folder / "adapter" / name, lambda: read_adapter(folder / "adapter")

    return make


def _study(folder) -> Path:
    study = folder / "study"
    (study / "results").mkdir(parents=True)
    (study / "config.toml").write_text(
        '[study]\ntitle = "t"\n\n[[steps]]\nname = "kernel"\ncommand = "bench kernel"\n'
        'result = "{results}/kernel.json"\n\n[[steps]]\nname = "report"\ncommand = "report"\n'
    )
    _json(study / "results" / "kernel.json", {**KERNEL, "experiment": {}})
    return study


def _started(folder):
    study = _study(folder)
    path = _json(study / "results" / ".started.json", {"other": "x.json"})
    loaded = load_study(study)
    return path, lambda: step_plan(loaded, loaded.step("kernel"))


def _report_result(folder):
    study = _study(folder)
    return study / "results" / "kernel.json", lambda: report_markdown(load_study(study))


def _cell(folder):
    path = _json(folder / "cell.json", CELL)
    return path, lambda: read_cell(path)


def _eval(folder):
    path = _json(folder / "eval.json", EVAL)
    return path, lambda: read_eval_result(path)


BINARY = ("truncated", "wrong type", "empty", "directory")
READERS = {
    "benchmark result": Reader(_bench, "rows"),
    "merged benchmark result": Reader(_merged, "parts"),
    "train_result.json": Reader(_train_result, "extra.interrupted"),
    # every setting has a default (an older run's file lacks the newer ones)
    "train_config.json": Reader(
        _train_config, None, ("truncated", "wrong type", "empty", "directory")
    ),  # fmt: skip
    # a cut last line is a kill's, dropped; a damaged line before it is damage
    "log.jsonl": Reader(_log, None, ("damaged line", "wrong type", "wrong value", "directory")),
    "checkpoint optimizer.pt": Reader(_checkpoint("optimizer.pt"), None, (*BINARY, "missing")),
    "checkpoint scheduler.pt": Reader(_checkpoint("scheduler.pt"), None, (*BINARY, "missing")),
    "checkpoint rng_state.pth": Reader(_checkpoint("rng_state.pth"), None, (*BINARY, "missing")),
    "checkpoint trainer_state.json": Reader(
        _checkpoint("trainer_state.json"), None, ("truncated", "wrong type", "empty", "directory")
    ),  # fmt: skip
    # every setting has a default (an older adapter's file lacks the newer ones)
    "adapter focus_config.json": Reader(
        _adapter("focus_config.json"), None, ("truncated", "wrong type", "empty", "directory")
    ),  # fmt: skip
    "adapter focus_model.safetensors": Reader(_adapter("focus_model.safetensors"), None, BINARY),
    "study .started.json": Reader(
        _started, None, ("truncated", "wrong type", "wrong value", "empty", "directory")
    ),  # fmt: skip
    "study result read by the report": Reader(_report_result, "rows"),
    "sweep cell.json": Reader(_cell, "train_config"),
    "focus eval result read by a sweep": Reader(_eval, "ppl"),
}
CASES = [(name, damage) for name, reader in READERS.items() for damage in reader.damages]


def _drop(data: dict, key_path: str) -> None:
    *parents, last = key_path.split(".")
    for key in parents:
        data = data[key]
    del data[last]


def _damage(path: Path, how: str, reader: Reader) -> None:
    """Damage the file ``path`` as ``how`` says."""
    raw = path.read_bytes()
    if how in ("directory", "missing"):
        path.unlink()
        if how == "directory":
            path.mkdir()
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "wrong type":
        path.write_text("[1, 2]\n")  # a JSON array (or, for a binary file, JSON text)
    elif how == "damaged line":
        path.write_bytes(b'{"step": 1}\n{"step": 2, "lo\n' + raw)
    elif how == "wrong value":  # a JSON object whose value has another type
        path.write_text(json.dumps({"step": "one"} if path.suffix == ".jsonl" else {"kernel": 3}) + "\n")  # fmt: skip
    elif how == "missing key":
        data = json.loads(raw)
        for part in data.get("parts", [data]) if reader.drop != "parts" else [data]:
            _drop(part, reader.drop)
        if reader.drop == "parts":
            data["parts"] = []
        path.write_text(json.dumps(data))


def test_every_reader_reads_its_valid_file(tmp_path):
    for name, reader in READERS.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        _, read = reader.make(folder)
        read()


@pytest.mark.parametrize("name, damage", CASES, ids=[f"{n}: {d}" for n, d in CASES])
def test_a_damaged_file_is_one_error_naming_it_and_what_was_expected(tmp_path, name, damage):
    reader = READERS[name]
    path, read = reader.make(tmp_path)
    path = path.resolve()
    _damage(path, damage, reader)
    error = FileNotFoundError if damage == "missing" else UnreadableFileError
    with pytest.raises(error) as caught:
        read()
    message = str(caught.value)
    assert str(path) in message and "expected" in message, message
    assert "\n" not in message


def test_every_damage_is_tried_on_some_reader():
    tried = {damage for reader in READERS.values() for damage in reader.damages}
    assert {"truncated", "wrong type", "missing key", "empty", "directory"} <= tried


def test_a_checkpoint_without_its_trained_weights_readable_is_named(tmp_path):
    ckpt_file, read = _checkpoint("optimizer.pt")(tmp_path)
    weights = ckpt_file.parent / "focus_model.safetensors"
    save_file({"a": torch.ones(64)}, str(weights))
    read()
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(UnreadableFileError, match=r"focus_model\.safetensors: not a readable safetensors file .*; expected a file of the focus train checkpoint checkpoint-2"):  # fmt: skip
        read()
