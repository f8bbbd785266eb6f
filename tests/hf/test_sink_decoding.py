"""Sink tokens that arrive one call at a time (generation from a prompt shorter than the sink
tokens, down to one token): each call's new sink keys join every group, so every decoding
step's logits equal the no-cache forward's and the cached key groups equal the full
forward's (docs/method.md §3, §5). A sink key left in its routed groups only would change
every later query's attention beyond the window."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids
from tolerances import tolerance
from transformers import DynamicCache

from focus_attention.hf.compat import cache_kwargs

TOKENS = 24


def _decode(fm, x: torch.Tensor, prompt: int) -> tuple[torch.Tensor, DynamicCache]:
    """The logits of ``x`` from a prompt of ``prompt`` tokens, then one token per call with
    a KV cache."""
    cache = DynamicCache(config=fm.config)
    bounds = [(0, prompt)] + [(i, i + 1) for i in range(prompt, x.shape[1])]
    with torch.no_grad():
        out = [fm(input_ids=x[:, a:b], **cache_kwargs(cache), use_cache=True).logits for a, b in bounds]  # fmt: skip
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("sinks", [1, 2, 3])
@pytest.mark.parametrize("prompt", [1, 2])
def test_decoding_from_a_prompt_shorter_than_the_sinks_equals_the_full_forward(sinks, prompt):
    _, fm = focus("llama", num_groups=4, top_k=1, window=4, sink_tokens=sinks)
    x = ids(1, TOKENS, seed=21)
    with torch.no_grad(), fm.record_routing() as records:
        full = fm(input_ids=x, use_cache=False).logits
    got, cache = _decode(fm, x, prompt)
    torch.testing.assert_close(got, full, **tolerance("oracle"))
    for layer in fm.focus_layers:
        want = next(r["key_groups"] for r in records if r["layer"] == layer)
        groups = cache.layers[layer].groups
        assert torch.equal(groups, want), layer
        assert groups[:, :sinks].all() and not groups[:, sinks:].all()  # sinks: every group


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_decodes_its_sinks_from_a_one_token_prompt(arch):
    _, fm = focus(arch, num_groups=4, top_k=1, window=4, sink_tokens=3)
    x = ids(1, TOKENS, seed=22)
    with torch.no_grad():
        full = fm(input_ids=x, use_cache=False).logits
    got, _ = _decode(fm, x, 1)
    assert (got - full).abs().max() <= 1e-4
