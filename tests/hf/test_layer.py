"""The Focus layer takes its inputs as arguments (docs/method.md §8, "The router's input"): the
pre-hook of each Focus attention module adds the hidden state entering it and the layer's
cache to the module's keyword arguments, and every supported architecture passes them on to
the attention function; nothing is kept between the hook and the call."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids
from transformers import DynamicCache, StaticCache

from focus_attention.hf import attention
from focus_attention.hf.cache import FocusCacheLayer
from focus_attention.hf.compat import cache_kwargs
from focus_attention.hf.focus_cache import CallKeys
from focus_attention.hf.layer_handle import handle_of
from focus_attention.hf.static_cache import FocusStaticLayer


def _focus_modules(fm) -> dict[int, torch.nn.Module]:
    found = {}
    for module in fm.base_model.modules():
        handle = handle_of(module)
        if handle is not None and handle.router is not None:
            found[handle.layer_idx] = module
    return found


def _spy(fm, monkeypatch):
    """``(entering, received)``: per layer, the hidden state entering each Focus attention
    module (a hook of its own, ahead of Focus's) and the hidden state and cache the Focus layer
    received as arguments."""
    entering, received = {}, {}
    hooks = []
    for i, module in _focus_modules(fm).items():

        def keep(module, args, kwargs, i=i):
            entering[i] = args[0] if args else kwargs["hidden_states"]

        hooks.append(module.register_forward_pre_hook(keep, with_kwargs=True, prepend=True))
    resolve = attention.resolve_call

    def spy(handle, module, query, key, value, mask, scaling, kwargs, hidden, cache):
        received[handle.layer_idx] = (hidden, cache)
        return resolve(handle, module, query, key, value, mask, scaling, kwargs, hidden, cache)

    monkeypatch.setattr(attention, "resolve_call", spy)
    return entering, received, hooks


@pytest.mark.parametrize("arch", ARCHS)
def test_the_hidden_state_and_the_cache_reach_the_focus_layer_as_arguments(arch, monkeypatch):
    _, fm = focus(arch)
    x = ids(1, 12, seed=91)
    entering, received, hooks = _spy(fm, monkeypatch)
    with torch.no_grad():
        fm(input_ids=x, use_cache=False)
        assert set(received) == set(fm.focus_layers) == set(entering)
        for i, (hidden, cache) in received.items():
            assert hidden is entering[i] and cache is None
        for cache, kind in ((DynamicCache(config=fm.config), FocusCacheLayer),
                            (StaticCache(config=fm.config, max_cache_len=16), FocusStaticLayer)):  # fmt: skip
            received.clear()
            fm(input_ids=x, **cache_kwargs(cache), use_cache=True)
            for i, (hidden, layer) in received.items():
                assert hidden is entering[i]
                assert isinstance(layer, kind) and layer is cache.layers[i]
    for hook in hooks:
        hook.remove()


def test_a_module_called_without_its_pre_hook_is_refused_by_name():
    _, fm = focus("llama")
    for module in _focus_modules(fm).values():
        handle_of(module).hook.remove()
    with torch.no_grad(), pytest.raises(ValueError, match="without its pre-hook"):
        fm(input_ids=ids(1, 6, seed=92), use_cache=False)


def test_no_layer_keeps_a_tensor_between_calls():
    """After eager calls with and without caches, generation and recording, no handle holds a
    tensor and no handle or module holds the hidden state: it lived in one call's arguments."""
    _, fm = focus("llama", dense_heads=((0, 1),))
    x = ids(2, 14, seed=93)
    with torch.no_grad():
        fm(input_ids=x, use_cache=False)
        fm(input_ids=x, **cache_kwargs(DynamicCache(config=fm.config)), use_cache=True)
        fm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False)
        with fm.record_routing():
            fm(input_ids=x, use_cache=False)
    for module in _focus_modules(fm).values():
        handle = handle_of(module)
        kept = [k for k, v in vars(handle).items() if isinstance(v, torch.Tensor)]
        assert kept == [] and not hasattr(handle, "pending") and not hasattr(handle, "traced_hidden")  # fmt: skip
        assert not any(isinstance(v, torch.Tensor) for v in vars(module).values())


def test_a_call_without_a_cache_attends_its_own_keys():
    keys = CallKeys()
    assert not keys.is_cache and not keys.static
    groups = torch.zeros(1, 3, 2, dtype=torch.bool)
    keys.append_groups(groups, 1, sinks_new=torch.tensor([[True, False, False]]))
    assert keys.key_groups(None)[0][0, 0].all() and not keys.key_groups(None)[0][0, 1:].any()
