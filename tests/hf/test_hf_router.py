"""The router: deterministic balanced initialisation, the calibrated causal bias, routing
modes, and a check of the ops Sinkhorn padding gradient the router works around."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, build_model, focus, ids, left_pad

from focus_attention.hf import FocusConfig, FocusRouter, get_focus_model
from focus_attention.ops import dominance, sinkhorn, topk_memberships


@pytest.mark.parametrize("k,dg", [(4, 16), (8, 16), (16, 16), (32, 16)])
def test_initialisation_is_deterministic_and_balanced(k, dg):
    a = FocusRouter(64, k, dg, 0.1, layer_idx=3, seed=7)
    b = FocusRouter(64, k, dg, 0.1, layer_idx=3, seed=7)
    c = FocusRouter(64, k, dg, 0.1, layer_idx=4, seed=7)
    assert torch.equal(a.proj, b.proj) and torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.proj, c.proj)
    torch.testing.assert_close(a.proj.t() @ a.proj, torch.eye(dg), atol=1e-5, rtol=0)
    if k <= dg:  # orthonormal centroids
        gram = a.centroids @ a.centroids.t()
        torch.testing.assert_close(gram, torch.eye(k), atol=1e-5, rtol=0)
    # isotropic hidden states: every group about equally likely (1/K is perfect)
    h = torch.randn(1, 8192, 64, generator=torch.Generator().manual_seed(0))
    groups = topk_memberships(a.scores(h), 1)
    assert dominance(groups) <= (1.25 if k <= dg else 2.0) / k
    assert torch.equal(a.routing_bias, torch.zeros(k)) and int(a.bias_updates) == 0


def test_same_seed_gives_same_routers_on_the_same_model():
    one = get_focus_model(build_model("llama"), FocusConfig(num_groups=4, seed=3))
    two = get_focus_model(build_model("llama"), FocusConfig(num_groups=4, seed=3))
    for (n1, p1), (n2, p2) in zip(
        one.routers.named_parameters(), two.routers.named_parameters(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)


def test_parameter_count_per_layer():
    r = FocusRouter(768, 4, 16, 0.1, layer_idx=0)
    assert sum(p.numel() for p in r.parameters()) == 768 * 16 + 4 * 16
    assert {n for n, _ in r.named_buffers()} == {"routing_bias", "bias_updates"}


def test_causal_groups_use_the_calibrated_bias():
    r = FocusRouter(8, 4, 4, 0.1, layer_idx=0)
    scores = torch.zeros(1, 3, 4)
    assert topk_memberships(scores, 1)[0, :, 0].all()  # ties: lowest index
    with torch.no_grad():
        r.routing_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert r.causal_groups(scores, 1)[0, :, 2].all()


def test_bias_is_the_running_mean_of_sinkhorn_column_bias():
    r = FocusRouter(8, 4, 4, 0.1, layer_idx=0, bias_momentum=0.5)
    b1, b2, b3 = (torch.randn(2, 4) for _ in range(3))
    r.update_bias(b1, None)
    torch.testing.assert_close(r.routing_bias, b1.mean(0))  # first update: the mean itself
    r.update_bias(b2, None)
    torch.testing.assert_close(r.routing_bias, (b1.mean(0) + b2.mean(0)) / 2)
    real = torch.tensor([[True, True], [False, False]])
    r.update_bias(b3, real)  # the empty sequence is skipped
    want = 0.5 * (b1.mean(0) + b2.mean(0)) / 2 + 0.5 * b3[0]
    torch.testing.assert_close(r.routing_bias, want)
    assert int(r.bias_updates) == 3


def test_soft_routing_excludes_padding():
    """Padded rows equal Sinkhorn over the sequence's real tokens alone."""
    r = FocusRouter(8, 4, 4, 0.1, layer_idx=0)
    scores = torch.randn(3, 7, 4) * 5
    real = torch.ones(3, 7, dtype=torch.bool)
    real[1, :3] = False
    real[2] = False
    probs, bias = r.soft(scores, 10, real)
    for b in range(2):
        want_p, want_b = sinkhorn(scores[b : b + 1, real[b]], 10, return_column_bias=True)
        torch.testing.assert_close(probs[b][real[b]], want_p[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(bias[b], want_b[0], atol=1e-4, rtol=0)
    assert not probs[~real].any()


def test_soft_routing_gradient_is_finite_under_padding():
    r = FocusRouter(8, 4, 4, 0.1, layer_idx=0)
    h = torch.randn(2, 6, 8)
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, :2] = False
    probs, _ = r.soft(r.scores(h), 10, real)
    probs[real].pow(2).sum().backward()
    assert torch.isfinite(r.proj.grad).all() and r.proj.grad.abs().sum() > 0


def test_train_eval_and_set_routing():
    _, fm = focus("llama")
    assert fm.routing_mode == "topk"
    fm.train()
    assert fm.routing_mode == "soft"
    fm.set_routing("topk")
    assert fm.routing_mode == "topk"
    fm.set_routing("auto")
    fm.eval()
    assert fm.routing_mode == "topk"
    with pytest.raises(ValueError, match="set_routing"):
        fm.set_routing("hard")


@pytest.mark.parametrize("arch", ARCHS)
def test_bias_updates_only_in_soft_training(arch):
    _, fm = focus(arch)
    x, mask = left_pad([ids(1, 30, seed=1)[0], ids(1, 12, seed=2)[0]])
    with torch.no_grad():
        fm(input_ids=x, attention_mask=mask)  # eval: top-k, no update
        fm.set_routing("soft")
        fm(input_ids=x, attention_mask=mask)  # eval + soft: no update either
    assert all(int(r.bias_updates) == 0 for r in fm.routers.values())
    fm.set_routing("auto")
    fm.train()
    fm(input_ids=x, attention_mask=mask, use_cache=False)
    for r in fm.routers.values():
        assert int(r.bias_updates) == 1 and r.routing_bias.abs().sum() > 0
        torch.testing.assert_close(r.routing_bias.sum(), torch.tensor(0.0), atol=1e-4, rtol=0)


def test_calibrate_balances_causal_routing():
    """calibrate() feeds soft batches into the bias: the causal top-k groups of the
    calibration text become more balanced than at initialisation."""
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(4, 128, seed=3)

    def worst():
        with torch.no_grad(), fm.record_routing() as rec:
            fm(input_ids=x, use_cache=False)
        return max(dominance(r["query_groups"]) for r in rec)

    before = worst()
    for _ in range(3):
        fm.calibrate(x)
    after = worst()
    assert fm.routing_mode == "topk" and not fm.training
    assert after <= before + 1e-6 and after < 0.5, (before, after)


def test_topk_of_scores_plus_column_bias_is_topk_of_sinkhorn_rows():
    """What inference_routing="sequence" relies on (ops sinkhorn docstring)."""
    r = FocusRouter(8, 6, 4, 0.1, layer_idx=0)
    scores = torch.randn(2, 50, 6, generator=torch.Generator().manual_seed(1)) * 4
    probs, bias = r.soft(scores, 10, None)
    for k in (1, 2, 3):
        assert torch.equal(
            topk_memberships(probs, k), topk_memberships(scores + bias[:, None, :], k)
        )


def test_topk_groups_are_the_causal_groups_of_the_scores(kernel_built):
    """The router's one-call routing (fused on the CPU for a decoding step) gives the
    groups of causal_groups(scores(hidden)) for one token, a few and many."""
    router = FocusRouter(48, 8, 16, 0.1, layer_idx=2, seed=5)
    with torch.no_grad():
        router.routing_bias.copy_(0.2 * torch.randn(8, generator=torch.Generator().manual_seed(4)))
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 64):
        hidden = 3 * torch.randn(2, n, 48, generator=gen)
        for top_k in (1, 2):
            with torch.no_grad():
                got = router.topk_groups(hidden, top_k)
                scores = router.scores(hidden) + router.routing_bias
                expected = router.causal_groups(router.scores(hidden), top_k)
            ordered = scores.sort(dim=-1, descending=True).values
            clear = (ordered[..., top_k - 1] - ordered[..., top_k]) > 1e-3
            assert clear.float().mean() > 0.5
            assert torch.equal(got[clear], expected[clear])
