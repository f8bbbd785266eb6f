"""Query-key routing, ``FocusConfig.router_input="query_key"`` (docs/method.md §4): per
key-value head, keys and pooled queries before the rotary embedding pick their groups among
the head's centroids; the memberships against a float64 brute force from the module's own
pre-rotary states, the forward against the dense oracle under the per-head mask, decoding with
the dynamic cache against recomputing, the settings' round trip and refusals."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from tiny import build_model, focus, ids, left_pad, positions, word_tokenizer
from tiny_assets import WORDS
from tolerances import tolerance
from transformers import AutoModelForCausalLM

from focus_attention import export_model
from focus_attention.hf import FocusConfig, FocusModel, focus_cache
from focus_attention.hf import query_key as query_key_module
from focus_attention.hf.files import CONFIG_NAME
from focus_attention.hf.query_key import QueryKeyRouter
from focus_attention.ops import dense_attention, focus_mask

QK = dict(router_input="query_key")
N = 48
#: architectures with each way of computing the pre-rotary states: separate projections
#: (LLaMA; Qwen-2 with biases), per-head QK-norm (Gemma-3), whole-width QK-norm (OLMo-2),
#: GPT-2's fused projection (no rotary embedding)
KINDS = ("llama", "qwen2", "gemma3_text", "olmo2", "gpt2")


def _capture_pre_rotary(fm, arch: str) -> dict:
    """Hooks on the attention modules' own projections (or QK-norms): the first output of
    each per layer is the module's own pre-rotary state (the router's recomputation runs
    after it)."""
    seen: dict = {}
    hooks = []
    for i, module in fm._modules_by_layer.items():
        names = {"gpt2": ("c_attn",), "gemma3_text": ("q_norm", "k_norm"), "olmo2": ("q_norm", "k_norm")}  # fmt: skip
        for name in names.get(arch, ("q_proj", "k_proj")):

            def hook(_m, _a, out, key=(i, name)):
                seen.setdefault(key, out.detach().double())

            hooks.append(getattr(module, name).register_forward_hook(hook))
    return seen, hooks


def _states(seen: dict, fm, i: int, arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query [B, H, N, D], key [B, H_kv, N, D])`` float64 of layer ``i``."""
    module = fm._modules_by_layer[i]
    d = module.head_dim

    def heads(x):
        return x.view(*x.shape[:2], -1, d).transpose(1, 2) if x.dim() == 3 else x

    if arch == "gpt2":
        q, k, _ = seen[i, "c_attn"].split(module.split_size, dim=2)
        return heads(q), heads(k)
    if arch in ("gemma3_text", "olmo2"):
        return heads(seen[i, "q_norm"]), heads(seen[i, "k_norm"])
    return heads(seen[i, "q_proj"]), heads(seen[i, "k_proj"])


def _brute_groups(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool ``[..., K]``: the ``top_k`` best groups, ties to the lowest index, one row at
    a time in float64."""
    out = torch.zeros(scores.shape, dtype=torch.bool)
    flat, rows = out.view(-1, scores.shape[-1]), scores.reshape(-1, scores.shape[-1]).tolist()
    for r, row in enumerate(rows):
        for c in sorted(range(len(row)), key=lambda c: (-row[c], c))[:top_k]:
            flat[r, c] = True
    return out


@pytest.mark.parametrize(
    ("arch", "pooling"), [*((a, "mean") for a in KINDS), ("llama", "max"), ("gemma2", "max")]
)
def test_memberships_equal_a_float64_brute_force_from_the_pre_rotary_states(arch, pooling):
    top_k, query_top_k, sinks = 1, 2, 2
    _, fm = focus(arch, top_k=top_k, query_top_k=query_top_k, sink_tokens=sinks,
                  query_pooling=pooling, **QK)  # fmt: skip
    for r in fm.routers.values():  # a key mean and a bias, so that both are applied
        r.key_mean.normal_(generator=torch.Generator().manual_seed(r.layer_idx))
        r.routing_bias.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(7))
    seen, hooks = _capture_pre_rotary(fm, arch)
    x = ids(2, N, seed=5)
    with torch.no_grad(), fm.record_routing() as records:
        fm(input_ids=x, use_cache=False)
    for h in hooks:
        h.remove()
    for rec in records:
        i = rec["layer"]
        router = fm.routers[str(i)]
        q, k = _states(seen, fm, i, arch)
        c = router.centroids.double()
        g = q.shape[1] // k.shape[1]
        grouped = q.view(q.shape[0], k.shape[1], g, *q.shape[2:])
        bias = router.routing_bias.double()
        key_scores = torch.einsum("bhnd,hkd->bnhk", k - router.key_mean.double()[:, None], c) + bias
        if pooling == "mean":
            query_scores = torch.einsum("bhnd,hkd->bnhk", grouped.mean(2), c) + bias
        else:  # each centroid's best score over the query heads of the key-value head
            per_head = [torch.einsum("bhnd,hkd->bnhk", grouped[:, :, j], c) for j in range(g)]
            query_scores = torch.stack(per_head).amax(0) + bias
        keys = _brute_groups(key_scores, top_k)
        keys[:, :sinks] = True  # the sink tokens join every group of every head
        assert rec["key_groups"].shape == (2, N, k.shape[1], 4)
        assert torch.equal(rec["key_groups"], keys), i
        assert torch.equal(rec["query_groups"], _brute_groups(query_scores, query_top_k)), i


def _reference_scores(router, module, hidden):
    """``(key scores, query scores)`` float64 from the pre-rotary states of a float64 copy
    of ``module``."""
    with torch.no_grad():
        q, k = router.query_key(copy.deepcopy(module).double(), hidden.double())
    c, bias = router.centroids.double(), router.routing_bias.double()
    keys = torch.einsum("bhnd,hkd->bnhk", k - router.key_mean.double()[:, None], c) + bias
    grouped = q.view(q.shape[0], k.shape[1], -1, *q.shape[2:])
    if router.query_pooling == "mean":
        return keys, torch.einsum("bhnd,hkd->bnhk", grouped.mean(2), c) + bias
    return keys, torch.einsum("bhgnd,hkd->bnhgk", grouped, c).amax(3) + bias


def _pairs(fm):
    """``(attention module, its router)`` of each Focus layer."""
    return [(fm._modules_by_layer[int(i)], router) for i, router in fm.routers.items()]


def _perturb(router, seed):
    g = torch.Generator().manual_seed(seed)
    router.key_mean.normal_(generator=g)
    router.routing_bias.uniform_(-0.1, 0.1, generator=g)


@pytest.mark.parametrize(
    ("arch", "pooling", "dtype"),
    [("llama", "mean", torch.float32), ("qwen2", "mean", torch.float32), ("gpt2", "mean", torch.float32),
     ("gemma2", "max", torch.float32), ("qwen2", "max", torch.bfloat16), ("llama", "mean", torch.float16)],
)  # fmt: skip
def test_folded_scores_equal_the_scores_of_the_pre_rotary_states(arch, pooling, dtype):
    """The centroids folded into the module's query and key maps score as the recomputed
    states do: against float64, at most twice the recomputation's own error (plus float32
    rounding of the folded matrix)."""
    _, fm = focus(arch, dtype=dtype, query_pooling=pooling, **QK)
    hidden = torch.randn(2, 17, fm.base_model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)  # fmt: skip
    for module, router in _pairs(fm):
        _perturb(router, router.layer_idx)
        folded = router.folded_scores(module, hidden)
        assert folded is not None, arch
        with torch.no_grad():
            query, key = router.query_key(module, hidden)
            plain = router.key_scores(key), router.query_scores(query)
        for got, base, want in zip(folded, plain, _reference_scores(router, module, hidden), strict=True):  # fmt: skip
            assert got.shape == want.shape and got.dtype == torch.float32
            err, base_err = (got.double() - want).abs().max(), (base.double() - want).abs().max()
            assert err <= 2 * base_err + 1e-5 * want.abs().max(), (float(err), float(base_err))


@pytest.mark.parametrize("arch", ["gemma3_text", "olmo2"])
def test_query_key_norms_are_not_folded(arch):
    _, fm = focus(arch, **QK)
    module, router = _pairs(fm)[0]
    assert router.folded_scores(module, torch.zeros(1, 3, fm.base_model.config.hidden_size)) is None


def test_a_wrapped_projection_is_not_folded_and_routes_through_its_forward():
    """An adapter around ``q_proj`` (here a subclass, as LoRA layers are) changes the
    queries: the router then recomputes them with it."""

    class Shifted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    _, fm = focus("llama", **QK)
    hidden = torch.randn(1, 9, fm.base_model.config.hidden_size)
    for module in fm._modules_by_layer.values():
        old = module.q_proj
        module.q_proj = Shifted(old.in_features, old.out_features, bias=False)
        module.q_proj.load_state_dict(old.state_dict())
    module, router = _pairs(fm)[0]
    assert router.folded_scores(module, hidden) is None
    _, queries = router.group_sets(module, hidden, (1, 1))
    with torch.no_grad():
        query, _ = router.query_key(module, hidden)
    assert torch.equal(queries, query_key_module.head_memberships(router.query_scores(query), 1))


def test_the_folded_maps_follow_in_place_changes_of_centroids_bias_and_projections():
    """Training steps and loads change the centroids, ``key_mean``, ``routing_bias`` and
    the projections in place: the next call folds them again. A change through ``.data``
    (no version counter) is seen after ``train()`` / ``eval()``."""
    _, fm = focus("qwen2", **QK)
    module, router = _pairs(fm)[0]
    hidden = torch.randn(2, 11, fm.base_model.config.hidden_size, generator=torch.Generator().manual_seed(4))  # fmt: skip

    def check():
        want = _reference_scores(router, module, hidden)
        for got, ref in zip(router.folded_scores(module, hidden), want, strict=True):
            torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)

    check()
    changes = (
        lambda: router.centroids.mul_(-2.0),
        lambda: router.key_mean.add_(0.5),
        lambda: router.routing_bias.uniform_(-1, 1),
        lambda: module.q_proj.weight.mul_(1.5),
        lambda: module.k_proj.bias.add_(0.3),
        lambda: (router.centroids.data.mul_(0.5), fm.eval()),
        lambda: router.load_state_dict({**router.state_dict(), "centroids": -router.centroids}),
    )
    for change in changes:
        with torch.no_grad():
            change()
        check()


def test_routing_computes_no_query_or_key_projection_beyond_the_modules_own():
    """With folded maps a forward runs each layer's ``q_proj`` and ``k_proj`` once (the
    attention's own), not again for routing."""
    _, fm = focus("llama", **QK)
    calls = []
    hooks = [getattr(m, name).register_forward_hook(lambda *_: calls.append(1))
             for m, _ in _pairs(fm) for name in ("q_proj", "k_proj")]  # fmt: skip
    with torch.no_grad():
        fm(input_ids=ids(1, N, seed=2), use_cache=False)
    for h in hooks:
        h.remove()
    assert len(calls) == 2 * len(fm.routers)


def _oracle_sparse_attention(query, key, value, query_groups, key_groups, window, *, scale=None, key_padding_mask=None, softcap=None, backend="auto"):  # fmt: skip
    mask = focus_mask(query_groups, key_groups, window, key_padding_mask)
    assert mask.dim() == 4  # a mask per key-value head
    out, _ = dense_attention(query.double(), key.double(), value.double(), mask, scale=scale, softcap=softcap)  # fmt: skip
    return out.to(query.dtype)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_logits_equal_the_float64_oracle_under_the_per_head_mask(arch, monkeypatch):
    x, mask = left_pad([ids(1, N, seed=6)[0], ids(1, 31, seed=7)[0]])
    kw = dict(attention_mask=mask, position_ids=positions(mask), use_cache=False)
    _, fm = focus(arch, top_k=1, window=8, **QK)
    with torch.no_grad():
        fast = fm(input_ids=x, **kw).logits
        with fm.disable_focus():
            dense = fm(input_ids=x, **kw).logits
        monkeypatch.setattr(focus_cache, "sparse_attention", _oracle_sparse_attention)
        slow = fm(input_ids=x, **kw).logits
    real = mask.bool()
    torch.testing.assert_close(fast[real], slow[real], **tolerance("oracle"))
    assert not torch.allclose(fast[real], dense[real], atol=1e-3)  # the groups matter
    with torch.no_grad():  # the maps: each query head under its key-value head's mask
        maps = fm(input_ids=x, output_attentions=True, **kw).attentions
    for m in maps:
        assert m.shape == (2, fm.base_model.config.num_attention_heads, N, N)
        torch.testing.assert_close(m.sum(-1)[:, :, -20:], torch.ones_like(m.sum(-1)[:, :, -20:]))


@pytest.mark.parametrize("arch", ["llama", "olmo2", "gpt2"])
def test_decoding_with_the_dynamic_cache_equals_recomputing(arch):
    _, fm = focus(arch, top_k=1, query_top_k=2, window=6, **QK)
    x = ids(2, 30, seed=8)
    kw = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        cached = fm.generate(input_ids=x, **kw)  # the dynamic cache, generate's default
        recomputed = fm.generate(input_ids=x, use_cache=False, **kw)
    assert torch.equal(cached.sequences, recomputed.sequences)
    for a, b in zip(cached.scores, recomputed.scores, strict=True):
        torch.testing.assert_close(a, b, **tolerance("oracle"))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_window_over_the_whole_input_is_the_base_model(arch):
    ref, fm = focus(arch, top_k=1, window=N, **QK)
    x = ids(2, N, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(fm(input_ids=x).logits, ref(input_ids=x).logits, **tolerance("oracle"))  # fmt: skip


def test_routers_hold_centroids_per_key_value_head_only():
    _, fm = focus("llama", num_groups=4, **QK)
    router = fm.routers["0"]
    assert isinstance(router, QueryKeyRouter)
    assert [n for n, p in fm.named_parameters() if p.requires_grad] == [
        f"routers.{i}.centroids" for i in fm.routers
    ]
    assert router.centroids.shape == (2, 4, 16)  # [H_kv, K, head_dim]
    assert sorted(fm.focus_state_dict()) == sorted(
        f"layer.{i}.{n}" for i in fm.routers for n in QueryKeyRouter.TENSORS
    )


def test_the_setting_round_trips_through_save_load_and_export(tmp_path):
    _, fm = focus("llama", top_k=1, **QK)
    with torch.no_grad():
        fm.routers["1"].centroids.mul_(-1.5)
        fm.routers["1"].key_mean.fill_(0.25)
    fm.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / CONFIG_NAME).read_text())
    assert saved["router_input"] == "query_key"
    assert "| router_input | `query_key` |" in (tmp_path / "adapter" / "README.md").read_text()
    loaded = FocusModel.from_pretrained(build_model("llama"), tmp_path / "adapter")
    assert loaded.focus_config == fm.focus_config
    x = ids(1, N, seed=10)
    with torch.no_grad():
        want = fm(input_ids=x).logits
        assert torch.equal(loaded(input_ids=x).logits, want)
    export_model(fm, tmp_path / "export", word_tokenizer(WORDS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True)
    assert model.focus_model.focus_config.router_input == "query_key"
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, want)
    with pytest.raises(ValueError, match="router_input"):
        build = FocusModel(build_model("llama"), FocusConfig(num_groups=4, top_k=1, window=8))
        build.load_routers(tmp_path / "adapter")


def test_bad_values_and_what_query_key_routing_cannot_run_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"FocusConfig.router_input: received 'qk'.*query_key"):
        FocusConfig(router_input="qk")
    with pytest.raises(ValueError, match=r"FocusConfig.query_pooling: received 'sum'"):
        FocusConfig(router_input="query_key", query_pooling="sum")
    with pytest.raises(ValueError, match=r"query_pooling.*'mean' unless router_input"):
        FocusConfig(query_pooling="max")
    _, fm = focus("llama", **QK)
    x = ids(1, 20, seed=11)
    fm.train()
    with pytest.raises(ValueError, match="router_input='query_key' cannot run soft"):
        fm(input_ids=x)
    fm.eval()
    for change, what in [(dict(inference_routing="sequence"), "sequence"),
                         (dict(dense_heads=((0, 1),)), "dense_heads")]:  # fmt: skip
        fm.focus_config = fm.focus_config.replace(**change)
        with pytest.raises(ValueError, match=what), torch.no_grad():
            fm(input_ids=x, use_cache=False)
        fm.focus_config = fm.focus_config.replace(inference_routing="causal", dense_heads=())
    with torch.no_grad():
        fm.routers["1"].centroids[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="Focus layer 1: NaN query-key routing scores"), torch.no_grad():  # fmt: skip
        fm(input_ids=x, use_cache=False)
    monkeypatch.delitem(query_key_module.PRE_ROTARY, "llama")
    with pytest.raises(ValueError, match="does not support model type 'llama'"):
        focus("llama", **QK)
