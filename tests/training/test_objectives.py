"""Training objectives (docs/method.md §6, "Objectives"): the dense recorder, distillation,
attention coverage and their use in ``focus train``."""

from __future__ import annotations

import copy
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
from focus_attention.training import TrainConfig, objectives, train
from focus_attention.training.objectives import (
    attention_step,
    coverage_rows,
    coverage_step,
    distill_step,
    lm_step,
    ranking_step,
    row_weights,
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


def _step_twice(step_fn):
    """A fresh query-key ``fm`` and ``(fm, first step, the same batch's loss after one Adam
    step)`` of ``step_fn(fm, x, queries, generator)``; checks that the gradient reaches the
    centroids only (every one) and that the base model does not change."""
    _, fm = focus("llama", window=4, num_groups=4, top_k=1, router_input="query_key")
    fm.train()
    base = {n: p.clone() for n, p in fm.base_model.named_parameters()}
    x = ids(2, 40, seed=4)
    first = step_fn(fm, x, 16, torch.Generator().manual_seed(0))
    first.loss.backward()
    names = [n for n, p in fm.named_parameters() if p.grad is not None]
    assert names == [f"routers.{i}.centroids" for i in fm.routers]
    assert all(float(fm.get_parameter(n).grad.abs().sum()) > 0 for n in names)
    torch.optim.Adam([p for p in fm.parameters() if p.requires_grad], lr=0.05).step()
    again = float(step_fn(fm, x, 16, torch.Generator().manual_seed(0)).loss)
    assert all(torch.equal(p, base[n]) for n, p in fm.base_model.named_parameters())
    return fm, first, again


def test_attention_step_lowers_its_loss_and_trains_only_the_centroids():
    fm, first, again = _step_twice(attention_step)
    assert first.metrics["attention_queries"] > 0 and first.metrics["loss"] > 0
    assert all(float(r.key_mean.abs().sum()) > 0 for r in fm.routers.values())
    assert again < float(first.loss)  # the same batch: key_mean unchanged


def test_key_side_gradient_reaches_the_centroids():
    _, fm = focus("llama", window=4, num_groups=4, top_k=1, router_input="query_key")
    for r in fm.routers.values():  # the query side without gradient: only the keys carry it
        r.query_scores = lambda q, f=r.query_scores: f(q).detach()
    attention_step(fm, ids(2, 40, seed=4), 16, torch.Generator().manual_seed(0)).loss.backward()
    assert all(float(r.centroids.grad.abs().sum()) > 0 for r in fm.routers.values())


def test_query_key_coverage_trains_the_centroids_and_balances_the_keys():
    """``--objective coverage`` of query-key routers: a kept share in (0, 1), gradients on
    the centroids only, and one fold of the keys' mean and Sinkhorn column bias."""
    _, fm = focus("llama", window=4, num_groups=4, top_k=1, router_input="query_key")
    fm.train()
    step = coverage_step(fm, ids(2, 40, seed=4), 16, torch.Generator().manual_seed(0))
    m = step.metrics
    assert 0 < m["coverage_soft"] < 1 and 0 < m["coverage_topk"] < 1 and m["distant_mass"] > 0
    assert m["loss"] == pytest.approx(1 - m["coverage_soft"]) and step.records == []
    step.loss.backward()
    names = [n for n, p in fm.named_parameters() if p.grad is not None]
    assert names == [f"routers.{i}.centroids" for i in fm.routers]
    for r in fm.routers.values():
        assert int(r.bias_updates) == 1 and float(r.routing_bias.abs().sum()) > 0
        assert float(r.key_mean.abs().sum()) > 0


def test_ranking_step_lowers_its_loss_balances_the_keys_and_trains_only_the_centroids():
    """``--objective ranking``: a positive KL and a top-k share in (0, 1), gradients on the
    centroids only, one fold of the keys' mean and Sinkhorn column bias per step (two after
    the second), a lower loss on the same batch after a step, the base model untouched."""
    fm, first, again = _step_twice(ranking_step)
    assert first.metrics["loss"] > 0 and 0 < first.metrics["coverage_topk"] < 1
    for r in fm.routers.values():
        assert int(r.bias_updates) == 2 and float(r.routing_bias.abs().sum()) > 0
        assert float(r.key_mean.abs().sum()) > 0
    assert again < float(first.loss)


def test_ranking_with_one_group_has_nothing_to_order():
    """One group holds every key: the target is that group alone, the router's softmax over
    one group matches it (KL 0) and top-k routing keeps the whole distant mass."""
    _, fm = focus("llama", window=4, num_groups=1, top_k=1, router_input="query_key")
    m = ranking_step(fm, ids(2, 40, seed=4), 16, torch.Generator().manual_seed(0)).metrics
    assert m["loss"] == pytest.approx(0.0, abs=1e-6)
    assert m["coverage_topk"] == pytest.approx(1.0)


def test_query_key_coverage_keeps_everything_with_one_group():
    """One group holds every key: soft and top-k routing keep the whole distant mass."""
    _, fm = focus("llama", window=4, num_groups=1, top_k=1, router_input="query_key")
    m = coverage_step(fm, ids(2, 40, seed=4), 16, torch.Generator().manual_seed(0)).metrics
    assert m["coverage_soft"] == pytest.approx(1.0) and m["coverage_topk"] == pytest.approx(1.0)


def test_query_key_hard_coverage_is_the_mass_of_shared_groups():
    """``coverage_topk`` is the distant mass (maximum over each key-value head's query heads)
    on the pairs whose query and key share a top-k group of that head, computed here from
    the recorded layers with a direct loop over pairs."""
    _, fm = focus("llama", window=4, num_groups=3, top_k=1, router_input="query_key")
    x, rows = ids(1, 24, seed=5), torch.arange(4, 24)
    with torch.no_grad(), fm.record_dense_attention() as records:
        fm(input_ids=x, use_cache=False)
    shares = []
    for rec in records:
        router = fm.routers[str(rec["layer"])]
        d = distant_attention(rec["query"], rec["key"], 4, scale=rec["scale"], per_kv_head=True,
                              always_visible=rec["sinks"], rows=rows)  # fmt: skip
        keys = router.key_scores(rec["pre_rotary_key"]).argmax(-1)[0]  # [N, H_kv]
        queries = router.query_scores(rec["pre_rotary_query"]).argmax(-1)[0]
        kept = sum(float(d[0, h, r, j]) for h in range(d.shape[1]) for r, i in enumerate(rows)
                   for j in range(24) if keys[j, h] == queries[i, h])  # fmt: skip
        shares.append(kept / float(d.sum()))
    m = coverage_step(fm, x, 0, torch.Generator()).metrics
    assert m["coverage_topk"] == pytest.approx(sum(shares) / len(shares), rel=1e-5)


def test_balanced_keys_share_the_real_keys_equally():
    """Sinkhorn over each key-value head's keys: real rows sum to 1, every group holds about
    1/K of the real keys, padding rows are zero, and the rows are the softmax of the scores
    without the routing bias plus the returned column bias."""
    _, fm = focus("llama", window=4, num_groups=4, top_k=1, router_input="query_key")
    router = next(iter(fm.routers.values()))
    router.routing_bias.normal_()  # the balance does not depend on an earlier bias
    key = torch.randn(2, router.num_kv_heads, 30, router.head_dim) * 3
    real = torch.ones(2, 30, dtype=torch.bool)
    real[1, :6] = False
    probs, bias = router.balanced_keys(router.key_scores(key), 30, real)
    heads = router.num_kv_heads
    assert probs.shape == (2, 30, heads, 4) and bias.shape == (2, heads, 4)
    torch.testing.assert_close(probs[real].sum(-1), torch.ones(54, router.num_kv_heads))
    assert float(probs[~real].abs().sum()) == 0
    for b, n in ((0, 30), (1, 24)):
        torch.testing.assert_close(probs[b].sum(0), torch.full((router.num_kv_heads, 4), n / 4),
                                   atol=0.05, rtol=0)  # fmt: skip
    plain = router.key_scores(key) - router.routing_bias
    want = torch.softmax(plain + bias[:, None], dim=-1)
    torch.testing.assert_close(probs[real], want[real])


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


def test_row_weights_weigh_the_last_queries():
    rows = torch.tensor([4, 10, 36, 37, 39])
    assert row_weights(rows, 40, 3, 5.0)[:, 0].tolist() == [1, 1, 1, 5, 5]
    assert row_weights(rows, 40, 0, 5.0)[:, 0].tolist() == [1] * 5
    assert row_weights(rows, 40, 3, 5.0).shape == (5, 1)


@pytest.mark.parametrize(
    ("router_input", "step"),
    [
        ("hidden_state", coverage_step),
        ("query_key", coverage_step),
        ("query_key", attention_step),
        ("query_key", ranking_step),
    ],
    ids=["coverage-hidden_state", "coverage-query_key", "attention-query_key", "ranking-query_key"],
)
def test_question_weight_scales_the_question_rows(monkeypatch, router_input, step):
    """The objectives weigh the question's rows (the last ``tail`` queries) by
    ``question_weight``: weight 0 gives the loss of the other rows alone, and a huge weight
    that of the question rows alone, each scored on a fresh copy of the same routers."""
    _, fm = focus("llama", window=4, num_groups=4, top_k=1, router_input=router_input)
    x, book, question = ids(2, 40, seed=4), torch.tensor([6, 11, 20, 29]), torch.arange(37, 40)

    def loss(rows, weight):
        monkeypatch.setattr(objectives, "coverage_rows", lambda *a, **k: rows)
        return float(step(copy.deepcopy(fm), x, 4, torch.Generator(), 3, weight).loss.detach())

    both = torch.cat([book, question])
    assert loss(both, 0.0) == pytest.approx(loss(book, 1.0), rel=1e-5)
    assert loss(both, 1e7) == pytest.approx(loss(question, 1.0), rel=1e-4)
    assert loss(both, 1.0) != pytest.approx(loss(both, 4.0), rel=1e-4)


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
    "objective",
    ["distill", pytest.param("mix", marks=pytest.mark.slow), "coverage", "attention", "ranking"],
)
def test_train_with_objective_logs_its_terms_and_resumes_exactly(assets, tmp_path, objective):
    qk = {"router_input": "query_key"} if objective in ("attention", "ranking") else {}
    cfg = tiny_config(assets, tmp_path / "full", objective=objective, steps=4,
                      coverage_queries=8, save_every=2, eval_every=-1, **qk)  # fmt: skip
    full = train(cfg)
    log = [json.loads(line) for line in (full.out / "log.jsonl").read_text().splitlines()]
    keys = {"distill": "distill_kl", "mix": "lm_loss", "coverage": "coverage_topk",
            "attention": "attention_queries", "ranking": "coverage_topk"}  # fmt: skip
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


@pytest.mark.parametrize("objective", ["attention", "coverage"])
def test_query_key_routers_validate_at_top_k(assets, tmp_path, objective):
    """Query-key routers have no soft routing: validation scores them at hard top-k; the
    coverage objective logs its top-k share and saves the balancing bias."""
    cfg = tiny_config(assets, tmp_path / "qk", objective=objective, steps=2, coverage_queries=8,
                      eval_every=1, router_input="query_key")  # fmt: skip
    out = train(cfg).out
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    validated = [r for r in log if "val_ppl_topk" in r]
    assert validated and all(math.isfinite(r["val_ppl_topk"]) for r in validated)
    assert not any("val_ppl_soft" in r for r in log)
    if objective == "coverage":
        assert all("coverage_topk" in r for r in log if "loss" in r)
        saved = load_file(str(out / "focus_model.safetensors"))
        biases = [t for name, t in saved.items() if name.endswith("routing_bias")]
        assert biases and all(float(t.abs().sum()) > 0 for t in biases)


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
    with pytest.raises(ValueError, match="question_weight.*retrieval-blocks"):
        TrainConfig(question_weight=4.0, objective="coverage")
    with pytest.raises(ValueError, match="question_weight.*coverage, attention or ranking"):
        TrainConfig(question_weight=4.0, retrieval_blocks=2)
    with pytest.raises(ValueError, match="question_weight"):
        TrainConfig(question_weight=0.0, retrieval_blocks=2, objective="coverage")
    assert TrainConfig(question_weight=4.0, retrieval_blocks=2, objective="coverage")
    for objective in ("attention", "ranking"):
        with pytest.raises(
            ValueError, match=f"objective.*{objective}.*router_input is 'query_key'"
        ):
            TrainConfig(objective=objective)
    with pytest.raises(
        ValueError, match="focus.router_input.*--objective attention, coverage or ranking"
    ):
        TrainConfig(focus=FocusConfig(router_input="query_key"))
    assert TrainConfig(focus=FocusConfig(router_input="query_key"), objective="coverage")
