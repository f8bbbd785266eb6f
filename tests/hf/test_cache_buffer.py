"""The Focus KV cache appends into preallocated buffers (docs/method.md §5): its rows equal
concatenation after any sequence of appends and cache edits, a decoding step copies
nothing, rows once handed out never change, and decoding through it equals a forward
without a cache."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import focus, ids
from tolerances import tolerance

from focus_attention.hf import FocusCacheLayer
from focus_attention.hf.cache import MIN_SPARE_ROWS, SPARE_SHARE, append_rows
from focus_attention.hf.compat import cache_kwargs, cache_of


def _kv(b: int, n: int, seed: int, h: int = 2, d: int = 3) -> torch.Tensor:
    return torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(seed))


def test_append_rows_equals_cat_and_reuses_its_buffer():
    storage, rows = append_rows(None, None, _kv(2, 5, 0), 2)
    first = storage.data_ptr()
    held = [rows.clone()]
    for step in range(20):
        new = _kv(2, 1, step + 1)
        storage, rows = append_rows(storage, rows, new, 2)
        held.append(new)
        assert torch.equal(rows, torch.cat(held, dim=2))
    assert storage.data_ptr() == first  # 20 single rows fit the spare rows: no copy
    assert storage.shape[2] == 5 + max(MIN_SPARE_ROWS, 5 // SPARE_SHARE)


def test_a_full_buffer_grows_by_a_bounded_share():
    storage, rows = append_rows(None, None, _kv(1, 4000, 0, h=1, d=1), 2)
    cap = storage.shape[2]
    assert 4000 < cap <= 4000 + max(MIN_SPARE_ROWS, 4000 // SPARE_SHARE)
    storage2, rows2 = append_rows(storage, rows, _kv(1, cap - 4000 + 1, 1, h=1, d=1), 2)
    assert storage2.data_ptr() != storage.data_ptr()
    assert rows2.shape[2] == cap + 1
    assert torch.equal(rows2[:, :, :4000], rows)


def test_rows_that_are_not_a_prefix_of_the_buffer_are_copied_once():
    storage, rows = append_rows(None, None, _kv(3, 6, 0), 2)
    reordered = rows.index_select(0, torch.tensor([2, 0, 1]))  # a beam reordering
    new = _kv(3, 1, 1)
    storage2, rows2 = append_rows(storage, reordered, new, 2)
    assert storage2.data_ptr() != storage.data_ptr()
    assert torch.equal(rows2, torch.cat([reordered, new], dim=2))
    assert torch.equal(rows, storage[:, :, :6])  # the old buffer is left as it was


def test_appends_that_need_grad_concatenate_and_keep_the_graph():
    held = _kv(1, 4, 0).requires_grad_()
    new = _kv(1, 2, 1).requires_grad_()
    storage, rows = append_rows(None, held, new, 2)
    assert storage is None
    rows.sum().backward()
    assert torch.equal(held.grad, torch.ones_like(held))
    assert torch.equal(new.grad, torch.ones_like(new))


def test_an_inference_mode_buffer_is_not_written_outside_inference_mode():
    with torch.inference_mode():
        storage, rows = append_rows(None, None, _kv(1, 4, 0), 2)
    with torch.no_grad():
        new = _kv(1, 1, 1)
        storage2, rows2 = append_rows(storage, rows, new, 2)
    assert not storage2.is_inference()
    assert torch.equal(rows2, torch.cat([rows, new], dim=2))


# every edit transformers applies to a cache layer, in any order, between appends
EDITS = st.lists(
    st.sampled_from(["append1", "append3", "crop", "reorder", "select", "repeat"]),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(edits=EDITS)
def test_cache_layer_equals_concatenation_under_any_edits(edits):
    layer, ref = FocusCacheLayer(), {"k": _kv(2, 3, 0), "g": torch.rand(2, 3, 4) > 0.5}
    layer.update(ref["k"], -ref["k"])
    layer.append_groups(ref["g"])
    handed_out = [(layer.keys, layer.keys.clone())]
    for i, edit in enumerate(edits):
        b = ref["k"].shape[0]
        if edit.startswith("append"):
            m = int(edit[-1])
            k, g = _kv(b, m, i + 1), torch.rand(b, m, 4) > 0.5
            layer.update(k, -k)
            layer.append_groups(g)
            ref["k"], ref["g"] = torch.cat([ref["k"], k], 2), torch.cat([ref["g"], g], 1)
        elif edit == "crop" and ref["k"].shape[2] > 1:
            layer.crop(-1)
            ref["k"], ref["g"] = ref["k"][:, :, :-1], ref["g"][:, :-1]
        elif edit == "reorder":
            idx = torch.arange(b).flip(0)
            layer.reorder_cache(idx)
            ref["k"], ref["g"] = ref["k"][idx], ref["g"][idx]
        elif edit == "select" and b > 1:
            layer.batch_select_indices(torch.tensor([0]))
            ref["k"], ref["g"] = ref["k"][:1], ref["g"][:1]
        elif edit == "repeat" and b < 4:
            layer.batch_repeat_interleave(2)
            ref["k"] = ref["k"].repeat_interleave(2, 0)
            ref["g"] = ref["g"].repeat_interleave(2, 0)
        assert torch.equal(layer.keys, ref["k"]) and torch.equal(layer.values, -ref["k"])
        assert torch.equal(layer.groups, ref["g"])
        assert layer.get_seq_length() == layer.group_length == ref["k"].shape[2]
        handed_out.append((layer.keys, layer.keys.clone()))
    for view, value in handed_out:  # nothing handed out was written afterwards
        assert torch.equal(view, value)


def test_a_decoding_step_copies_no_cached_row():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 60, seed=3)
    with torch.no_grad():
        out = fm(x[:, :50], use_cache=True)
        cache = cache_of(out)
        ptrs = [(layer.keys.data_ptr(), layer.groups.data_ptr()) for layer in cache.layers]
        for t in range(50, 60):
            out = fm(x[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
    assert [(layer.keys.data_ptr(), layer.groups.data_ptr()) for layer in cache.layers] == ptrs


@pytest.mark.parametrize("top_k", [1, 2])
def test_decoding_after_a_crop_and_from_a_copy_equals_the_full_forward(top_k):
    """Assisted-decoding style: decode, crop, decode other tokens; and a deep copy of the
    cache decodes apart from the original. Each equals a forward without a cache."""
    _, fm = focus("llama", num_groups=4, top_k=top_k, window=8)
    x, other = ids(1, 40, seed=4), ids(1, 6, seed=5)
    with torch.no_grad():
        cache = cache_of(fm(x[:, :30], use_cache=True))
        for t in range(30, 36):
            fm(x[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
        branch = copy.deepcopy(cache)
        cache.crop(-4)  # keep 32 tokens
        step = [
            fm(other[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits for i in range(6)
        ]
        got = torch.cat(step, dim=1)
        want = fm(torch.cat([x[:, :32], other], 1), use_cache=False).logits[:, 32:]
        torch.testing.assert_close(got, want, **tolerance("oracle"))
        got = fm(x[:, 36:40], **cache_kwargs(branch), use_cache=True).logits
        want = fm(x, use_cache=False).logits[:, 36:]
        torch.testing.assert_close(got, want, **tolerance("oracle"))


def test_a_plain_model_decodes_through_buffered_layers_as_through_a_dynamic_cache():
    from tiny import build_model
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from focus_attention.hf import BufferedDynamicLayer

    model = build_model("llama").eval()
    x = ids(1, 30, seed=6)
    results = []
    for buffered in (False, True):
        cache = DynamicCache()
        if buffered:
            cache.layers = [BufferedDynamicLayer() for _ in range(model.config.num_hidden_layers)]
        with torch.no_grad():
            logits = [model(x[:, :20], **cache_kwargs(cache), use_cache=True).logits[:, -1:]]
            for t in range(20, 30):
                out = model(x[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
                logits.append(out.logits)
        kinds = {type(layer) for layer in cache.layers}
        assert kinds == ({BufferedDynamicLayer} if buffered else {DynamicLayer})
        results.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(results[1], results[0], **tolerance("oracle"))


def test_cached_key_groups_hold_the_sinks_and_another_sink_count_is_refused():
    """The cache keeps the key groups the op reads (sink keys in every group), so a step
    ORs nothing of size N_cached; groups cached under another sink_tokens are refused."""
    _, fm = focus("llama", num_groups=4, top_k=1, window=8, sink_tokens=3)
    x = ids(1, 40, seed=8)
    with torch.no_grad():
        cache = cache_of(fm(x[:, :30], use_cache=True))
        layer = cache.layers[fm.focus_layers[0]]
        assert layer.groups[0, :3].all() and not layer.groups[0, 3:].all()
        fm.focus_config = fm.focus_config.replace(sink_tokens=2)
        with pytest.raises(ValueError, match="sink_tokens=3.*sink_tokens=2"):
            fm(x[:, 30:31], **cache_kwargs(cache), use_cache=True)
