"""Decoding equals prefill, and the KV-cache rules (docs/method.md §5, §8), on every
supported architecture."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids
from tolerances import tolerance
from transformers import DynamicCache, GenerationConfig, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from focus_attention.hf import FocusCacheLayer
from focus_attention.hf.compat import cache_kwargs, cache_of

PROMPT, NEW = 300, 40


def greedy(model, x, use_cache: bool, new: int = NEW, **kw):
    with torch.no_grad():
        return model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new,
            do_sample=False,
            use_cache=use_cache,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_with_cache_equals_without(arch):
    _, fm = focus(arch, num_groups=4, top_k=1, window=32)
    x = ids(1, PROMPT, seed=11)
    cached, plain = greedy(fm, x, True), greedy(fm, x, False)
    assert torch.equal(cached.sequences, plain.sequences)
    assert len(cached.logits) == NEW
    for a, b in zip(cached.logits, plain.logits, strict=True):
        assert (a - b).abs().max() <= 1e-4
    # Focus layers kept every key; the groups of cached keys were kept alongside
    total = PROMPT + NEW - 1
    for i in fm.focus_layers:
        layer = cached.cache.layers[i]
        assert isinstance(layer, FocusCacheLayer)
        assert layer.keys.shape[2] == total and layer.groups.shape[1] == total


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_full_forward(arch):
    """Prefill 256, then 3 tokens at once, then 1 at a time: every chunk's logits equal the
    matching rows of a full forward, and so do the groups each chunk used."""
    _, fm = focus(arch, num_groups=4, top_k=2, window=32)
    x = ids(1, 264, seed=12)
    with torch.no_grad(), fm.record_routing() as full_rec:
        full = fm(input_ids=x, use_cache=False).logits
    cache = DynamicCache(config=fm.config)
    bounds = [(0, 256), (256, 259)] + [(i, i + 1) for i in range(259, 264)]
    chunk_rec = []
    for start, stop in bounds:
        with torch.no_grad(), fm.record_routing() as rec:
            out = fm(input_ids=x[:, start:stop], **cache_kwargs(cache), use_cache=True).logits
        chunk_rec.append(rec)
        assert (out - full[:, start:stop]).abs().max() <= 1e-5, (start, stop)
    for layer in fm.focus_layers:
        want = next(r["query_groups"] for r in full_rec if r["layer"] == layer)
        got = torch.cat(
            [next(r["query_groups"] for r in rec if r["layer"] == layer) for rec in chunk_rec], 1
        )
        assert torch.equal(got, want), layer
        key_groups = next(r["key_groups"] for r in full_rec if r["layer"] == layer)
        assert torch.equal(cache.layers[layer].groups, key_groups)  # sink keys in every group
        assert not torch.equal(key_groups, want)  # (there are sink tokens)


def test_mistral_sliding_window_config_keeps_every_key_on_focus_layers():
    """Mistral with config.sliding_window: transformers builds window-truncated cache layers;
    Focus layers must keep every key (and equal no-cache generation)."""
    _, fm = focus(
        "mistral", num_groups=4, top_k=1, window=8, model_overrides=dict(sliding_window=16)
    )
    assert fm.focus_layers == [0, 1]
    x = ids(1, 60, seed=13)
    cached, plain = greedy(fm, x, True, new=12), greedy(fm, x, False, new=12)
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b in zip(cached.logits, plain.logits, strict=True):
        assert (a - b).abs().max() <= 1e-4
    for layer in cached.cache.layers:
        assert isinstance(layer, FocusCacheLayer) and layer.keys.shape[2] == 60 + 11


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_sliding_layers_are_left_as_they_are(arch):
    ref, fm = focus(arch, num_groups=4, top_k=1, window=8)
    assert fm.focus_layers == [1]  # layer 0 is a sliding-window layer
    x = ids(1, 50, seed=14)
    cached, plain = greedy(fm, x, True, new=10), greedy(fm, x, False, new=10)
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b in zip(cached.logits, plain.logits, strict=True):
        assert (a - b).abs().max() <= 1e-4
    assert isinstance(cached.cache.layers[0], DynamicSlidingWindowLayer)
    assert isinstance(cached.cache.layers[1], FocusCacheLayer)
    assert cached.cache.layers[1].keys.shape[2] == 59
    # an explicitly chosen sliding layer gets Focus and a full cache
    _, fm_all = focus(arch, num_groups=4, top_k=1, window=8, layers=[0, 1])
    out = greedy(fm_all, x, True, new=10)
    assert all(isinstance(layer, FocusCacheLayer) for layer in out.cache.layers)
    assert torch.equal(out.sequences, greedy(fm_all, x, False, new=10).sequences)


def test_left_padded_batch_generation_with_cache_equals_without():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(2, 40, seed=15)
    mask = torch.ones_like(x)
    mask[1, :17] = 0
    kw = dict(max_new_tokens=15, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        a = fm.generate(x, attention_mask=mask, use_cache=True, **kw)
        b = fm.generate(x, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for u, v in zip(a.logits, b.logits, strict=True):
        assert (u - v).abs().max() <= 1e-4


def test_beam_search_reorders_cached_groups():
    """Beam search past the window: the generated tokens leave the 8-token window, so their
    cached groups decide what later queries see, and beams reorder them at every step."""
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 40, seed=16)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=30, num_beams=3, do_sample=False)
    kw.update(output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        a = fm.generate(x, use_cache=True, **kw)
        b = fm.generate(x, use_cache=False, **kw)
    assert a.sequences.shape[1] - x.shape[1] > 3 * fm.focus_config.window
    assert torch.equal(a.sequences, b.sequences)
    for u, v in zip(a.scores, b.scores, strict=True):
        torch.testing.assert_close(u, v, **tolerance("oracle"))


@pytest.mark.parametrize("op", ["reorder_cache", "batch_select_indices", "repeat", "crop"])
def test_cache_layer_keeps_groups_aligned_with_keys(op):
    """Every cache edit applies to the cached groups exactly as to the cached keys."""
    layer = FocusCacheLayer()
    b, n, k = 3, 5, 4
    keys = torch.arange(b * n, dtype=torch.float32).reshape(b, 1, n, 1)
    layer.update(keys, keys.clone())
    token_ids = keys[:, 0, :, 0].long()  # [B, N]: one id per cached token
    groups = torch.nn.functional.one_hot(token_ids % k, k).bool()  # [B, N, K]
    layer.append_groups(groups)
    if op == "reorder_cache":
        layer.reorder_cache(torch.tensor([2, 0, 0]))
    elif op == "batch_select_indices":
        layer.batch_select_indices(torch.tensor([2, 1]))
    elif op == "repeat":
        layer.batch_repeat_interleave(2)
    else:
        layer.crop(-2)  # drop the last 2 tokens
    ids_now = layer.keys[:, 0, :, 0].long()
    assert layer.groups.shape[:2] == ids_now.shape
    assert torch.equal(layer.groups, torch.nn.functional.one_hot(ids_now % k, k).bool())


def test_sequence_routing_refuses_a_kv_cache():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8, inference_routing="sequence")
    x = ids(1, 30, seed=17)
    with torch.no_grad():
        out = fm(input_ids=x).logits  # use_cache defaults to False in this mode
        assert torch.isfinite(out).all()
        with pytest.raises(ValueError, match="not causal"):
            fm(input_ids=x, use_cache=True)
        with pytest.raises(ValueError, match="not causal"):
            fm.generate(x, max_new_tokens=2, use_cache=True)
        with pytest.raises(ValueError, match="not causal"):  # the base model called directly
            fm.base_model(input_ids=x, use_cache=True)
        gen = fm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False)
        assert gen.shape == (1, 33)


def test_soft_routing_cannot_continue_a_cache():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 20, seed=18)
    cache = DynamicCache(config=fm.config)
    with torch.no_grad():
        fm(input_ids=x[:, :10], **cache_kwargs(cache), use_cache=True)
        fm.set_routing("soft")
        with pytest.raises(ValueError, match="cannot continue from a KV cache"):
            fm(input_ids=x[:, 10:], **cache_kwargs(cache), use_cache=True)


def test_a_cache_filled_without_focus_is_refused():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 12, seed=19)
    with torch.no_grad():
        filled = DynamicCache(config=fm.config)
        with fm.disable_focus():
            fm(input_ids=x, **cache_kwargs(filled), use_cache=True)
        with pytest.raises(ValueError, match="computed without Focus"):
            fm(input_ids=x[:, :1], **cache_kwargs(filled), use_cache=True)


def test_generate_with_an_offloaded_static_cache_is_refused_early():
    """Offloaded static caches (and other implementations) are refused before any Focus
    layer runs; the static cache itself is supported (tests/hf/test_static_cache.py)."""
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 10, seed=23)
    offloaded = StaticCache(config=fm.config, max_cache_len=32, offloading=True)
    with fm.record_routing() as records:
        for kwargs in (
            {"cache_implementation": "offloaded_static"},
            {"cache_implementation": "quantized"},
            {"generation_config": GenerationConfig(cache_implementation="offloaded_static")},
            {"past_key_values": offloaded},
        ):
            with pytest.raises(ValueError, match="KV cache that keeps every key"):
                fm.generate(x, max_new_tokens=4, do_sample=False, **kwargs)
    assert records == []  # refused before any Focus layer ran
    fm.generation_config.cache_implementation = "offloaded_static"
    with pytest.raises(ValueError, match="cache_implementation='offloaded_static'"):
        fm.generate(x, max_new_tokens=4, do_sample=False)
    # the base model (Focus disabled) is not checked; "dynamic" still works
    fm.generation_config.cache_implementation = "static"
    with fm.disable_focus():
        assert fm.generate(x, max_new_tokens=2, do_sample=False).shape == (1, 12)
    out = fm.generate(x, max_new_tokens=2, do_sample=False, cache_implementation="dynamic")
    assert out.shape == (1, 12)


def test_decoding_steps_route_in_one_fused_call(kernel_built, monkeypatch):
    """On the CPU a decoding step routes its token through the fused kernel (one call per
    Focus layer), the prefill through the PyTorch ops, and the cached decode still equals
    the full forward."""
    if not kernel_built:
        pytest.skip("the cpu_fused kernel is not available here")
    from focus_attention.ops import routing

    real, routed = routing.extension.load, []

    class Spy:
        def __getattr__(self, name):
            return getattr(real(), name)

        def focus_route(self, hidden, *args):
            routed.append(hidden.shape[1])
            return real().focus_route(hidden, *args)

    monkeypatch.setattr(routing.extension, "load", lambda: Spy())
    _, fm = focus("llama", num_groups=4, top_k=2, window=16)
    x = ids(1, 80, seed=3)
    with torch.no_grad():
        full = fm(x).logits
        out = fm(x[:, :70], use_cache=True)
        assert routed == []  # 70 tokens: the matrix products
        for t in range(70, 80):
            step = fm(x[:, t : t + 1], **cache_kwargs(cache_of(out)), use_cache=True)
            torch.testing.assert_close(step.logits[:, -1], full[:, t], **tolerance("oracle"))
            out = step
    assert routed == [1] * (10 * len(fm.focus_layers))
