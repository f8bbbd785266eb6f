"""The model card (``README.md``) ``FocusModel.save_pretrained`` and ``export_model``
write: the base model, the settings, the training and ``focus eval`` records found beside the
adapter (only numbers a record holds), part of the all-or-nothing save, never replacing a
README of someone else's (docs/deploy.md)."""

from __future__ import annotations

import errno
import json
import pathlib
import shutil

import pytest
import torch
from tiny import focus

from focus_attention import export_model
from focus_attention.hf.card import CARD_MARKER, adapter_digest, refresh_card
from focus_attention.hf.config import INFERENCE_SETTINGS
from focus_attention.hf.files import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, weights_file_sha256

TRAIN_CONFIG = {"model": "org/tiny-base", "corpus": "austen", "method": "focus", "steps": 80,
                "seq_len": 512, "lr": 0.03}  # fmt: skip
TRAIN_RESULT = {"steps": 80, "final_loss": 3.51234,
                "validation": [{"step": 80, "val_ppl_topk": 36.1419, "val_ppl_base": 34.9}]}  # fmt: skip


def eval_record(adapter: str, base: float = 34.926, top1: float = 37.009, *,
                weights: str | None = None, digest: str | None = None) -> dict:  # fmt: skip
    """A ``focus eval`` document (the keys a card reads) of the adapter whose weights file
    has the SHA-256 ``weights`` and whose ``adapter_digest`` is ``digest`` (None: a record
    of an earlier release, without it)."""
    return {
        "ppl": {"base": base, "focus_soft": 36.142, "focus_topk": {"1": top1, "2": 35.77}},
        "pairs_retained": {"1": 0.37, "2": 0.632},
        "tokens": 4092,
        "config": {
            "adapter": adapter,
            "corpus": "austen",
            "split": "test",
            "seq_len": 1024,
            "adapter_weights_sha256": weights,
            "adapter_sha256": digest,
        },  # fmt: skip
    }


def card_of(directory: pathlib.Path) -> str:
    return (directory / CARD_NAME).read_text(encoding="utf-8")


def test_a_save_writes_a_card_with_the_settings(tmp_path):
    _, fm = focus("llama", window=8, top_k=1)
    fm.save_pretrained(tmp_path)
    card = card_of(tmp_path)
    assert card.startswith("---\n") and "library_name: focus-attention" in card
    assert CARD_MARKER in card
    assert "| window | `8` |" in card and "| top_k | `1` |" in card
    for name in INFERENCE_SETTINGS:  # every inference setting, as declared
        assert f"| {name} | `" in card, name
    assert "| dense_heads | `[]` |" in card and "| attention_backend | `auto` |" in card
    assert "llama, 2 layers, hidden size 64" in card
    assert "No training record" in card and "No `focus eval` record" in card
    assert "base_model:" not in card  # a local, unnamed base is not hub metadata


def test_the_card_reports_the_records_beside_the_adapter(tmp_path):
    run = tmp_path / "runs" / "austen"
    run.mkdir(parents=True)
    (run / "train_config.json").write_text(json.dumps(TRAIN_CONFIG))
    (run / "train_result.json").write_text(json.dumps(TRAIN_RESULT))
    (run / "broken.json").write_text("{not json")
    _, fm = focus("llama")
    fm.save_pretrained(run)
    weights = weights_file_sha256(run)
    (run / "eval.json").write_text(json.dumps(eval_record("runs/austen", weights=weights)))
    (run / "eval-4096.json").write_text(json.dumps(eval_record("runs/austen", 1.0, 2.0, weights="1" * 64)))  # fmt: skip
    (run / "eval-old.json").write_text(json.dumps(eval_record("runs/austen", 9.0, weights="0" * 64)))  # fmt: skip
    fm.save_pretrained(run)  # the card reads the records of the weights in the folder
    card = card_of(run)
    assert "base_model: org/tiny-base" in card and "Focus adapter for org/tiny-base" in card
    assert "| corpus | `austen` |" in card and "| steps | `80` |" in card
    assert "final training loss: 3.5123" in card and "val_ppl_topk at step 80: 36.142" in card
    assert "| `eval.json` | austen (test) | 1024 | 4092 | Focus top-1 | 37.009 | 0.370 |" in card
    assert "| base (dense) | 34.926 |" in card
    assert "eval-4096.json" not in card  # another adapter's evaluation (other weights)
    assert "eval-old.json" not in card  # an earlier adapter's in this folder


def _run_with_a_late_record(tmp_path) -> tuple[pathlib.Path, str]:
    """An adapter folder saved (its card written), then evaluated (a record beside it that
    names the path it was evaluated under, after the card)."""
    run = tmp_path / "runs" / "austen-4k"
    run.mkdir(parents=True)
    (run / "train_config.json").write_text(json.dumps(TRAIN_CONFIG))
    _, fm = focus("llama")
    fm.save_pretrained(run)
    assert "No `focus eval` record" in card_of(run)
    record = eval_record("runs/austen-4k", 29.484, 29.534, weights=weights_file_sha256(run),
                         digest=adapter_digest(run))  # fmt: skip
    (run / "eval-4096.json").write_text(json.dumps(record))
    return run, "| Focus top-1 | 29.534 |"


def test_a_record_written_after_the_card_reaches_it_when_refreshed(tmp_path):
    run, row = _run_with_a_late_record(tmp_path)
    assert refresh_card(run)
    card = card_of(run)
    assert row in card and "Focus adapter for org/tiny-base" in card
    assert "| window |" in card and "No `focus eval` record" not in card
    (run / CARD_NAME).write_text("# my own notes\n")  # someone's own card is kept
    assert not refresh_card(run) and card_of(run) == "# my own notes\n"
    assert not refresh_card(tmp_path)  # no adapter there


def test_the_digest_is_the_routers_and_settings_not_the_files_bytes(tmp_path):
    from tiny import build_model

    from focus_attention.hf import FocusModel

    _, fm = focus("llama")
    fm.save_pretrained(tmp_path / "a")
    loaded = FocusModel.from_pretrained(build_model("llama"), tmp_path / "a")
    for i in range(4):  # the weights file's bytes vary from save to save (its metadata's order)
        loaded.save_pretrained(tmp_path / f"b{i}")
        assert adapter_digest(tmp_path / f"b{i}") == adapter_digest(tmp_path / "a")
    loaded.focus_config = loaded.focus_config.replace(window=4)
    loaded.save_pretrained(tmp_path / "other-settings")
    assert adapter_digest(tmp_path / "other-settings") != adapter_digest(tmp_path / "a")
    assert adapter_digest(tmp_path) is None


def test_an_older_record_without_the_digest_travels_into_an_export(tmp_path):
    """A record of an earlier release (the weights file's SHA-256 only) is the adapter's in
    its folder and in a byte copy; an export, whose weights file has other bytes, carries it
    with the adapter's digest, so that the export saved again still reports it."""
    from transformers import AutoModelForCausalLM

    run, row = _run_with_a_late_record(tmp_path)
    record = json.loads((run / "eval-4096.json").read_text())
    record["config"].pop("adapter_sha256")
    (run / "eval-4096.json").write_text(json.dumps(record))
    refresh_card(run)
    assert row in card_of(run)
    from tiny import build_model

    from focus_attention.hf import FocusModel

    export_model(FocusModel.from_pretrained(build_model("llama"), run), tmp_path / "export")
    carried = json.loads((tmp_path / "export" / "eval-4096.json").read_text())
    assert carried["config"]["adapter_sha256"] == adapter_digest(run) == adapter_digest(tmp_path / "export")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True)
    model.save_pretrained(tmp_path / "again")
    assert row in card_of(tmp_path / "again")


def test_a_copied_adapter_keeps_its_records_whatever_path_it_was_evaluated_under(tmp_path):
    """The records are the adapter's by its weights' digest: a copy of the folder elsewhere
    (evaluated as runs/austen-4k, now under another name) reports them in its card, when
    saved again and when exported; the export carries them on, so a model loaded from it
    and saved again reports them too."""
    from tiny import build_model
    from transformers import AutoModelForCausalLM

    from focus_attention.hf import FocusModel

    run, row = _run_with_a_late_record(tmp_path)
    refresh_card(run)
    copy = tmp_path / "elsewhere" / "my-adapter"
    shutil.copytree(run, copy)
    assert row in card_of(copy)
    loaded = FocusModel.from_pretrained(build_model("llama"), copy)
    loaded.save_pretrained(tmp_path / "saved")
    assert row in card_of(tmp_path / "saved")
    export_model(loaded, tmp_path / "export")
    assert row in card_of(tmp_path / "export")
    assert (tmp_path / "export" / "eval-4096.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True)
    model.save_pretrained(tmp_path / "export-again")
    card = card_of(tmp_path / "export-again")
    assert row in card and "# org/tiny-base with Focus sparse attention" in card


def test_a_loaded_adapter_carries_its_records_while_its_routers_are_unchanged(tmp_path):
    from tiny import build_model

    from focus_attention.hf import FocusModel

    run = tmp_path / "run"
    _, fm = focus("llama")
    fm.save_pretrained(run)
    (run / "eval.json").write_text(json.dumps(eval_record(str(run), weights=weights_file_sha256(run))))  # fmt: skip
    loaded = FocusModel.from_pretrained(build_model("llama"), run)
    loaded.save_pretrained(tmp_path / "copy")
    assert "37.009" in card_of(tmp_path / "copy")
    export_model(loaded, tmp_path / "export")
    card = card_of(tmp_path / "export")
    assert "37.009" in card and "trust_remote_code=True" in card and "custom_code" in card
    with torch.no_grad():
        next(loaded.routers.parameters()).add_(1.0)  # other weights: the numbers are not theirs
    loaded.save_pretrained(tmp_path / "changed")
    assert "37.009" not in card_of(tmp_path / "changed")


def test_a_readme_of_someone_elses_is_left_alone(tmp_path):
    (tmp_path / CARD_NAME).write_text("# my notes\n")
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path)
    assert card_of(tmp_path) == "# my notes\n"
    (tmp_path / CARD_NAME).unlink()
    fm.save_pretrained(tmp_path, model_card=False)
    assert not (tmp_path / CARD_NAME).exists()
    fm.save_pretrained(tmp_path)
    first = card_of(tmp_path)
    fm.set_top_k(2)
    fm.save_pretrained(tmp_path)  # its own card is rewritten
    assert card_of(tmp_path) != first and "| top_k | `2` |" in card_of(tmp_path)


def test_a_save_that_fails_at_the_card_leaves_the_previous_adapter(tmp_path, monkeypatch):
    _, fm = focus("llama", top_k=1)
    fm.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == sorted([CARD_NAME, CONFIG_NAME, WEIGHTS_NAME])
    fm.set_top_k(2)
    real, calls = pathlib.Path.write_text, []

    def fail_at_the_card(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 2:  # the config, then the card
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", fail_at_the_card)
    with pytest.raises(OSError, match="No space left"):
        fm.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def code_blocks(card: str) -> str:
    return "\n".join(part.split("```", 1)[0] for part in card.split("```python")[1:])


def test_the_export_card_loads_by_what_loads_not_the_registered_name(tmp_path):
    """A registered name (``smollm2-135m``) loads through focus-attention's ``load_model``,
    not transformers'; the export's example loads the exported directory itself."""
    import re

    from transformers import AutoModelForCausalLM

    _, fm = focus("llama")
    out = export_model(fm, tmp_path / "exported", base_name="smollm2-135m")
    code = code_blocks(card_of(out))
    assert "smollm2-135m" not in code
    (target,) = set(re.findall(r'from_pretrained\("([^"]+)", trust_remote_code=True\)', code))
    model = AutoModelForCausalLM.from_pretrained(target, trust_remote_code=True)
    assert hasattr(model, "focus_model")
    assert f"transformers serve {target} --trust-remote-code" in card_of(out)
    fm.save_pretrained(tmp_path / "adapter")  # the adapter card: the base by load_model
    adapter_code = code_blocks(card_of(tmp_path / "adapter")).replace("BASE_MODEL", "x")
    assert 'from_pretrained("' not in adapter_code.split("FocusModel.from_pretrained")[0]
