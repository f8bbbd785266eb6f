"""``FocusConfig.dense_heads``: the listed key-value heads of a Focus layer (and their query
heads) attend densely with the base model's attention while the layer's other heads route.
Each head's output is exactly that of its kind (the dense layer's for a dense head, the
routed layer's for the others), on every architecture, in top-k and soft routing, with
padding, KV-cache decoding and bfloat16; every head dense is a dense layer; the setting is
saved with the adapter and checked."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids, left_pad, positions
from tolerances import DIFFERENT, tolerance

from focus_attention.hf import FocusConfig, FocusModel, get_focus_model
from focus_attention.hf.architectures import attention_modules, get_architecture
from focus_attention.hf.compat import cache_kwargs, cache_of
from focus_attention.hf.config import parse_layer_heads
from focus_attention.hf.heads import head_split

N = 40


def _logits(model, x, **kw):
    with torch.no_grad():
        return model(input_ids=x, **kw).logits


def _head_inputs(fm: FocusModel, layer: int, x, **kw) -> torch.Tensor:
    """The input of ``layer``'s output projection, ``[B, N, H, D]``: every head's attention."""
    attn = attention_modules(fm.base_model, get_architecture(fm.base_model))[layer]
    proj = next(m for n, m in attn.named_children() if n in ("o_proj", "c_proj"))
    seen = []
    hook = proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        _logits(fm, x, **kw)
    finally:
        hook.remove()
    heads = fm.base_model.config.num_attention_heads
    out = seen[0]
    return out.reshape(*out.shape[:2], heads, -1)


def _setup(arch: str, dtype=torch.float32):
    """``(fm, last Focus layer, kv heads of it, query heads per kv head, dense kv head)``."""
    _, fm = focus(arch, dtype=dtype)
    last = fm.focus_layers[-1]
    cfg = fm.base_model.config
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return fm, last, kv, cfg.num_attention_heads // kv, kv - 1


def _each_kind(fm, last, dense_kv, x, **kw):
    """Head inputs of the last layer with one dense kv head, with the layer dense, routed."""
    cfg = fm.focus_config
    fm.focus_config = cfg.replace(dense_heads=[(last, dense_kv)])
    mixed = _head_inputs(fm, last, x, **kw)
    fm.focus_config = cfg.replace(dense_layers=[last])
    dense = _head_inputs(fm, last, x, **kw)
    fm.focus_config = cfg
    routed = _head_inputs(fm, last, x, **kw)
    return mixed, dense, routed


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("routing", ["topk", "soft"])
def test_each_head_attends_as_its_kind(arch, routing):
    fm, last, kv, group, dense_kv = _setup(arch)
    fm.set_routing(routing)
    x, mask = left_pad([ids(1, N, seed=5)[0], ids(1, N - 13, seed=6)[0]])
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    mixed, dense, routed = _each_kind(fm, last, dense_kv, x, **kw)
    real = mask.bool()
    heads = torch.arange(mixed.shape[2])
    is_dense = heads // group == dense_kv
    torch.testing.assert_close(
        mixed[real][:, is_dense], dense[real][:, is_dense], **tolerance("oracle")
    )
    torch.testing.assert_close(mixed[real][:, ~is_dense], routed[real][:, ~is_dense], **tolerance("oracle"))  # fmt: skip
    # guard: routed and dense heads differ here, so the test can fail
    assert not torch.allclose(dense[real][:, is_dense], routed[real][:, is_dense], **DIFFERENT)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_head_dense_is_a_dense_layer(arch):
    fm, last, kv, _, _ = _setup(arch)
    x = ids(2, N, seed=7)
    cfg = fm.focus_config
    fm.focus_config = cfg.replace(dense_heads=[(last, h) for h in range(kv)])
    every_head = _logits(fm, x)
    fm.focus_config = cfg.replace(dense_layers=[last])
    torch.testing.assert_close(every_head, _logits(fm, x), **tolerance("oracle"))


def _assert_decoding_equals_whole(fm, x, prefill: int) -> None:
    """Prefill ``prefill`` tokens, then one token at a time through the KV cache (calls of
    one query: every head routed, the dense heads' outputs overwritten): every step's
    logits equal the whole sequence's."""
    n = x.shape[1]
    whole = _logits(fm, x)
    with torch.no_grad():
        out = fm(input_ids=x[:, :prefill], use_cache=True)
        steps = [out.logits[:, -1]]
        cache = cache_of(out)
        for i in range(prefill, n - 1):
            out = fm(input_ids=x[:, i : i + 1], use_cache=True, **cache_kwargs(cache))
            cache = cache_of(out)
            steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), whole[:, prefill - 1 : n - 1], **tolerance("oracle"))  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_with_a_cache_equals_the_whole_sequence(arch):
    """The cache keeps what both kinds of heads need."""
    fm, last, _, _, dense_kv = _setup(arch)
    fm.focus_config = fm.focus_config.replace(dense_heads=[(last, dense_kv)])
    _assert_decoding_equals_whole(fm, ids(2, N, seed=8), N - 6)


@pytest.mark.parametrize("arch,overrides", [("gpt2", {}), ("llama", {"num_key_value_heads": 4})])
def test_heads_apart_attend_as_their_kind_in_prefill_and_decoding(arch, overrides):
    """Dense key-value heads 0 and 2 of 4 (not consecutive: selected by index, not by a
    view): each head attends as its kind over a whole sequence, and decoding through the
    cache equals the whole sequence."""
    _, fm = focus(arch, model_overrides=overrides)
    last = fm.focus_layers[-1]
    group = fm.base_model.config.num_attention_heads // 4
    x = ids(2, N, seed=9)
    cfg = fm.focus_config
    fm.focus_config = cfg.replace(dense_heads=[(last, 0), (last, 2)])
    mixed = _head_inputs(fm, last, x)
    _assert_decoding_equals_whole(fm, x, N - 5)
    fm.focus_config = cfg.replace(dense_layers=[last])
    dense = _head_inputs(fm, last, x)
    fm.focus_config = cfg
    routed = _head_inputs(fm, last, x)
    is_dense = torch.isin(torch.arange(mixed.shape[2]) // group, torch.tensor([0, 2]))
    torch.testing.assert_close(mixed[:, :, is_dense], dense[:, :, is_dense], **tolerance("oracle"))
    torch.testing.assert_close(mixed[:, :, ~is_dense], routed[:, :, ~is_dense], **tolerance("oracle"))  # fmt: skip
    assert not torch.allclose(dense[:, :, is_dense], routed[:, :, is_dense], **DIFFERENT)


def test_the_head_split_selects_consecutive_heads_by_a_view():
    split = head_split(3, ((3, 1), (3, 2), (0, 0)), num_heads=8, num_kv_heads=4, device="cpu")
    assert (split.dense_kv_span, split.dense_q_span) == ((1, 2), (2, 4))
    t = torch.randn(1, 4, 5, 2)
    assert split.dense_keys(t)._base is t  # a view
    torch.testing.assert_close(split.dense_keys(t), t[:, 1:3])
    apart = head_split(3, ((3, 0), (3, 2)), num_heads=8, num_kv_heads=4, device="cpu")
    assert apart.dense_kv_span is None
    torch.testing.assert_close(apart.dense_keys(t), t[:, [0, 2]])
    assert apart.dense_queries(torch.randn(1, 8, 5, 2)).shape == (1, 4, 5, 2)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_bfloat16_heads_attend_as_their_kind(arch):
    fm, last, _, group, dense_kv = _setup(arch, dtype=torch.bfloat16)
    x = ids(2, N, seed=9)
    mixed, dense, routed = _each_kind(fm, last, dense_kv, x)
    is_dense = torch.arange(mixed.shape[2]) // group == dense_kv
    torch.testing.assert_close(mixed[:, :, is_dense], dense[:, :, is_dense])
    torch.testing.assert_close(mixed[:, :, ~is_dense], routed[:, :, ~is_dense])


def test_dense_heads_are_saved_with_the_adapter(tmp_path):
    _, fm = focus("llama")
    pairs = ((fm.focus_layers[-1], 1),)
    fm.focus_config = fm.focus_config.replace(dense_heads=pairs)
    x = ids(1, N, seed=10)
    want = _logits(fm, x)
    fm.save_pretrained(tmp_path)
    loaded = FocusModel.from_pretrained(fm.unload(), tmp_path)
    assert loaded.focus_config.dense_heads == pairs
    torch.testing.assert_close(_logits(loaded, x), want, **tolerance("bitwise"))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([(1, -1)], "pairs of ints >= 0"),
        ([(1,)], "pairs of ints >= 0"),
        ("1:0", "pairs of ints >= 0"),
        ([(1, 0), [1, 0]], "distinct"),
    ],
)
def test_bad_dense_heads_are_refused(value, match):
    with pytest.raises(ValueError, match=f"dense_heads.*{match}"):
        FocusConfig(dense_heads=value)


def test_dense_heads_of_dense_or_other_layers_are_refused():
    with pytest.raises(ValueError, match="layers \\[1\\] are in dense_layers"):
        FocusConfig(dense_heads=[(1, 0)], dense_layers=[1])
    with pytest.raises(ValueError, match="layers \\[3\\] are not"):
        FocusConfig(layers=[0, 1], dense_heads=[(3, 0)])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_head_beyond_the_model_is_refused_before_any_forward(arch):
    """When the config is assigned or the adapter built (an export or a load would otherwise
    write or return a model that fails at its first forward), naming the heads."""
    fm, last, kv, _, _ = _setup(arch)
    before = fm.focus_config
    with pytest.raises(ValueError, match=rf"dense_heads: received \[\({last}, {kv}\)\].*0\.\.{kv - 1}"):  # fmt: skip
        fm.focus_config = fm.focus_config.replace(dense_heads=[(last, kv)])
    assert fm.focus_config == before
    fm.focus_config = fm.focus_config.replace(dense_heads=[(last, kv - 1)])  # the last head is fine
    base = fm.unload()
    with pytest.raises(ValueError, match=f"0..{kv - 1}"):
        get_focus_model(base, FocusConfig(num_groups=4, dense_heads=[(last, kv + 3)]))


def test_the_flag_reads_layer_head_pairs():
    assert parse_layer_heads("18:0, 20:1") == ((18, 0), (20, 1))
    for text in ("18", "18:x", "18:0:1", "-1:0"):
        with pytest.raises(ValueError, match="LAYER:HEAD"):
            parse_layer_heads(text)
