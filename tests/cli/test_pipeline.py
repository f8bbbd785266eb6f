"""The whole pipeline on a tiny random LLaMA and a small text made here: prepare the corpus,
``focus train`` a few steps, load the adapter, ``focus eval`` (JSON and table); plus the
same on the real assets (marked ``assets``).

The tiny assets and settings come from ``tiny_assets.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_assets import (
    check_eval_schema,
    require_real_assets,
    train_config,
)


def _cli(argv: list[str]) -> int:
    from focus_attention.cli import main

    return main(argv)


def test_pipeline_cli_train_load_eval(assets, tmp_path, capsys):
    from safetensors.torch import load_file

    from focus_attention.assets.models import load_model
    from focus_attention.hf import FocusModel

    out = tmp_path / "run"
    argv = ["train", "--model", str(assets["model"]), "--corpus", str(assets["corpus"]),
            "--out", str(out), "--steps", "4", "--seq-len", "32", "--batch-size", "2",
            "--eval-every", "2", "--eval-tokens", "64", "--save-every", "2", "--threads", "1",
            "--num-groups", "4", "--top-k", "2", "--window", "8", "--group-dim", "8",
            "--sink-tokens", "1", "--lr", "0.01", "--warmup-steps", "1", "--no-progress"]  # fmt: skip
    assert _cli(argv) == 0
    for name in ("focus_config.json", "focus_model.safetensors", "log.jsonl", "train.png",
                 "train_config.json", "train_result.json"):  # fmt: skip
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all({"loss", "learning_rate", "dominance", "seconds"} <= set(r) for r in steps)
    assert [r["step"] for r in rows if "val_ppl_topk" in r] == [0, 2, 4]
    assert "val_ppl_soft" in rows[0] and "val_ppl_base" in rows[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]  # fmt: skip
    result = json.loads((out / "train_result.json").read_text())
    assert result["steps"] == 4 and result["extra"]["base_weights_sha256"]["equal"]
    assert "trained 4 steps" in capsys.readouterr().out

    # the adapter loads on a fresh base model and has the trained tensors
    base, _ = load_model(assets["model"], quiet=True)
    fm = FocusModel.from_pretrained(base, out)
    saved = load_file(str(out / "focus_model.safetensors"))
    for k, v in fm.focus_state_dict().items():
        assert torch.equal(v, saved[k])
    assert fm.focus_config.num_groups == 4 and not fm.training

    js = tmp_path / "eval.json"
    md = tmp_path / "eval.md"
    argv = ["eval", "--model", str(assets["model"]), "--adapter", str(out), "--corpus",
            str(assets["corpus"]), "--split", "test", "--json", str(js), "--markdown", str(md),
            "--max-tokens", "256", "--seq-len", "64", "--threads", "1", "--no-progress"]  # fmt: skip
    assert _cli(argv) == 0
    printed = capsys.readouterr().out
    assert "| Focus top-k | 4 |" in printed and "| base (dense) |" in printed
    assert md.read_text().strip() in printed
    ev = json.loads(js.read_text())
    check_eval_schema(ev, 4)
    assert ev["tokens"] == 4 * 63 and ev["windows"] == 4
    # top_k = K is dense causal attention: the base model's perplexity
    assert ev["ppl"]["focus_topk"]["4"] == pytest.approx(ev["ppl"]["base"], rel=1e-4)
    assert ev["pairs_retained"]["4"] == pytest.approx(1.0)
    pr = [ev["pairs_retained"][str(k)] for k in range(1, 5)]
    assert pr == sorted(pr)
    assert ev["config"]["train_config"]["steps"] == 4


def test_an_evaluated_adapter_reports_its_scores_in_its_card_and_in_copies(assets, adapter, tmp_path, capsys):  # fmt: skip
    """``focus eval --json`` into the adapter's folder: its card reports the record; a copy
    of the folder elsewhere (the record names the first path) reports it, and so does
    ``focus export`` of the copy, whose folder carries the record on."""
    import shutil

    run = tmp_path / "runs" / "tiny"
    shutil.copytree(adapter, run)
    record = run / "eval-64.json"
    argv = ["eval", "--model", str(assets["model"]), "--adapter", str(run), "--corpus",
            str(assets["corpus"]), "--split", "test", "--json", str(record), "--max-tokens",
            "128", "--seq-len", "64", "--threads", "1", "--no-progress"]  # fmt: skip
    assert _cli(argv) == 0
    assert f"model card {run / 'README.md'} now reports it" in capsys.readouterr().out
    ppl = json.loads(record.read_text())["ppl"]["focus_topk"]["2"]
    row = f"| Focus top-2 | {ppl:,.3f} |"
    assert row in (run / "README.md").read_text()
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(run, copy)
    assert row in (copy / "README.md").read_text()
    out = tmp_path / "export"
    assert _cli(["export", "--model", str(assets["model"]), "--adapter", str(copy), "--out", str(out)]) == 0  # fmt: skip
    assert row in (out / "README.md").read_text() and (out / record.name).is_file()


def test_cli_errors_are_clear(assets, tmp_path, capsys):
    # a missing adapter and an occupied output directory give one-line errors, exit 1
    assert _cli(["eval", "--model", str(assets["model"]), "--adapter", str(tmp_path)]) == 1
    assert "not a Focus adapter" in capsys.readouterr().err
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text("")  # an earlier run's log
    argv = ["train", "--model", str(assets["model"]), "--corpus", str(assets["corpus"]),
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert _cli(argv) == 1
    assert "--resume" in capsys.readouterr().err
    # an output path under a file: one line, no traceback
    (tmp_path / "afile").write_text("")
    argv[argv.index("--out") + 1] = str(tmp_path / "afile" / "sub")
    assert _cli([*argv, "--steps", "1", "--seq-len", "32", "--eval-every", "-1", "--num-groups",
                 "4", "--window", "8", "--group-dim", "8", "--threads", "1"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "focus: error: [Errno 20] Not a directory" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# real assets: smollm2-135m on austen (prepared by `focus setup`)
# --------------------------------------------------------------------------------------------


@pytest.mark.assets
@pytest.mark.slow
def test_real_smollm2_austen_train_and_eval(tmp_path):
    """A tiny real run: 3 steps of 128 tokens, then eval on 512 tokens of Persuasion."""
    require_real_assets()
    from focus_attention.evaluation import evaluate
    from focus_attention.training import train

    out = tmp_path / "austen"
    cfg = train_config(out=str(out), steps=3, seq_len=128, warmup_steps=1, eval_every=-1,
                       save_every=0, max_train_tokens=128 * 8, window=32, progress=False)  # fmt: skip
    res = train(cfg)
    assert res.steps == 3 and len(res.losses) == 3
    assert all(math.isfinite(v) and 1 < v < 8 for v in res.losses)  # nats/token
    assert res.trainable_parameters == 30 * (576 * 16 + 8 * 16)
    ev = evaluate(adapter=out, max_tokens=512, seq_len=256, progress=False).to_dict()
    check_eval_schema(ev, 8)
    assert ev["tokens"] == 2 * 255
    assert 5 < ev["ppl"]["base"] < 80  # ~30 on Persuasion
    assert ev["ppl"]["focus_topk"]["8"] == pytest.approx(ev["ppl"]["base"], rel=1e-3)
    assert ev["pairs_retained"]["8"] == pytest.approx(1.0)
    assert ev["pairs_retained"]["1"] < ev["pairs_retained"]["2"] < 1
