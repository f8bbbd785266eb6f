"""Straight-through routing, ``FocusConfig.straight_through`` (docs/method.md §6): soft layers
attend under the hard top-k mask inference uses, and the gradient reaches the routers through
the Sinkhorn rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import ARCHS, focus, ids, left_pad, positions
from tolerances import tolerance

from focus_attention.hf import FocusConfig
from focus_attention.hf.compat import (
    activation_checkpointing_enabled,
    enable_activation_checkpointing,
)
from focus_attention.ops import straight_through
from focus_attention.training.config import TrainConfig

N = 80
# (top_k, query_top_k): symmetric top-1 and both asymmetric shapes with one group on a side
SHAPES = [(1, None), (1, 2), (2, 1)]
#: the straight-through soft path's logits against hard top-k's: not a dtype tolerance, the
#: log gate leaves eps = 1e-6 of each masked pair's weight
EPS_LEAK = {"atol": 1e-4, "rtol": 0}


def _random_bias(fm, seed: int) -> None:
    """Give every router a distinct routing_bias, so the hard groups depend on it."""
    g = torch.Generator().manual_seed(seed)
    for router in fm.routers.values():
        router.routing_bias.copy_(torch.randn(router.routing_bias.shape, generator=g))


def _logits(fm, x, **kw):
    with torch.no_grad():
        return fm(input_ids=x, use_cache=False, **kw).logits


# --- the op -------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), n=st.integers(1, 12), k=st.integers(1, 6), seed=st.integers(0, 99))
def test_straight_through_is_hard_in_value_and_soft_in_gradient(b, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    hard = torch.rand(b, n, k, generator=g) < 0.4
    soft = torch.rand(b, n, k, generator=g, dtype=torch.float64).requires_grad_()
    rows = straight_through(hard, soft)
    assert rows.dtype == torch.float64
    assert torch.equal(rows.detach(), hard.double())
    upstream = torch.randn(b, n, k, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(rows, soft, upstream)
    assert torch.equal(grad, upstream)


@pytest.mark.parametrize(
    "hard,soft,match",
    [
        (torch.ones(1, 2, 3), torch.rand(1, 2, 3), "torch.bool"),
        (torch.ones(1, 2, 3, dtype=torch.bool), torch.ones(1, 2, 3, dtype=torch.long), "floating"),
        (torch.ones(1, 2, 4, dtype=torch.bool), torch.rand(1, 2, 3), r"\[B, N, K\]"),
        (torch.ones(2, 3, dtype=torch.bool), torch.rand(2, 3), "rank 3"),
    ],
)
def test_straight_through_refuses_bad_rows(hard, soft, match):
    with pytest.raises(ValueError, match=match):
        straight_through(hard, soft)


# --- the model ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("top_k,query_top_k", SHAPES)
def test_soft_forward_is_the_top_k_model(arch, top_k, query_top_k):
    """With straight_through the soft path's logits are those of hard top-k inference (the
    log gate leaves ``eps = 1e-6`` of a masked pair's weight), with padding and sinks; without
    it they are not."""
    x, mask = left_pad([ids(1, N, seed=41)[0], ids(1, 53, seed=42)[0]])
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    cfg = dict(top_k=top_k, query_top_k=query_top_k, window=8, sink_tokens=2)
    _, fm = focus(arch, straight_through=True, **cfg)
    _random_bias(fm, seed=43)
    hard = _logits(fm.set_routing("topk"), x, **kw)
    through = _logits(fm.set_routing("soft"), x, **kw)
    real = mask.bool()
    torch.testing.assert_close(through[real], hard[real], **EPS_LEAK)
    fm.focus_config = fm.focus_config.replace(straight_through=False)
    soft = _logits(fm, x, **kw)
    assert (soft[real] - hard[real]).abs().max() > 1e-1


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_gradient_reaches_the_routers_through_the_sinkhorn_rows(arch):
    x = ids(2, N, seed=44)
    _, fm = focus(arch, straight_through=True, top_k=1, window=8, sink_tokens=2)
    _random_bias(fm, seed=45)
    fm.train()
    loss = fm(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    through = {name: p.grad.clone() for name, p in fm.named_parameters() if p.grad is not None}
    assert through and all(torch.isfinite(g).all() for g in through.values())
    assert all("routers" in name for name in through)  # the base model stays frozen
    assert any(float(g.abs().max()) > 0 for g in through.values())
    fm.zero_grad(set_to_none=True)
    fm.focus_config = fm.focus_config.replace(straight_through=False)
    fm(input_ids=x, labels=x, use_cache=False).loss.backward()
    soft = {name: p.grad for name, p in fm.named_parameters() if p.grad is not None}
    assert soft.keys() == through.keys()
    assert any(not torch.allclose(soft[n], through[n]) for n in soft)


def test_the_hard_groups_use_the_bias_before_this_batch_updates_it(monkeypatch):
    """The training forward routes with the routing_bias as it was when the batch arrived:
    the forward of a training step equals the eval model's."""
    x = ids(1, N, seed=46)
    _, fm = focus("llama", straight_through=True, top_k=1, window=8, sink_tokens=2)
    _random_bias(fm, seed=47)
    hard = _logits(fm.set_routing("topk"), x)
    fm.set_routing("auto").train()
    before = [r.routing_bias.clone() for r in fm.routers.values()]
    with torch.no_grad():
        trained = fm(input_ids=x, use_cache=False).logits
    assert any(
        not torch.equal(b, r.routing_bias) for b, r in zip(before, fm.routers.values(), strict=True)
    )
    torch.testing.assert_close(trained, hard, **EPS_LEAK)


# --- settings -----------------------------------------------------------------------------


def test_config_takes_a_bool_and_round_trips():
    cfg = FocusConfig(straight_through=True, top_k=1)
    assert FocusConfig.from_dict(cfg.to_dict()) == cfg
    assert FocusConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "straight_through"}).straight_through is False  # fmt: skip
    with pytest.raises(ValueError, match="straight_through.*True or False"):
        FocusConfig(straight_through=1)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(top_k=2), "top_k=2 and query_top_k=2"),
        (dict(top_k=2, query_top_k=3), "top_k=2 and query_top_k=3"),
        (dict(top_k=1, gate="paper"), "gate='paper'"),
    ],
)
def test_settings_it_cannot_run_with_are_refused_when_it_runs(kw, match):
    cfg = FocusConfig(straight_through=True, **kw)  # an adapter's config stays loadable
    with pytest.raises(ValueError, match=match):
        cfg.check_straight_through()
    _, fm = focus("llama", straight_through=True, window=8, **kw)
    with pytest.raises(ValueError, match=match):
        _logits(fm.set_routing("soft"), ids(1, 24, seed=48))
    with pytest.raises(ValueError, match=match):
        TrainConfig(focus=FocusConfig(straight_through=True, window=8, **kw), seq_len=64)


def test_top_k_inference_of_such_an_adapter_runs_at_any_top_k():
    _, fm = focus("llama", straight_through=True, top_k=1, window=8)
    fm.set_top_k(2)  # straight_through only matters to soft routing
    assert _logits(fm, ids(1, 24, seed=49)).isfinite().all()


def test_train_config_refuses_it_with_the_coverage_objective():
    with pytest.raises(ValueError, match="coverage"):
        TrainConfig(focus=FocusConfig(straight_through=True, top_k=1), objective="coverage")


def test_focus_train_flag_sets_it_and_refuses_two_groups_on_both_sides():
    from focus_attention.cli import build_parser
    from focus_attention.cli.train import config_from_args

    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["train", "--straight-through", "--top-k", "1"]))
    assert cfg.focus.straight_through is True and cfg.focus.top_k == 1
    cfg = config_from_args(parser.parse_args(["train", "--top-k", "1"]))
    assert cfg.focus.straight_through is False
    with pytest.raises(ValueError, match="straight_through.*top_k=2 and query_top_k=2"):
        config_from_args(parser.parse_args(["train", "--straight-through"]))


def test_train_config_refuses_it_for_methods_without_focus():
    with pytest.raises(ValueError, match="method 'lora'"):
        TrainConfig(focus=FocusConfig(straight_through=True, top_k=1), method="lora")


def test_sequence_inference_routing_is_refused():
    _, fm = focus("llama", straight_through=True, top_k=1, window=8, inference_routing="sequence")
    with pytest.raises(ValueError, match="inference_routing='sequence'"):
        _logits(fm.set_routing("soft"), ids(1, 24, seed=50))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_activation_checkpointing_gives_the_same_gradients(arch):
    """The recomputed forward routes with the bias the first forward used, not the one this
    batch's update left."""
    x = ids(2, N, seed=51)
    grads = []
    for checkpointing in (False, True):
        _, fm = focus(arch, straight_through=True, top_k=1, window=8, sink_tokens=2)
        _random_bias(fm, seed=52)
        if checkpointing:
            enable_activation_checkpointing(fm)
        fm.train()
        fm(input_ids=x, labels=x, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in fm.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, **tolerance("gradient"), msg=name)


def _accumulated_step(arch, checkpointing, backwards, **cfg):
    """Three forwards of different (left-padded) batches before one backward (or a backward
    after each, ``backwards="each"``); the routers' gradients, biases and bias counts."""
    _, fm = focus(arch, window=8, sink_tokens=2, **cfg)
    _random_bias(fm, seed=55)
    if checkpointing is not None:
        enable_activation_checkpointing(fm, use_reentrant=checkpointing == "reentrant")
        assert activation_checkpointing_enabled(fm)
    fm.train()
    losses = []
    for step in range(3):
        x, mask = left_pad([ids(1, 40 - 7 * step, seed=56 + step)[0], ids(1, 40, seed=60)[0]])
        losses.append(fm(input_ids=x, attention_mask=mask, labels=x, use_cache=False).loss)
    if backwards == "each":
        for loss in losses:
            loss.backward()
    else:
        sum(losses).backward()
    grads = {n: p.grad for n, p in fm.routers.named_parameters()}
    return grads, {n: b.clone() for n, b in fm.routers.named_buffers()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize(
    "cfg,backwards",
    [
        (dict(straight_through=True, top_k=1), "once"),
        (dict(straight_through=True, top_k=1, query_top_k=2), "each"),
        (dict(top_k=2), "once"),
    ],
    ids=["straight-through", "asymmetric-each", "soft"],
)
def test_gradient_accumulation_under_checkpointing_matches_the_plain_step(
    arch, checkpointing, cfg, backwards
):
    """Each forward's recomputation routes with the bias that forward used, however many
    forwards ran before the backward, and folds its batch into the bias once."""
    plain_grads, plain_buffers = _accumulated_step(arch, None, backwards, **cfg)
    grads, buffers = _accumulated_step(arch, checkpointing, backwards, **cfg)
    assert all(int(b) == 3 for n, b in plain_buffers.items() if n.endswith("bias_updates"))
    for name, buffer in plain_buffers.items():
        torch.testing.assert_close(buffers[name], buffer, **tolerance("bitwise"), msg=name)
    for name, grad in plain_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, **tolerance("gradient"), msg=name)


def test_routing_records_give_the_groups_the_forward_attended_with():
    x = ids(1, N, seed=53)
    _, fm = focus("llama", straight_through=True, top_k=1, query_top_k=3, window=8, sink_tokens=2)
    _random_bias(fm, seed=54)
    with torch.no_grad(), fm.record_routing() as hard_recs:
        fm.set_routing("topk")(input_ids=x, use_cache=False)
    with torch.no_grad(), fm.record_routing() as soft_recs:
        fm.set_routing("soft")(input_ids=x, use_cache=False)
    for hard, soft in zip(hard_recs, soft_recs, strict=True):
        assert bool((soft["query_groups"].sum(-1) == 3).all())
        assert torch.equal(soft["query_groups"], hard["query_groups"])
        assert torch.equal(soft["key_groups"], hard["key_groups"])
