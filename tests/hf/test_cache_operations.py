"""Every cache operation transformers' generation calls (beam reordering, cropping for
assisted decoding, batch repetition and selection, reset, offloading) keeps the Focus state
of a cache (groups, buckets, counts, real-token marks, sinks) in step with its keys, on the
dynamic and the static cache alike: each is checked against the dynamic cache, whose layer
keeps every key's groups beside it (docs/method.md §5, "KV cache")."""

from __future__ import annotations

import pytest
import torch
from tiny import focus, ids, left_pad
from tolerances import tolerance
from transformers import DynamicCache, StaticCache

from focus_attention.hf import FocusStaticLayer
from focus_attention.hf.cache import FocusCacheLayer
from focus_attention.hf.compat import cache_kwargs

#: a window far shorter than the decoded length, so the cached groups decide what is seen
SETTINGS = dict(num_groups=4, top_k=1, window=8, sink_tokens=2)


def _generate(fm, x, mask, **kw):
    with torch.no_grad():
        return fm.generate(x, attention_mask=mask, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, **kw)  # fmt: skip


def _assert_same(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    for u, v in zip(a.scores, b.scores, strict=True):
        real = torch.isfinite(u) & torch.isfinite(v)
        assert torch.equal(torch.isfinite(u), torch.isfinite(v))
        torch.testing.assert_close(u[real], v[real], **tolerance("oracle"))


#: transformers' offloaded dynamic cache prefetches on a CUDA stream
OFFLOADED = pytest.param(
    "offloaded",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.parametrize("implementation", ["static", OFFLOADED])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_beam_search_with_each_cache_equals_the_dynamic_cache(arch, implementation):
    """Beams reorder the cache at every step, for 30 tokens past an 8-token window: the static
    cache's groups, buckets, real-token marks and sink counts follow its keys (they did not:
    the beams parted from the dynamic cache's at the 6th token); the offloaded cache's groups
    stay on the device while its keys and values travel."""
    device = "cuda" if implementation == "offloaded" else "cpu"
    _, fm = focus(arch, **SETTINGS)
    fm.to(device)
    x, mask = (t.to(device) for t in left_pad([ids(1, 40, seed=71)[0], ids(1, 33, seed=72)[0]]))
    kw = dict(max_new_tokens=30, num_beams=3)
    dynamic = _generate(fm, x, mask, **kw)
    other = _generate(fm, x, mask, cache_implementation=implementation, **kw)
    assert dynamic.sequences.shape[1] - x.shape[1] > 3 * SETTINGS["window"]
    _assert_same(other, dynamic)


@pytest.mark.parametrize("router_input", ["hidden_state", "query_key"])
def test_prompt_lookup_decoding_with_the_static_cache_equals_the_dynamic_cache(router_input):
    """Prompt-lookup (assisted) decoding verifies several drafted tokens per step and crops
    the rejected ones from the cache: the static cache's buckets forget them as its keys do."""
    _, fm = focus("llama", **SETTINGS, router_input=router_input)
    phrase = ids(1, 12, seed=73)
    x = torch.cat([phrase, ids(1, 10, seed=74), phrase, phrase[:, :4]], dim=1)
    kw = dict(max_new_tokens=24, prompt_lookup_num_tokens=4)
    dynamic = _generate(fm, x, torch.ones_like(x), **kw)
    static = _generate(
        fm, x, torch.ones_like(x), cache_implementation="static", max_cache_len=80, **kw
    )
    plain = _generate(fm, x, torch.ones_like(x), max_new_tokens=24)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(dynamic.sequences, plain.sequences)


def _step(fm, cache, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = fm(input_ids=tokens, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    return out.logits


def _decode(fm, cache, steps: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The logits of one decoding step per column of ``steps`` on ``cache`` (whose prompts
    have the 2-D padding ``mask``)."""
    logits = []
    for t in range(steps.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits.append(_step(fm, cache, steps[:, t : t + 1], mask))
    return logits


def _cache(kind: str, fm) -> DynamicCache | StaticCache:
    if kind == "dynamic":
        return DynamicCache(config=fm.config)
    return StaticCache(config=fm.config, max_cache_len=48)


#: a cache operation, and the prompt rows the cache holds after it
OPERATIONS = {
    "reorder_cache": (lambda cache: cache.reorder_cache(torch.tensor([2, 0, 0])), [2, 0, 0]),
    "batch_select_indices": (lambda c: c.batch_select_indices(torch.tensor([2, 1])), [2, 1]),
    "batch_repeat_interleave": (lambda c: c.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2]),
}


@pytest.mark.parametrize("router_input", ["hidden_state", "query_key"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_batch_operations_keep_the_cache_in_step(op, kind, router_input):
    """A left-padded batch of 3 prompts fills the cache; the operation rearranges its rows;
    the decoding steps that follow give the logits of a dynamic cache filled with the
    rearranged prompts (sinks, padding and groups of each row moved with its keys)."""
    apply, rows = OPERATIONS[op]
    _, fm = focus("llama", **SETTINGS, router_input=router_input)
    x, mask = left_pad([ids(1, 30, seed=75)[0], ids(1, 21, seed=76)[0], ids(1, 26, seed=77)[0]])
    index = torch.tensor(rows)
    steps = ids(len(rows), 6, seed=78)
    reference = DynamicCache(config=fm.config)
    _step(fm, reference, x[index], mask[index])
    want = _decode(fm, reference, steps, mask[index])
    cache = _cache(kind, fm)
    _step(fm, cache, x, mask)
    apply(cache)
    for t, (got, expected) in enumerate(zip(_decode(fm, cache, steps, mask[index]), want, strict=True)):  # fmt: skip
        torch.testing.assert_close(got, expected, **tolerance("oracle"), msg=f"step {t}")


@pytest.mark.parametrize("router_input", ["hidden_state", "query_key"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_cropped_cache_decodes_as_one_that_never_held_the_removed_tokens(kind, router_input):
    """Prompt, 5 steps, crop the last 3, then 4 other steps: the logits equal a dynamic cache
    that only ever held the prompt and the 2 kept steps (the buckets, counts and real-token
    marks of the static cache forget the removed keys; per key-value head with query-key
    routers)."""
    _, fm = focus("llama", **SETTINGS, router_input=router_input)
    x, mask = left_pad([ids(1, 30, seed=79)[0], ids(1, 24, seed=80)[0]])
    first, then = ids(2, 5, seed=81), ids(2, 4, seed=82)
    reference = DynamicCache(config=fm.config)
    _step(fm, reference, torch.cat([x, first[:, :2]], dim=1), torch.cat([mask, torch.ones_like(first[:, :2])], dim=1))  # fmt: skip
    kept = torch.cat([mask, torch.ones_like(first[:, :2])], dim=1)
    want = _decode(fm, reference, then, kept)
    cache = _cache(kind, fm)
    _step(fm, cache, x, mask)
    _decode(fm, cache, first, mask)
    cache.crop(-3)
    for t, (got, expected) in enumerate(zip(_decode(fm, cache, then, kept), want, strict=True)):
        torch.testing.assert_close(got, expected, **tolerance("oracle"), msg=f"step {t}")
    if kind == "static":
        layer = cache.layers[0]
        assert isinstance(layer, FocusStaticLayer)
        groups, _ = layer.key_groups()  # [B, N, K], or [B, N, H_kv, K] per head
        count = layer.buckets.count if groups.dim() == 4 else layer.buckets.count[:, 0]
        assert torch.equal(count, groups.sum(dim=1).to(torch.int32))
    else:
        assert isinstance(cache.layers[0], FocusCacheLayer)


def test_a_sliding_window_shorter_than_the_static_cache_is_refused_with_the_remedy():
    """Mistral's static cache holds only ``sliding_window`` keys on its sliding layers and no
    record of the length asked for: a Focus layer there is refused, naming the remedy, which
    then decodes as the dynamic cache."""
    _, fm = focus("mistral", **SETTINGS, model_overrides=dict(sliding_window=16))
    x = ids(1, 30, seed=83)
    with pytest.raises(ValueError, match="sliding_window=None"):
        _generate(fm, x, torch.ones_like(x), max_new_tokens=4, cache_implementation="static")
    _, fm = focus("mistral", **SETTINGS, model_overrides=dict(sliding_window=None))
    kw = dict(max_new_tokens=12)
    static = _generate(fm, x, torch.ones_like(x), cache_implementation="static", **kw)
    _assert_same(static, _generate(fm, x, torch.ones_like(x), **kw))
