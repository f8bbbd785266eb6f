"""Asymmetric top-k routing, ``FocusConfig.query_top_k`` (docs/method.md §4): queries keep
their ``query_top_k`` best groups, keys their ``top_k`` best, on every architecture, with
padding, KV-cache decoding and both inference routings."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import ARCHS, build_model, focus, ids, left_pad, positions
from tolerances import tolerance
from transformers import DynamicCache

from focus_attention.hf import FocusConfig, FocusModel, focus_cache
from focus_attention.ops import dense_attention, focus_mask, pairs_retained

N = 96
# (top_k, query_top_k): queries in more groups than keys, and in fewer
SHAPES = [(1, 2), (2, 1)]


def run(fm, x, **kw):
    with torch.no_grad(), fm.record_routing() as records:
        out = fm(input_ids=x, use_cache=False, **kw).logits
    return out, records


def first_layer(records):
    return min(records, key=lambda r: r["layer"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("top_k,query_top_k", SHAPES)
def test_queries_keep_query_top_k_groups_and_keys_top_k(arch, top_k, query_top_k):
    x = ids(2, N, seed=31)
    _, fm = focus(arch, top_k=top_k, query_top_k=query_top_k, sink_tokens=2)
    _, recs = run(fm, x)
    for r in recs:
        assert bool((r["query_groups"].sum(-1) == query_top_k).all()), r["layer"]
        key_counts = r["key_groups"][:, 2:].sum(-1)  # after the two sink tokens
        assert bool((key_counts == top_k).all()), r["layer"]
        assert bool(r["key_groups"][:, :2].all())  # sinks are in every group
        small, large = sorted((r["query_groups"][:, 2:], r["key_groups"][:, 2:]), key=lambda g: int(g.sum()))  # fmt: skip
        assert not (small & ~large).any()  # ties broken alike: the narrower set is inside
    # the first Focus layer sees the same hidden states whatever the routing: its query
    # groups are those of symmetric top-query_top_k, its key groups those of top-top_k
    _, sym_q = focus(arch, top_k=query_top_k, sink_tokens=2)
    _, sym_k = focus(arch, top_k=top_k, sink_tokens=2)
    first = first_layer(recs)
    assert torch.equal(first["query_groups"], first_layer(run(sym_q, x)[1])["query_groups"])
    assert torch.equal(first["key_groups"], first_layer(run(sym_k, x)[1])["key_groups"])


def _oracle_sparse_attention(query, key, value, query_groups, key_groups, window, *, scale=None, key_padding_mask=None, softcap=None, backend="auto"):  # fmt: skip
    mask = focus_mask(query_groups, key_groups, window, key_padding_mask)
    out, _ = dense_attention(query, key, value, mask, scale=scale, softcap=softcap)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("top_k,query_top_k", SHAPES)
def test_logits_equal_dense_attention_under_the_asymmetric_mask(arch, top_k, query_top_k, monkeypatch):  # fmt: skip
    x, mask = left_pad([ids(1, N, seed=32)[0], ids(1, 57, seed=33)[0]])
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    _, fm = focus(arch, top_k=top_k, query_top_k=query_top_k, window=8)
    fast, fast_recs = run(fm, x, **kw)
    monkeypatch.setattr(focus_cache, "sparse_attention", _oracle_sparse_attention)
    slow, slow_recs = run(fm, x, **kw)
    real = mask.bool()
    torch.testing.assert_close(fast[real], slow[real], **tolerance("oracle"))
    for a, b in zip(fast_recs, slow_recs, strict=True):
        assert torch.equal(a["query_groups"], b["query_groups"])
        assert torch.equal(a["key_groups"], b["key_groups"])
        assert not a["query_groups"][~real].any() and not a["key_groups"][~real].any()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_query_top_k_equal_to_top_k_is_symmetric_routing(arch):
    x = ids(1, N, seed=34)
    _, plain = focus(arch, top_k=2)
    _, same = focus(arch, top_k=2, query_top_k=2)
    assert torch.equal(run(plain, x)[0], run(same, x)[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_wider_queries_keep_pairs_between_top_k_and_query_top_k(arch):
    """The guard that the setting reaches the layers: top-1 < (1, 2) < top-2 in pairs kept,
    and the logits differ from both symmetric routings."""
    x = ids(1, 160, seed=35)
    kept, outs = [], []
    for top_k, query_top_k in [(1, None), (1, 2), (2, None)]:
        _, fm = focus(arch, top_k=top_k, query_top_k=query_top_k, window=4, sink_tokens=0)
        out, recs = run(fm, x)
        outs.append(out)
        r = first_layer(recs)
        kept.append(pairs_retained(r["query_groups"], r["key_groups"], 4))
    assert kept[0] < kept[1] < kept[2]
    assert not torch.allclose(outs[1], outs[0]) and not torch.allclose(outs[1], outs[2])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("top_k,query_top_k", SHAPES)
def test_decoding_with_a_cache_equals_the_full_forward(arch, top_k, query_top_k):
    """Prefill, a chunk of 3, then single tokens (the fused routing path): every step's
    logits equal the full forward's rows; the cache holds the keys' top_k groups."""
    _, fm = focus(arch, top_k=top_k, query_top_k=query_top_k, window=16)
    x = ids(1, 136, seed=36)
    full, recs = run(fm, x)
    cache = DynamicCache(config=fm.config)
    for start, stop in [(0, 128), (128, 131)] + [(i, i + 1) for i in range(131, 136)]:
        with torch.no_grad():
            out = fm(input_ids=x[:, start:stop], cache=cache, use_cache=True).logits
        assert (out - full[:, start:stop]).abs().max() <= 1e-5, (start, stop)
    for r in recs:
        assert torch.equal(cache.layers[r["layer"]].groups, r["key_groups"])


def test_generate_with_cache_equals_without():
    _, fm = focus("llama", top_k=1, query_top_k=2, window=16)
    x = ids(1, 120, seed=37)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        cached = fm.generate(x, use_cache=True, **kw)
        plain = fm.generate(x, use_cache=False, **kw)
    assert torch.equal(cached, plain)


def test_sequence_routing_takes_query_and_key_groups_from_one_sinkhorn():
    x = ids(1, N, seed=38)
    _, fm = focus("llama", top_k=1, query_top_k=3, inference_routing="sequence", sink_tokens=0)
    _, recs = run(fm, x)
    _, sym = focus("llama", top_k=3, inference_routing="sequence", sink_tokens=0)
    first, sym_first = first_layer(recs), first_layer(run(sym, x)[1])
    assert torch.equal(first["query_groups"], sym_first["query_groups"])
    assert bool((first["key_groups"].sum(-1) == 1).all())
    assert not (first["key_groups"] & ~first["query_groups"]).any()


@pytest.mark.parametrize("bad", [0, 5, -1, 1.5, True, "2"])
def test_query_top_k_outside_1_to_k_is_refused(bad):
    with pytest.raises(ValueError, match="query_top_k"):
        FocusConfig(num_groups=4, top_k=1, query_top_k=bad)


def test_query_top_k_round_trips_and_older_files_load_without_it(tmp_path):
    cfg = FocusConfig(num_groups=4, top_k=1, query_top_k=2)
    assert FocusConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.resolved_query_top_k == 2 and cfg.replace(query_top_k=None).resolved_query_top_k == 1  # fmt: skip
    old = FocusConfig(num_groups=4, top_k=1).to_dict()
    del old["query_top_k"]
    assert FocusConfig.from_dict(old).query_top_k is None
    _, fm = focus("llama", top_k=1, query_top_k=2)
    fm.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "focus_config.json").read_text())["query_top_k"] == 2
    again = FocusModel.from_pretrained(build_model("llama"), tmp_path)
    assert again.focus_config.query_top_k == 2
    x = ids(1, 64, seed=39)
    assert torch.equal(run(again, x)[0], run(fm, x)[0])
    assert again.set_top_k(2).focus_config.query_top_k == 2  # set_top_k changes top_k only
