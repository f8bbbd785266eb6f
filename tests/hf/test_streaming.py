"""``inference_routing="streaming"``: the reference without groups (DuoAttention's streaming
heads). A query sees its window and the sink tokens, nothing else: the logits equal the base
model's under that mask given as a 4-D attention mask (an oracle outside the Focus op), on
every architecture, with left padding (the sinks are the first real tokens), through the KV
cache (chunked too), beside dense heads, at odd lengths, with right padding and in half
precision, whatever ``top_k``; the setting is saved and checked."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, build_model, focus, ids, left_pad, positions
from tolerances import tolerance

from focus_attention.hf import FocusConfig, FocusModel
from focus_attention.hf.compat import cache_kwargs, cache_of

N = 40
WINDOW = 8
SINKS = 3


def _logits(model, x, **kw):
    with torch.no_grad():
        return model(input_ids=x, **kw).logits


def _streaming_mask(real: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Additive float mask ``[B, 1, N, N]``: key ``j`` visible to query ``i`` when both are
    real, ``j <= i``, and ``i - j < window`` or ``j`` is among the first ``sinks`` real
    tokens of its row."""
    n = real.shape[1]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    rank = real.long().cumsum(1) - 1  # index of each real token among its row's real tokens
    sink = real & (rank < sinks)
    visible = (j <= i) & ((i - j < window) | sink[:, None, :]) & real[:, None, :]
    visible = visible | torch.eye(n, dtype=torch.bool)  # padding rows: not compared
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None]


def _streaming(arch: str, **cfg):
    """``(base model, Focus model)`` with Focus on every layer (the 4-D oracle mask replaces
    Gemma's sliding masks too) and streaming routing."""
    layers = range(build_model(arch).config.num_hidden_layers)
    settings = dict(num_groups=4, top_k=1, window=WINDOW, sink_tokens=SINKS, layers=layers)
    return focus(arch, inference_routing="streaming", **{**settings, **cfg})


@pytest.mark.parametrize("arch", ARCHS)
def test_equals_the_base_model_under_the_window_and_sink_mask(arch):
    ref, fm = _streaming(arch)
    x = ids(2, N, seed=1)
    oracle = _logits(ref, x, attention_mask=_streaming_mask(torch.ones(2, N, dtype=torch.bool), WINDOW, SINKS))  # fmt: skip
    torch.testing.assert_close(_logits(fm, x), oracle, **tolerance("oracle"))
    # top_k and the routers do not enter
    fm.focus_config = fm.focus_config.replace(top_k=3)
    torch.testing.assert_close(_logits(fm, x), oracle, **tolerance("oracle"))
    # guard: routed top-1 sees more than the window and the sinks, so the test can fail
    fm.focus_config = fm.focus_config.replace(top_k=1, inference_routing="causal")
    assert (_logits(fm, x) - oracle).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma2"])
@pytest.mark.parametrize("sinks", [0, SINKS])
def test_left_padding_keeps_the_first_real_tokens_as_sinks(arch, sinks):
    ref, fm = _streaming(arch, sink_tokens=sinks)
    x, mask = left_pad([ids(1, N, seed=2)[0], ids(1, N - 11, seed=3)[0]])
    pos = positions(mask)
    real = mask.bool()
    oracle = _logits(ref, x, attention_mask=_streaming_mask(real, WINDOW, sinks), position_ids=pos)  # fmt: skip
    out = _logits(fm, x, attention_mask=mask, position_ids=pos)
    torch.testing.assert_close(out[real], oracle[real], **tolerance("oracle"))


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_with_a_cache_equals_the_whole_sequence(arch):
    """The cache keeps the sinks in every group and the other keys in none."""
    _, fm = _streaming(arch, layers=None)
    x = ids(2, N, seed=4)
    whole = _logits(fm, x)
    prefill = N - 7
    with torch.no_grad():
        out = fm(input_ids=x[:, :prefill], use_cache=True)
        steps, cache = [out.logits[:, -1]], cache_of(out)
        for i in range(prefill, N - 1):
            out = fm(input_ids=x[:, i : i + 1], use_cache=True, **cache_kwargs(cache))
            steps.append(out.logits[:, -1])
            cache = cache_of(out)
    torch.testing.assert_close(torch.stack(steps, 1), whole[:, prefill - 1 : N - 1], **tolerance("oracle"))  # fmt: skip


def test_beside_dense_heads_each_head_attends_as_its_kind():
    """Dense heads attend densely, the layer's other heads stream: with every key-value head
    of every layer dense the model is the base model, with none it is the oracle above."""
    ref, fm = _streaming("llama")
    x = ids(2, N, seed=5)
    kv = fm.base_model.config.num_key_value_heads
    every = tuple((layer, h) for layer in fm.focus_layers for h in range(kv))
    fm.focus_config = fm.focus_config.replace(dense_heads=every)
    torch.testing.assert_close(_logits(fm, x), _logits(ref, x), **tolerance("oracle"))
    # one dense head changes the model, in prefill and in decoding alike
    fm.focus_config = fm.focus_config.replace(dense_heads=((fm.focus_layers[-1], 0),))
    whole = _logits(fm, x)
    oracle = _logits(ref, x, attention_mask=_streaming_mask(torch.ones(2, N, dtype=torch.bool), WINDOW, SINKS))  # fmt: skip
    assert (whole - oracle).abs().max() > 1e-4
    with torch.no_grad():
        out = fm(input_ids=x[:, :-1], use_cache=True)
        last = fm(input_ids=x[:, -1:], use_cache=True, **cache_kwargs(cache_of(out))).logits
    torch.testing.assert_close(last[:, -1], whole[:, -1], **tolerance("oracle"))


def test_the_setting_is_saved_with_the_adapter(tmp_path):
    _, fm = _streaming("llama", layers=None)
    fm.save_pretrained(tmp_path)
    back = FocusModel.from_pretrained(build_model("llama"), tmp_path)
    assert back.focus_config.inference_routing == "streaming"
    x = ids(1, N, seed=6)
    torch.testing.assert_close(_logits(back, x), _logits(fm, x), **tolerance("bitwise"))


def test_unknown_inference_routing_names_the_choices():
    with pytest.raises(ValueError, match="inference_routing.*streaming"):
        FocusConfig(inference_routing="none")


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 31, 33])
@pytest.mark.parametrize("sinks", [0, SINKS])
def test_odd_lengths_equal_the_oracle(n, sinks):
    """Lengths around the window (8) and the sinks, batch 2; with no sinks group 0 holds no
    key at all (an empty group): local attention only, no NaN."""
    ref, fm = _streaming("llama", sink_tokens=sinks)
    x = ids(2, n, seed=n)
    oracle = _logits(ref, x, attention_mask=_streaming_mask(torch.ones(2, n, dtype=torch.bool), WINDOW, sinks))  # fmt: skip
    out = _logits(fm, x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, oracle, **tolerance("oracle"))


def test_chunked_prefill_then_decoding_equals_the_whole_sequence():
    """Prefill, then 3 tokens in one call, then one at a time: each call's logits equal the
    matching rows of one forward over the whole sequence."""
    _, fm = _streaming("llama", layers=None)
    x = ids(1, N, seed=9)
    whole = _logits(fm, x)
    cuts = [0, 25, 28, *range(29, N + 1)]
    with torch.no_grad():
        cache, got = None, []
        for a, b in zip(cuts, cuts[1:], strict=False):
            kw = {} if cache is None else cache_kwargs(cache)
            out = fm(input_ids=x[:, a:b], use_cache=True, **kw)
            cache = cache_of(out)
            got.append(out.logits)
    torch.testing.assert_close(torch.cat(got, 1), whole, **tolerance("oracle"))


def test_right_padding_is_invisible():
    """Right padding: each real token's logits equal its sequence's alone."""
    from tiny import right_pad

    _, fm = _streaming("llama")
    a, b = ids(1, N, seed=10)[0], ids(1, N - 15, seed=11)[0]
    x, mask = right_pad([a, b])
    out = _logits(fm, x, attention_mask=mask)
    torch.testing.assert_close(out[1, : N - 15], _logits(fm, b[None])[0], **tolerance("oracle"))
    torch.testing.assert_close(out[0], _logits(fm, a[None])[0], **tolerance("oracle"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_the_base_models_own_error(dtype):
    """Against a float64 oracle (the base model under the 4-D mask), the half-precision
    Focus model errs at most twice as much as the half-precision base model under the same
    mask, and stays finite."""
    x = ids(2, N, seed=12)
    mask = _streaming_mask(torch.ones(2, N, dtype=torch.bool), WINDOW, SINKS)
    ref64, _ = _streaming("llama", dtype=torch.float64)
    oracle = _logits(ref64, x, attention_mask=mask.double())
    ref, fm = _streaming("llama", dtype=dtype)
    base_err = (_logits(ref, x, attention_mask=mask.to(dtype)).double() - oracle).abs().max()
    got = _logits(fm, x).double()
    assert torch.isfinite(got).all()
    assert (got - oracle).abs().max() <= 2 * base_err
