"""Training objectives (docs/method.md §6, "Objectives"): the dense recorder, distillation,
attention coverage and their use in ``focus train``."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from tiny import focus, ids
from tiny_assets import tiny_config
from tolerances import tolerance

from focus_attention.hf import FocusConfig
from focus_attention.ops.coverage import distant_attention
from focus_attention.training import TrainConfig, train
from focus_attention.training.objectives import (
    attention_step,
    coverage_rows,
    coverage_step,
    distill_step,
    lm_step,
)


def test_record_dense_attention_is_the_base_model_and_records_every_focus_layer():
    _, fm = focus("llama", window=4, num_groups=3, top_k=1)
    x = ids(2, 24, seed=1)
    with torch.no_grad(), fm.disable_focus():
        want = fm(input_ids=x, use_cache=False).logits
    with torch.no_grad(), fm.record_dense_attention() as records:
        got = fm(input_ids=x, use_cache=False).logits
    torch.testing.assert_close(got, want, **tolerance("bitwise"))
    assert [r["layer"] for r in records] == fm.focus_layers
    cfg = fm.base_model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    for r in records:
        assert r["hidden"].shape == (2, 24, cfg.hidden_size)
        assert r["query"].shape == (2, heads, 24, head_dim)
        assert r["key"].shape == (2, kv, 24, head_dim)
        assert not r["query"].requires_grad
    # the recorded inputs reproduce the model's own attention: the distant mass is a share
    d = distant_attention(records[0]["query"], records[0]["key"], 4, scale=records[0]["scale"])
    assert torch.all(d.sum(-1) <= 1 + 1e-6) and float(d.sum()) > 0


def test_record_dense_attention_refuses_a_cache():
    _, fm = focus("llama", window=4, num_groups=3)
    with torch.no_grad(), fm.record_dense_attention(), pytest.raises(ValueError, match="use_cache"):
        fm(input_ids=ids(1, 8), use_cache=True)
    assert fm._runtime.current("dense_recorder") is None  # restored on exit


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_distillation_is_zero_when_focus_equals_dense(arch):
    """With a window covering the block, every pair is local: the Focus model is the dense
    model, so the KL term vanishes (up to rounding) and the mix equals the LM loss."""
    _, fm = focus(arch, window=64, num_groups=3, top_k=1)
    fm.train()
    x = ids(1, 20, seed=2)
    step = distill_step(fm, x, 0.0, 1.0)
    assert abs(step.metrics["distill_kl"]) < 1e-6
    mixed = distill_step(fm, x, 1.0, 0.5)
    assert mixed.metrics["loss"] == pytest.approx(lm_step(fm, x).metrics["loss"], abs=1e-5)


def test_distillation_is_positive_and_trains_only_the_routers():
    _, fm = focus("llama", window=2, num_groups=4, top_k=1)
    fm.train()
    step = distill_step(fm, ids(2, 32, seed=3), 0.0, 1.0)
    assert step.metrics["distill_kl"] > 0
    step.loss.backward()
    grads = {n: p.grad for n, p in fm.named_parameters() if p.grad is not None}
    assert grads and all(n.startswith("routers.") for n in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads.values())


def test_coverage_step_trains_the_routers_and_updates_the_bias():
    _, fm = focus("llama", window=3, num_groups=4, top_k=2)
    fm.train()
    before = {i: r.bias_updates.clone() for i, r in fm.routers.items()}
    step = coverage_step(fm, ids(2, 40, seed=4), 16, torch.Generator().manual_seed(0))
    m = step.metrics
    assert 0 < m["coverage_soft"] < 1 and 0 < m["coverage_topk"] <= 1
    assert m["loss"] == pytest.approx(1 - m["coverage_soft"])
    assert len(step.records) == len(fm.focus_layers)
    step.loss.backward()
    names = [n for n, p in fm.named_parameters() if p.grad is not None]
    assert names and all(n.startswith("routers.") for n in names)
    for i, r in fm.routers.items():
        assert int(r.bias_updates) == int(before[i]) + 1


def test_attention_step_lowers_its_loss_and_trains_only_the_centroids():
    _, fm = focus("llama", window=4, num_groups=4, top_k=1, router_input="query_key")
    fm.train()
    base = {n: p.clone() for n, p in fm.base_model.named_parameters()}
    x = ids(2, 40, seed=4)

    def step():
        return attention_step(fm, x, 16, torch.Generator().manual_seed(0))

    first = step()  # the first batch also sets key_mean to its mean key
    assert first.metrics["attention_queries"] > 0 and first.metrics["loss"] > 0
    assert all(float(r.key_mean.abs().sum()) > 0 for r in fm.routers.values())
    optimiser = torch.optim.Adam([p for p in fm.parameters() if p.requires_grad], lr=0.05)
    first.loss.backward()
    names = [n for n, p in fm.named_parameters() if p.grad is not None]
    assert names == [f"routers.{i}.centroids" for i in fm.routers]
    assert all(float(fm.get_parameter(n).grad.abs().sum()) > 0 for n in names)
    optimiser.step()
    assert float(step().loss) < float(first.loss)  # the same batch: key_mean unchanged
    assert all(torch.equal(p, base[n]) for n, p in fm.base_model.named_parameters())


def test_key_side_gradient_reaches_the_centroids():
    _, fm = focus("llama", window=4, num_groups=4, top_k=1, router_input="query_key")
    for r in fm.routers.values():  # the query side without gradient: only the keys carry it
        r.query_scores = lambda q, f=r.query_scores: f(q).detach()
    attention_step(fm, ids(2, 40, seed=4), 16, torch.Generator().manual_seed(0)).loss.backward()
    assert all(float(r.centroids.grad.abs().sum()) > 0 for r in fm.routers.values())


def test_coverage_rows_sample_queries_with_distant_keys():
    g = torch.Generator().manual_seed(1)
    rows = coverage_rows(100, 10, 20, g)
    assert rows.numel() == 20 and bool((rows >= 10).all()) and bool((rows < 100).all())
    assert torch.equal(rows, rows.sort().values) and rows.unique().numel() == 20
    again = coverage_rows(100, 10, 20, torch.Generator().manual_seed(1))
    assert torch.equal(rows, again)
    assert torch.equal(coverage_rows(12, 10, 0, g), torch.tensor([10, 11]))
    assert torch.equal(coverage_rows(12, 10, 50, g), torch.tensor([10, 11]))


def test_coverage_rows_add_the_last_queries():
    """With ``tail`` the last queries (a needle prompt's question) are always scored, beside
    the same random sample."""
    plain = coverage_rows(100, 10, 20, torch.Generator().manual_seed(1))
    rows = coverage_rows(100, 10, 20, torch.Generator().manual_seed(1), tail=16)
    assert set(range(84, 100)) <= set(rows.tolist()) and set(plain.tolist()) <= set(rows.tolist())
    assert torch.equal(rows, rows.unique()) and len(rows) == len(set(plain.tolist()) | set(range(84, 100)))  # fmt: skip
    assert torch.equal(coverage_rows(12, 10, 0, torch.Generator(), tail=16), torch.tensor([10, 11]))


def test_retrieval_blocks_join_the_training_blocks(assets, tmp_path):
    """``retrieval_blocks`` needle prompts join the corpus blocks (and the data fingerprint
    a resume checks); training on them with the coverage objective runs."""
    runs = {n: train(tiny_config(assets, tmp_path / f"r{n}", objective="coverage", steps=1,
                                 seq_len=64, eval_every=-1, coverage_queries=4,
                                 retrieval_blocks=n))
            for n in (0, 3)}  # fmt: skip
    blocks = {n: r.extra["train_blocks"] for n, r in runs.items()}
    assert blocks[3] == blocks[0] + 3
    assert runs[3].extra["data"] != runs[0].extra["data"]
    assert all(math.isfinite(loss) for loss in runs[3].losses)


@pytest.mark.parametrize(
    "objective", ["distill", pytest.param("mix", marks=pytest.mark.slow), "coverage", "attention"]
)
def test_train_with_objective_logs_its_terms_and_resumes_exactly(assets, tmp_path, objective):
    qk = {"router_input": "query_key"} if objective == "attention" else {}
    cfg = tiny_config(assets, tmp_path / "full", objective=objective, steps=4,
                      coverage_queries=8, save_every=2, eval_every=-1, **qk)  # fmt: skip
    full = train(cfg)
    log = [json.loads(line) for line in (full.out / "log.jsonl").read_text().splitlines()]
    keys = {"distill": "distill_kl", "mix": "lm_loss", "coverage": "coverage_topk",
            "attention": "attention_queries"}  # fmt: skip
    assert all(keys[objective] in r for r in log if "loss" in r)
    half = tiny_config(assets, tmp_path / "half", objective=objective, steps=4,
                       coverage_queries=8, save_every=2, eval_every=-1, **qk)  # fmt: skip
    ckpt_steps = 2

    def stop(step, rec):
        if step == ckpt_steps:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the step is checkpointed

    with pytest.raises(KeyboardInterrupt):
        train(half, callback=stop)
    resumed = train(TrainConfig.from_dict({**half.to_dict(), "resume": True}))
    assert resumed.losses == full.losses[ckpt_steps:]
    a = load_file(str(full.out / "focus_model.safetensors"))
    b = load_file(str(resumed.out / "focus_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_query_key_routers_validate_at_top_k(assets, tmp_path):
    """Query-key routers have no soft routing: validation scores them at hard top-k."""
    cfg = tiny_config(assets, tmp_path / "qk", objective="attention", steps=2, coverage_queries=8,
                      eval_every=1, router_input="query_key")  # fmt: skip
    log = [json.loads(line) for line in (train(cfg).out / "log.jsonl").read_text().splitlines()]
    validated = [r for r in log if "val_ppl_topk" in r]
    assert validated and all(math.isfinite(r["val_ppl_topk"]) for r in validated)
    assert not any("val_ppl_soft" in r for r in log)


def test_objective_setting_errors():
    with pytest.raises(ValueError, match="objective"):
        TrainConfig(objective="kl")
    with pytest.raises(ValueError, match="coverage_queries"):
        TrainConfig(coverage_queries=-1)
    with pytest.raises(ValueError, match="retrieval_blocks"):
        TrainConfig(retrieval_blocks=-1)
    with pytest.raises(ValueError, match="retrieval_blocks.*head-gates"):
        TrainConfig(method="head-gates", objective="distill", init_adapter="a", retrieval_blocks=2)
    with pytest.raises(ValueError, match="distill_weight"):
        TrainConfig(distill_weight=-0.5)
    with pytest.raises(ValueError, match="router_input is 'query_key'"):
        TrainConfig(objective="attention")
    with pytest.raises(ValueError, match="focus.router_input.*--objective attention"):
        TrainConfig(focus=FocusConfig(router_input="query_key"))
