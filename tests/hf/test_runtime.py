"""The switches of a Focus model that a context turns on for a while (``disable_focus()``,
the top-k routing of ``generate()``, the routing recorders) belong to the calling thread
(src/focus_attention/hf/runtime.py, docs/method.md §8): another thread calling the same model
meanwhile keeps its own settings."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from tiny import focus, ids
from transformers import StoppingCriteria, StoppingCriteriaList

from focus_attention.hf.runtime import FocusRuntime

TIMEOUT = 60


class _Inside:
    """Runs ``enter`` in a thread that then waits, inside, until :meth:`release`."""

    def __init__(self, enter) -> None:
        self.inside, self.done, self.error = threading.Event(), threading.Event(), None
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(enter,))

    def _run(self, enter) -> None:
        try:
            self.result = enter(self)
        except BaseException as err:  # handed to the test thread
            self.error = err
            self.inside.set()

    def wait_here(self) -> None:
        self.inside.set()
        assert self.done.wait(TIMEOUT)

    def __enter__(self):
        self.thread.start()
        assert self.inside.wait(TIMEOUT)
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(TIMEOUT)
        if self.error is not None:
            raise self.error


def _logits(fm, x):
    with torch.no_grad():
        return fm(input_ids=x, use_cache=False).logits


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_disable_focus_in_one_thread_leaves_the_others_on_focus(arch):
    base, fm = focus(arch, num_groups=4, top_k=1, window=4)
    x = ids(1, 30, seed=1)
    sparse, dense = _logits(fm, x), _logits(base, x)
    assert (sparse - dense).abs().max() > 1e-3  # the two differ on this input

    def disabled(ctx):
        with fm.disable_focus():
            inside = _logits(fm, x)
            ctx.wait_here()
            return inside, _logits(fm, x)

    with _Inside(disabled) as ctx:
        others = [_logits(fm, x) for _ in range(5)]
    for other in others:
        assert torch.equal(other, sparse)
    for inside in ctx.result:
        assert torch.equal(inside, dense)
    assert torch.equal(_logits(fm, x), sparse)


class _Hold(StoppingCriteria):
    """Holds ``generate`` at its first step until the test releases it."""

    def __init__(self, ctx) -> None:
        self.ctx, self.held = ctx, False

    def __call__(self, input_ids, scores, **kwargs):
        if not self.held:
            self.held = True
            self.ctx.wait_here()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _soft_steps(fm, batches):
    """Soft training forwards (train mode, routing "auto"): their logits and bias updates."""
    out = [fm(input_ids=x, use_cache=False).logits.detach() for x in batches]
    return out, {i: int(r.bias_updates) for i, r in fm.routers.items()}


def test_generate_in_one_thread_leaves_training_forwards_soft():
    """The HF streaming pattern: generate() in a thread while the model trains in another."""
    _, fm = focus("llama", num_groups=4, top_k=1, window=4)
    reference = copy.deepcopy(fm).train()
    batches = [ids(2, 24, seed=10 + i) for i in range(4)]
    expected, expected_updates = _soft_steps(reference, batches)
    fm.train()
    prompt = ids(1, 8, seed=3)

    def generating(ctx):
        return fm.generate(prompt, max_new_tokens=4, do_sample=False,
                           stopping_criteria=StoppingCriteriaList([_Hold(ctx)]))  # fmt: skip

    with fm.record_routing() as records, _Inside(generating) as ctx:
        got, updates = _soft_steps(fm, batches)
    assert updates == expected_updates == {i: 4 for i in fm.routers}
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert {r["mode"] for r in records} == {"soft"}  # this thread's records only
    assert ctx.result.shape == (1, 12)


def test_a_training_forward_after_generate_routes_soft_and_updates_once():
    _, fm = focus("llama", num_groups=4, top_k=1, window=4)
    fm.train()
    reference = copy.deepcopy(fm)
    fm.generate(ids(1, 8, seed=4), max_new_tokens=3, do_sample=False)
    assert fm.routing_mode == "soft" and all(int(r.bias_updates) == 0 for r in fm.routers.values())
    x = ids(2, 24, seed=5)
    got, updates = _soft_steps(fm, [x])
    expected, expected_updates = _soft_steps(reference, [x])
    assert torch.equal(got[0], expected[0]) and updates == expected_updates
    for i, router in fm.routers.items():
        assert torch.equal(router.routing_bias, reference.routers[i].routing_bias)


def test_recorders_collect_only_their_own_thread():
    _, fm = focus("llama", num_groups=4, top_k=1, window=4)
    x = ids(1, 20, seed=6)

    def recording(ctx):
        with fm.record_routing() as records:
            ctx.wait_here()
        return records

    with _Inside(recording) as ctx:
        for _ in range(3):
            _logits(fm, x)
    assert ctx.result == []
    with fm.record_routing() as records:
        _logits(fm, x)
    assert len(records) == len(fm.focus_layers)


def test_switches_nest_and_refuse_unknown_names():
    runtime = FocusRuntime(focus_config=None, base_impl="sdpa")
    with runtime.switched(routing="topk"):
        with runtime.switched(routing="soft", enabled=False):
            assert (runtime.current("routing"), runtime.current("enabled")) == ("soft", False)
        assert (runtime.current("routing"), runtime.current("enabled")) == ("topk", True)
    assert runtime.current("routing") == "auto"
    with (
        pytest.raises(ValueError, match="unknown switches \\['top_k'\\]"),
        runtime.switched(top_k=2),
    ):
        pass


def test_disable_focus_belongs_to_its_asyncio_task():
    import asyncio

    base, fm = focus("llama", num_groups=4, top_k=1, window=4)
    x = ids(1, 30, seed=8)
    sparse, dense = _logits(fm, x), _logits(base, x)

    async def disabled(inside: asyncio.Event, done: asyncio.Event):
        with fm.disable_focus():
            inside.set()
            await done.wait()
            return _logits(fm, x)

    async def main():
        inside, done = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(disabled(inside, done))
        await inside.wait()
        other = _logits(fm, x)  # this task, while the other is inside disable_focus()
        done.set()
        return other, await task

    other, inside = asyncio.run(main())
    assert torch.equal(other, sparse) and torch.equal(inside, dense)
