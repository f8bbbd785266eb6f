"""Decoding with transformers' static KV cache (docs/method.md §5, "Decoding with a static
cache"): Focus layers keep their keys' groups in preallocated buckets, a decoding step reads
nothing back and runs the same operations whatever the routing, and greedy decoding equals the
dynamic cache's on every supported architecture."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids, left_pad
from transformers import DynamicCache, StaticCache

from focus_attention.bench.operations import OperationCounter
from focus_attention.hf import FocusStaticLayer
from focus_attention.hf import query_key as query_key_module
from focus_attention.hf import router as router_module
from focus_attention.hf.compat import cache_kwargs

PROMPT, NEW = 40, 10


def greedy(model, x, mask=None, **kw):
    with torch.no_grad():
        return model.generate(
            x,
            attention_mask=torch.ones_like(x) if mask is None else mask,
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


def assert_same_decoding(a, b, atol: float = 1e-4) -> None:
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert (x - y).abs().max() <= atol


@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_decodes_as_the_dynamic_one(arch):
    _, fm = focus(arch, num_groups=4, top_k=1, window=8, sink_tokens=2)
    x = ids(1, PROMPT, seed=31)
    static = greedy(fm, x, cache_implementation="static")
    assert_same_decoding(static, greedy(fm, x))
    for i in fm.focus_layers:
        layer = static.cache.layers[i]
        assert isinstance(layer, FocusStaticLayer)
        assert int(layer.cumulative_length) == PROMPT + NEW - 1
        groups, _ = layer.key_groups()
        counts = layer.buckets.count[:, 0]  # every cached key in each of its groups' buckets
        assert torch.equal(counts, groups.sum(dim=1).to(counts.dtype))


@pytest.mark.parametrize(
    "settings",
    [
        dict(top_k=2),
        dict(top_k=1, query_top_k=2),
        dict(top_k=2, dense_layers=(0,)),
        dict(top_k=1, dense_heads=((1, 0),)),
        dict(top_k=1, inference_routing="streaming"),
        dict(top_k=1, sink_tokens=0, window=1),
    ],
    ids=["top2", "query-top2", "dense-layer", "dense-head", "streaming", "no-sinks-window1"],
)
def test_static_cache_decodes_as_the_dynamic_one_with_each_setting(settings):
    _, fm = focus("llama", **{"num_groups": 4, "window": 8, "sink_tokens": 2, **settings})
    x = ids(1, PROMPT, seed=32)
    assert_same_decoding(greedy(fm, x, cache_implementation="static"), greedy(fm, x))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("query_top_k", [None, 2])
def test_static_cache_of_query_key_routers_decodes_as_the_dynamic_one(arch, query_top_k):
    """Query-key routers route each key-value head: the static layer keeps ``[B, C, H_kv, K]``
    groups and a bucket row per key-value head, and decodes as the dynamic cache does."""
    _, fm = focus(arch, num_groups=4, top_k=1, window=8, sink_tokens=2,
                  router_input="query_key", query_top_k=query_top_k)  # fmt: skip
    x = ids(1, PROMPT, seed=39)
    static = greedy(fm, x, cache_implementation="static")
    assert_same_decoding(static, greedy(fm, x))
    heads = fm.base_model.config.num_key_value_heads
    for i in fm.focus_layers:
        layer = static.cache.layers[i]
        groups, _ = layer.key_groups()
        assert groups.shape == (1, PROMPT + NEW - 1, heads, 4)
        counts = layer.buckets.count  # [B, H_kv, K]: each head's keys in its groups' buckets
        assert torch.equal(counts, groups.sum(dim=1).to(counts.dtype))


@pytest.mark.parametrize("router_input", ["hidden_state", "query_key"])
def test_static_cache_with_left_padding_decodes_as_the_dynamic_one(router_input):
    _, fm = focus("qwen2", num_groups=4, top_k=1, window=8, sink_tokens=3, router_input=router_input)  # fmt: skip
    x, mask = left_pad([ids(1, 37, seed=33)[0], ids(1, 25, seed=34)[0]])
    static = greedy(fm, x, mask, cache_implementation="static")
    assert_same_decoding(static, greedy(fm, x, mask))


@pytest.mark.parametrize("router_input", ["hidden_state", "query_key"])
def test_prompt_in_chunks_then_steps_equal_the_full_forward(router_input):
    """A static cache filled by a prompt of 30 tokens, then 3 at once, then 1 at a time: each
    call's logits equal the matching rows of one forward without a cache."""
    _, fm = focus("llama", num_groups=4, top_k=2, window=8, sink_tokens=2, router_input=router_input)  # fmt: skip
    x = ids(1, 38, seed=35)
    with torch.no_grad():
        full = fm(input_ids=x, use_cache=False).logits
        cache = StaticCache(config=fm.config, max_cache_len=48)
        for start, stop in [(0, 30), (30, 33)] + [(i, i + 1) for i in range(33, 38)]:
            out = fm(input_ids=x[:, start:stop], **cache_kwargs(cache), use_cache=True).logits
            assert (out - full[:, start:stop]).abs().max() <= 1e-5, (start, stop)


def _step_operations(fm, prompt: torch.Tensor) -> tuple[list, int]:
    """The (operation, output shapes) sequence of one decoding step after ``prompt``, and the
    host syncs among the step's operations."""
    cache = StaticCache(config=fm.config, max_cache_len=64)
    with torch.no_grad():
        fm(input_ids=prompt, **cache_kwargs(cache), use_cache=True)
        seen = []

        class Recorder(OperationCounter):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor)]  # fmt: skip
                seen.append((str(func), shapes))
                return out

        recorder = Recorder()
        with recorder:
            fm(input_ids=prompt[:, -1:], **cache_kwargs(cache), use_cache=True)
    return seen, recorder.syncs


@pytest.mark.parametrize("router_input", ["hidden_state", "query_key"])
def test_a_decoding_step_reads_nothing_back_and_does_not_depend_on_the_routing(monkeypatch, router_input):  # fmt: skip
    """Two prompts routed differently run the same operations with the same shapes in a
    decoding step, none of which reads back to the host (what a CUDA graph needs). The
    routing's NaN check, which reads back on the CPU only (``checks_nan``), is off as on a GPU."""
    monkeypatch.setattr(router_module, "checks_nan", lambda hidden: False)
    monkeypatch.setattr(query_key_module, "checks_nan", lambda hidden: False)
    _, fm = focus("llama", num_groups=4, top_k=1, window=4, sink_tokens=1, router_input=router_input)  # fmt: skip
    first, syncs = _step_operations(fm, ids(1, 20, seed=36))
    second, _ = _step_operations(fm, ids(1, 20, seed=37))
    assert syncs == 0
    assert first == second
    with torch.no_grad(), fm.record_routing() as a:
        fm(input_ids=ids(1, 20, seed=36), use_cache=False)
    with torch.no_grad(), fm.record_routing() as b:
        fm(input_ids=ids(1, 20, seed=37), use_cache=False)
    assert any(
        not torch.equal(x["query_groups"], y["query_groups"]) for x, y in zip(a, b, strict=True)
    )


def test_static_cache_refusals():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 12, seed=38)
    with torch.no_grad():
        cache = StaticCache(config=fm.config, max_cache_len=32)
        fm.set_routing("soft")
        with pytest.raises(ValueError, match="soft .* cannot fill a static KV cache"):
            fm(input_ids=x, **cache_kwargs(cache), use_cache=True)
        fm.set_routing("topk")
        cache = StaticCache(config=fm.config, max_cache_len=32)
        with pytest.raises(ValueError, match="output_attentions"):
            fm(input_ids=x, **cache_kwargs(cache), use_cache=True, output_attentions=True)
        filled = StaticCache(config=fm.config, max_cache_len=32)
        with fm.disable_focus():
            fm(input_ids=x, **cache_kwargs(filled), use_cache=True)
        with pytest.raises(ValueError, match="computed without Focus"):
            fm(input_ids=x[:, :1], **cache_kwargs(filled), use_cache=True)
        cache = StaticCache(config=fm.config, max_cache_len=32)
        fm(input_ids=x, **cache_kwargs(cache), use_cache=True)
        fm.focus_config = fm.focus_config.replace(sink_tokens=1)
        with pytest.raises(ValueError, match="sink_tokens"):
            fm(input_ids=x[:, :1], **cache_kwargs(cache), use_cache=True)


def test_a_reset_static_cache_decodes_as_a_new_one():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8, sink_tokens=2)
    x = ids(1, 20, seed=39)
    with torch.no_grad():
        cache = StaticCache(config=fm.config, max_cache_len=32)
        fm(input_ids=ids(1, 25, seed=40), **cache_kwargs(cache), use_cache=True)
        cache.reset()
        got = fm(input_ids=x, **cache_kwargs(cache), use_cache=True).logits
        want = fm(
            input_ids=x, **cache_kwargs(DynamicCache(config=fm.config)), use_cache=True
        ).logits
    assert (got - want).abs().max() <= 1e-5
