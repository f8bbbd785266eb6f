"""``FocusConfig.attention_backend``: the backend of the Focus layers' sparse attention. Every
built-in backend that can run a model's calls gives the logits of the default one: prefill,
decoding with a KV cache (chunked too) and left padding, on every architecture; the setting
reaches the op (a registered backend sees the calls), is saved with the adapter, changes at
load time of an export, and a bad name or a backend that cannot run a call is refused with
its reason."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids, left_pad, positions
from tolerances import tolerance

from focus_attention.hf import FocusConfig, FocusModel
from focus_attention.hf.compat import cache_kwargs, cache_of
from focus_attention.ops import BackendUnavailable, SparseBackend, register_backend
from focus_attention.ops.sparse import dispatch
from focus_attention.ops.sparse.math import run_math

N = 40
#: backends that run any call a tiny model makes on the CPU (fp32, soft-capping included)
ANY_CALL = ("gather", "masked", "math")


def _logits(model, x, **kw):
    with torch.no_grad():
        return model(input_ids=x, **kw).logits


def _decoded(fm, x, cuts, mask=None):
    """Logits of ``x`` fed in the chunks between ``cuts``, through one KV cache (with the
    2-D attention ``mask`` so far and the chunk's positions, if given)."""
    cache, got = None, []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:], strict=False):
            extra = {}
            if mask is not None:
                extra = dict(attention_mask=mask[:, :b], position_ids=positions(mask)[:, a:b])
            out = fm(input_ids=x[:, a:b], use_cache=True, **extra,
                     **({} if cache is None else cache_kwargs(cache)))  # fmt: skip
            cache = cache_of(out)
            got.append(out.logits)
    return torch.cat(got, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ANY_CALL)
def test_prefill_and_decoding_equal_the_default_backend(arch, backend):
    """Sparse routing (top-1 of 4 groups, window 8): the whole sequence, and a prefill
    followed by a chunk of 3 and single tokens, give the default backend's logits."""
    _, fm = focus(arch)
    x = ids(2, N, seed=3)
    reference = _logits(fm, x)
    fm.focus_config = fm.focus_config.override(attention_backend=backend)
    torch.testing.assert_close(_logits(fm, x), reference, **tolerance("oracle"))
    cuts = [0, 25, 28, *range(29, N + 1)]
    torch.testing.assert_close(_decoded(fm, x, cuts), reference, **tolerance("oracle"))


@pytest.mark.parametrize("backend", ANY_CALL)
def test_left_padded_decoding_equals_the_default_backend(backend):
    _, fm = focus("llama")
    x, mask = left_pad([ids(1, N, seed=5)[0], ids(1, 17, seed=6)[0]])
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    reference = _logits(fm, x, **kw)
    fm.focus_config = fm.focus_config.override(attention_backend=backend)
    got = _decoded(fm, x, [0, 30, *range(31, N + 1)], mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], reference[real], **tolerance("oracle"))


def test_the_setting_reaches_the_op(monkeypatch):
    """A backend registered under a new name runs every Focus layer's call, prefill and
    decoding alike, once the config names it."""
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    calls = []

    def recording(inputs):
        calls.append(inputs.query.shape[2])
        return run_math(inputs)

    register_backend(SparseBackend(name="recording-test", run=recording, priority=1000,
                                   softcap=True))  # fmt: skip
    _, fm = focus("llama", attention_backend="recording-test")
    x = ids(1, 20, seed=7)
    _decoded(fm, x, [0, 18, 19, 20])
    layers = len(fm.focus_layers)
    assert calls == [18] * layers + [1] * layers + [1] * layers


def test_saved_with_the_adapter_and_older_adapters_load_with_auto(tmp_path):
    _, fm = focus("llama", attention_backend="masked")
    fm.save_pretrained(tmp_path / "a")
    base, _ = focus("llama")
    loaded = FocusModel.from_pretrained(base, tmp_path / "a")
    assert loaded.focus_config.attention_backend == "masked"
    assert FocusConfig().attention_backend == "auto"
    assert FocusConfig.from_dict({"num_groups": 4}).attention_backend == "auto"


@pytest.mark.parametrize("name", ["nope", "", None, 3])
def test_an_unknown_backend_is_refused_with_the_choices(name):
    with pytest.raises(ValueError, match=r"FocusConfig.attention_backend: .*masked"):
        FocusConfig(attention_backend=name)


def test_a_backend_that_cannot_run_a_call_names_its_reason():
    """``cpu_fused`` applies no soft-capping: Gemma-2's layers are refused when they run."""
    _, fm = focus("gemma2", attention_backend="cpu_fused")
    with pytest.raises(BackendUnavailable, match=r"FocusConfig.attention_backend='cpu_fused' cannot run layer \d+'s call: .*softcap"):  # fmt: skip
        _logits(fm, ids(1, 12, seed=8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "gather", "masked"])
def test_decoding_on_cuda_equals_the_cpu_model(backend):
    """On a GPU (float32), prefill then single tokens through the cache with each decoding
    backend give the logits of the same model on the CPU."""
    _, fm = focus("llama")
    x = ids(2, N, seed=11)
    reference = _logits(fm, x)
    fm = fm.to("cuda")
    fm.focus_config = fm.focus_config.override(attention_backend=backend)
    got = _decoded(fm, x.cuda(), [0, 30, *range(31, N + 1)])
    torch.testing.assert_close(got.cpu(), reference, **tolerance("device"))
