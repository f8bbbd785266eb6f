"""The router: deterministic balanced initialisation, the calibrated causal bias, routing
modes, and a check of the ops Sinkhorn padding gradient the router works around."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
from tiny import ARCHS, build_model, focus, ids, left_pad
from tolerances import tolerance

from focus_attention.hf import FocusConfig, FocusRouter, get_focus_model
from focus_attention.hf.router import checks_nan, local_statistics
from focus_attention.ops import dominance, sinkhorn, topk_memberships
from focus_attention.training.distributed import end_process_group


@pytest.mark.parametrize("k,dg", [(4, 16), (8, 16), (16, 16), (32, 16)])
def test_initialisation_is_deterministic_and_balanced(k, dg):
    a = FocusRouter(64, k, dg, 0.1, layer_idx=3, seed=7)
    b = FocusRouter(64, k, dg, 0.1, layer_idx=3, seed=7)
    c = FocusRouter(64, k, dg, 0.1, layer_idx=4, seed=7)
    assert torch.equal(a.proj, b.proj) and torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.proj, c.proj)
    torch.testing.assert_close(a.proj.t() @ a.proj, torch.eye(dg), **tolerance("oracle"))
    if k <= dg:  # orthonormal centroids
        gram = a.centroids @ a.centroids.t()
        torch.testing.assert_close(gram, torch.eye(k), **tolerance("oracle"))
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
        torch.testing.assert_close(probs[b][real[b]], want_p[0], **tolerance("oracle"))
        torch.testing.assert_close(bias[b], want_b[0], **tolerance("log"))
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
        torch.testing.assert_close(r.routing_bias.sum(), torch.tensor(0.0), **tolerance("log"))


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


# --------------------------------------------------------------------------------------------
# data parallelism: the routers combine the ranks' routing statistics themselves
# --------------------------------------------------------------------------------------------

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: a rank waiting for the other fails after this instead of gloo's 30 minutes
GROUP_TIMEOUT = datetime.timedelta(minutes=3)


def _join(rank: int, port: int) -> None:
    """The environment ``torchrun`` gives a rank (Trainer and accelerate read it); the
    routing statistics do not depend on the compiled CPU kernel, so none is built."""
    os.environ.update(FOCUS_NO_EXTENSION="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))  # fmt: skip
    torch.set_num_threads(1)


def _column_biases(rank: int, call: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s ``call``-th batch of column biases ``[B, 4]``: batch sizes differ by
    rank, and rank 1's second batch is padding only."""
    gen = torch.Generator().manual_seed(100 * rank + call)
    bias = torch.randn(2 + rank, 4, generator=gen)
    real = torch.ones(2 + rank, 5, dtype=torch.bool)
    if rank == 1 and call == 1:
        real[:] = False
    return bias, real


def _update_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    _join(rank, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=GROUP_TIMEOUT)
    router = FocusRouter(8, 4, 4, 0.1, layer_idx=0, bias_momentum=0.3)
    for call in range(4):
        router.update_bias(*_column_biases(rank, call))
    local = FocusRouter(8, 4, 4, 0.1, layer_idx=0, bias_momentum=0.3)
    with local_statistics([local]):
        local.update_bias(*_column_biases(rank, 0))
    torch.save({"bias": router.routing_bias, "updates": router.bias_updates,
                "local": local.routing_bias}, f"{out}/rank{rank}.pt")  # fmt: skip
    assert end_process_group()


def _spawn(fn, tmp_path, *args) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(_free_port(), str(tmp_path), *args), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
def test_ranks_fold_every_ranks_batches_in_rank_order(tmp_path):
    """Two gloo ranks end with the bias and count of one router folding, call by call,
    rank 0's batch then rank 1's (a padding-only batch skipped), bit for bit; inside
    local_statistics a rank folds its own batch only."""
    ranks = _spawn(_update_worker, tmp_path)
    one = FocusRouter(8, 4, 4, 0.1, layer_idx=0, bias_momentum=0.3)
    for call in range(4):
        for rank in range(WORLD):
            one.update_bias(*_column_biases(rank, call))
    for got in ranks:
        assert torch.equal(got["bias"], one.routing_bias)
        assert int(got["updates"]) == int(one.bias_updates) == 7
    for rank, got in enumerate(ranks):
        assert torch.equal(got["local"], _column_biases(rank, 0)[0].mean(0))


STEPS, MICRO = 3, 2  # optimizer steps; blocks per micro-batch


def _blocks() -> torch.Tensor:
    """``STEPS * WORLD`` micro-batches of ``MICRO`` blocks of 32 tokens, in training order."""
    return ids(STEPS * WORLD * MICRO, 32, seed=5)


def _trained_routers(fm) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in fm.routers.state_dict().items()}


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """Plain DDP with its defaults (``broadcast_buffers=True``) and AdamW: rank ``r`` trains
    on micro-batch ``step * WORLD + r`` of :func:`_blocks`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _join(rank, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=GROUP_TIMEOUT)
    _, fm = focus("llama")
    fm.train()
    ddp = DistributedDataParallel(fm)
    opt = torch.optim.AdamW([p for p in fm.parameters() if p.requires_grad], lr=1e-2)
    micro = _blocks().split(MICRO)
    for step in range(STEPS):
        x = micro[step * WORLD + rank]
        ddp(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    torch.save(_trained_routers(fm), f"{out}/rank{rank}.pt")
    assert end_process_group()


def _accumulated_run() -> dict[str, torch.Tensor]:
    """One process, AdamW, ``WORLD`` micro-batches accumulated per step (loss / WORLD)."""
    _, fm = focus("llama")
    fm.train()
    opt = torch.optim.AdamW([p for p in fm.parameters() if p.requires_grad], lr=1e-2)
    micro = _blocks().split(MICRO)
    for step in range(STEPS):
        for m in range(WORLD):
            x = micro[step * WORLD + m]
            (fm(input_ids=x, labels=x, use_cache=False).loss / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return _trained_routers(fm)


def _assert_one_process(ranks: list[dict], reference: dict[str, torch.Tensor]) -> None:
    for got in ranks:
        for name, want in reference.items():
            if want.is_floating_point():
                torch.testing.assert_close(got[name], want, **tolerance("oracle"), msg=name)
            else:
                assert torch.equal(got[name], want), name
        assert int(got["0.bias_updates"]) == STEPS * WORLD


@pytest.mark.slow
def test_default_ddp_gives_the_one_process_routing_statistics(tmp_path):
    """DDP broadcasts rank 0's buffers before every forward; the routers still end, on both
    ranks, with the routers, bias and count of one process accumulating the two ranks'
    micro-batches (within float32 rounding)."""
    _assert_one_process(_spawn(_ddp_worker, tmp_path), _accumulated_run())


def _rows() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": r, "labels": r.clone()} for r in _blocks()]


def _trainer_run(out: str, grad_accum: int, backend: str | None = None):
    from transformers import Trainer, TrainingArguments

    _, fm = focus("llama")
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=grad_accum, learning_rate=1e-2, report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no", ddp_backend=backend,
        ddp_timeout=int(GROUP_TIMEOUT.total_seconds()),
    )  # fmt: skip
    Trainer(model=fm, args=args, train_dataset=_rows()).train()
    return _trained_routers(fm)


def _trainer_worker(rank: int, port: int, out: str) -> None:
    _join(rank, port)
    torch.save(_trainer_run(f"{out}/trainer", 1, "gloo"), f"{out}/rank{rank}.pt")
    assert end_process_group()


@pytest.mark.slow
def test_trainer_ranks_give_the_one_process_routing_statistics(tmp_path):
    """transformers.Trainer on two gloo ranks (its DDP defaults) equals one Trainer process
    with twice the gradient accumulation: routers, bias and count."""
    pytest.importorskip("accelerate")
    ranks = _spawn(_trainer_worker, tmp_path)
    _assert_one_process(ranks, _trainer_run(str(tmp_path / "one"), WORLD))


def _accelerate_run(out: str, grad_accum: int) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator, InitProcessGroupKwargs
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum,
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=GROUP_TIMEOUT)])  # fmt: skip
    _, fm = focus("llama")
    fm.train()
    opt = torch.optim.AdamW([p for p in fm.parameters() if p.requires_grad], lr=1e-2)
    loader = DataLoader(_blocks(), batch_size=MICRO)
    model, opt, loader = accelerator.prepare(fm, opt, loader)
    for x in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=x, labels=x, use_cache=False).loss)
            opt.step()
            opt.zero_grad()
    return _trained_routers(fm)


def _accelerate_worker(rank: int, port: int, out: str) -> None:
    _join(rank, port)
    torch.save(_accelerate_run(out, 1), f"{out}/rank{rank}.pt")
    assert end_process_group()


@pytest.mark.slow
def test_accelerate_ranks_give_the_one_process_routing_statistics(tmp_path):
    """An accelerate training loop on two gloo ranks equals the same loop in one process
    with twice the gradient accumulation."""
    pytest.importorskip("accelerate")
    ranks = _spawn(_accelerate_worker, tmp_path)
    _assert_one_process(ranks, _accelerate_run(str(tmp_path), WORLD))


def test_routing_checks_nan_except_at_inference_on_an_accelerator():
    """The NaN check of the scores reads back to the host: it runs on the CPU (free) and
    with gradients, and is left out at inference on other devices (a sync per layer)."""
    cpu, other = torch.zeros(1, 2, 4), torch.zeros(1, 2, 4, device="meta")
    with torch.no_grad():
        assert checks_nan(cpu) and not checks_nan(other)
    with torch.enable_grad():
        assert checks_nan(cpu) and checks_nan(other)
