"""A Focus model trained by ``transformers.Trainer`` with default arguments: only the routers
change, ``save_model`` and every checkpoint are Focus adapters that ``from_pretrained`` loads,
and ``resume_from_checkpoint`` continues the run exactly."""

from __future__ import annotations

import pytest
import torch
from tiny import FOCUS_DEFAULTS, build_model, ids
from tolerances import tolerance

from focus_attention.hf import FocusConfig, FocusModel, get_focus_model

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
from transformers import Trainer, TrainingArguments  # noqa: E402


def rows(n: int = 8, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """A dataset as a user would build one: rows of input_ids, attention_mask, labels."""
    x = ids(n, length, seed=21)
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in x]


def tied_focus_model(seed: int = 0) -> FocusModel:
    base = build_model("llama", seed=seed, tie_word_embeddings=True)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    return get_focus_model(base, FocusConfig(**FOCUS_DEFAULTS))


def trainer(model, out, **args) -> Trainer:
    settings = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    settings.update(args)
    return Trainer(model=model, args=TrainingArguments(**settings), train_dataset=rows())


def routers(model: FocusModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.routers.state_dict().items()}


def test_trainer_with_default_arguments_trains_only_the_routers(tmp_path):
    fm = tied_focus_model()
    base_before = {k: v.clone() for k, v in fm.base_model.state_dict().items()}
    routers_before = routers(fm)
    trainer(fm, tmp_path).train()
    after = routers(fm)
    assert not torch.equal(after["0.centroids"], routers_before["0.centroids"])
    assert int(after["0.bias_updates"]) > 0  # soft routing ran and fed the routing bias
    for k, v in fm.base_model.state_dict().items():
        assert torch.equal(v, base_before[k]), k


def test_save_model_and_checkpoints_are_focus_adapters(tmp_path):
    fm = tied_focus_model()
    run = trainer(fm, tmp_path / "run")
    run.train()
    run.save_model(str(tmp_path / "final"))
    trained = routers(fm)
    final = FocusModel.from_pretrained(
        build_model("llama", tie_word_embeddings=True), tmp_path / "final"
    )
    for k, v in routers(final).items():
        assert torch.equal(v, trained[k]), k
    assert final.focus_config == fm.focus_config
    for step in (2, 4):
        folder = tmp_path / "run" / f"checkpoint-{step}"
        loaded = FocusModel.from_pretrained(build_model("llama", tie_word_embeddings=True), folder)
        assert set(routers(loaded)) == set(trained)
    # the saved adapter can be re-saved in the adapter layout and loads to the same routers
    final.save_pretrained(tmp_path / "adapter")
    again = FocusModel.from_pretrained(
        build_model("llama", tie_word_embeddings=True), tmp_path / "adapter"
    )
    assert all(torch.equal(v, trained[k]) for k, v in routers(again).items())


def test_resume_from_checkpoint_continues_the_run_exactly(tmp_path):
    straight = tied_focus_model()
    trainer(straight, tmp_path / "straight").train()
    resumed = tied_focus_model()  # fresh routers: everything comes from the checkpoint
    trainer(resumed, tmp_path / "resumed").train(
        resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2")
    )
    expected = routers(straight)
    for k, v in routers(resumed).items():
        torch.testing.assert_close(v, expected[k], **tolerance("rounding"))


def test_trainer_evaluation_reports_a_loss(tmp_path):
    fm = tied_focus_model()
    run = trainer(fm, tmp_path)
    metrics = run.evaluate(eval_dataset=rows(4))
    assert metrics["eval_loss"] > 0 and torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_trainer_with_bf16_mixed_precision_keeps_the_routers_float32(tmp_path):
    fm = tied_focus_model()
    before = routers(fm)
    trainer(fm, tmp_path, bf16=True, max_steps=2).train()
    after = routers(fm)
    assert all(v.dtype == before[k].dtype for k, v in after.items())
    assert not torch.equal(after["0.centroids"], before["0.centroids"])
