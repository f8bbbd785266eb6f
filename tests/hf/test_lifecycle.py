"""A Focus model through the everyday steps of a Hugging Face model's life: copies, pickling,
dtype casts, device moves, lazy (meta) and low-memory loading, ``device_map``, attention maps
and implementation switches. After each step the model either works exactly as before or
refuses with a clear error; the routers are never silently rounded, dropped or uninitialised."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from tiny import FOCUS_DEFAULTS, build_model, focus, ids
from tolerances import tolerance
from transformers import AutoModelForCausalLM

from focus_attention.hf import (
    ROUTER_DTYPE,
    FocusBaseMismatchWarning,
    FocusConfig,
    FocusModel,
    FocusSlidingWindowWarning,
    get_focus_model,
)


def logits(model, x, **kw):
    with torch.no_grad():
        return model(input_ids=x, **kw).logits


def router_tensors(model: FocusModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.routers.state_dict().items()}


def trained_like(model: FocusModel, seed: int = 1) -> FocusModel:
    """Perturb the routers (as training would) so that a lost or re-initialised router
    shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in model.routers.values():
            router.centroids.add_(0.5 * torch.randn(router.centroids.shape, generator=gen))
            router.routing_bias.add_(0.1 * torch.randn(router.routing_bias.shape, generator=gen))
    return model


# --- copies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_works_and_equals_the_original(arch, how):
    _, fm = focus(arch)
    trained_like(fm)
    x = ids(2, 40, seed=1)
    if how == "deepcopy":
        clone = copy.deepcopy(fm)
    else:
        buf = io.BytesIO()
        torch.save(fm, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    assert torch.equal(logits(clone, x), logits(fm, x))
    out = clone.generate(x, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, fm.generate(x, max_new_tokens=12, do_sample=False))


def test_a_copy_is_independent_of_the_original():
    _, fm = focus("llama")
    x = ids(2, 40, seed=2)
    before = logits(fm, x)
    clone = copy.deepcopy(fm)
    trained_like(clone, seed=3)
    clone.set_top_k(2)
    clone.set_routing("soft")
    clone.train()
    clone(input_ids=x)  # a soft-routing call updates the clone's routing bias
    assert fm.focus_config.top_k == 1 and fm.routing_mode == "topk"
    assert torch.equal(logits(fm, x), before)
    with fm.disable_focus():
        assert clone.focus_config.top_k == 2  # the clone's Focus stays on
        assert not torch.equal(logits(fm, x), before)
    assert not torch.equal(logits(clone.eval(), x), before)


def test_the_original_still_works_after_its_copy_is_unloaded():
    _, fm = focus("llama")
    x = ids(1, 30, seed=3)
    before = logits(fm, x)
    clone = copy.deepcopy(fm)
    clone.unload()
    assert torch.equal(logits(fm, x), before)


# --- dtype casts and device moves ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("cast", ["to", "method"])
def test_casts_keep_the_routers_in_float32(dtype, cast):
    _, fm = focus("llama")
    trained_like(fm)
    saved = router_tensors(fm)
    if cast == "to":
        fm.to(dtype)
    else:
        {torch.bfloat16: fm.bfloat16, torch.float16: fm.half, torch.float64: fm.double}[dtype]()
    assert next(fm.base_model.parameters()).dtype == dtype
    for name, t in fm.routers.state_dict().items():
        if t.is_floating_point():
            assert t.dtype == ROUTER_DTYPE, name
        assert torch.equal(t, saved[name]), name
    fm.float()
    assert all(torch.equal(t, saved[k]) for k, t in fm.routers.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routing_does_not_depend_on_the_order_of_wrap_and_cast(tmp_path, dtype):
    _, fm = focus("llama")
    trained_like(fm)
    fm.save_pretrained(tmp_path)
    x = ids(4, 256, seed=4)
    wrap_then_cast = fm.to(dtype)
    with warnings.catch_warnings():  # a cast copy of the same base is the same base
        warnings.simplefilter("error", FocusBaseMismatchWarning)
        cast_then_wrap = FocusModel.from_pretrained(build_model("llama", dtype=dtype), tmp_path)
    with wrap_then_cast.record_routing() as a:
        la = logits(wrap_then_cast, x)
    with cast_then_wrap.record_routing() as b:
        lb = logits(cast_then_wrap.eval(), x)
    for ra, rb in zip(a, b, strict=True):
        assert torch.equal(ra["query_groups"], rb["query_groups"])
        assert torch.equal(ra["key_groups"], rb["key_groups"])
    assert torch.equal(la, lb)


def test_saving_after_a_cast_loses_no_precision(tmp_path):
    _, fm = focus("llama")
    trained_like(fm)
    saved = router_tensors(fm)
    fm.to(torch.bfloat16).save_pretrained(tmp_path)
    back = FocusModel.from_pretrained(build_model("llama"), tmp_path)
    for name, t in back.routers.state_dict().items():
        assert t.dtype == saved[name].dtype and torch.equal(t, saved[name]), name


def test_a_move_to_meta_refuses_to_run_until_values_are_loaded(tmp_path):
    _, fm = focus("llama")
    trained_like(fm)
    fm.save_pretrained(tmp_path)
    x = ids(1, 20, seed=5)
    expected = logits(fm, x)
    fm.routers.to("meta")
    fm.routers.to_empty(device="cpu")
    with pytest.raises(ValueError, match="router"):
        logits(fm, x)
    loaded = FocusModel.from_pretrained(build_model("llama"), tmp_path)
    fm.load_state_dict(loaded.state_dict())
    assert torch.equal(logits(fm, x), expected)


# --- lazy, low-memory and device_map loading -------------------------------------------------


def test_wrapping_an_empty_base_then_loading_equals_wrapping_on_cpu():
    """Parameters on ``meta`` (accelerate's ``init_empty_weights``): the routers are created
    there too and initialised when materialised, to the values they get on a real device."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        empty = build_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FocusSlidingWindowWarning)
        fm = get_focus_model(empty, FocusConfig(**FOCUS_DEFAULTS))
    assert all(p.device.type == "meta" for p in fm.routers.parameters())
    with pytest.raises(ValueError, match="router"):
        logits(fm, ids(1, 8))
    fm.base_model.load_state_dict(build_model("llama").state_dict(), assign=True)
    fm.routers.to_empty(device="cpu")
    _, ref = focus("llama")
    for name, t in fm.routers.state_dict().items():
        assert torch.equal(t, ref.routers.state_dict()[name]), name
    x = ids(1, 30, seed=6)
    assert torch.equal(logits(fm.eval(), x), logits(ref, x))


@pytest.mark.parametrize(
    "load", [{"low_cpu_mem_usage": True}, {"device_map": "cpu"}, {"dtype": torch.bfloat16}]
)
def test_adapter_loads_onto_a_base_loaded_from_disk(tmp_path, load):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    build_model("llama").save_pretrained(base_dir)
    _, fm = focus("llama")
    trained_like(fm)
    fm.save_pretrained(adapter_dir)

    def load_base(**kw):
        base = AutoModelForCausalLM.from_pretrained(base_dir, **kw)
        base.generation_config.eos_token_id = None
        return base

    loaded = FocusModel.from_pretrained(load_base(**load), adapter_dir)
    for name, t in loaded.routers.state_dict().items():
        assert t.device.type == "cpu"
        assert torch.equal(t, fm.routers.state_dict()[name]), name
    # the same adapter on the same base loaded the plain way, then wrapped
    dtype = load.get("dtype", torch.float32)
    wrapped = get_focus_model(load_base(dtype=dtype), FocusConfig(**FOCUS_DEFAULTS)).eval()
    wrapped.load_state_dict(fm.state_dict())
    x = ids(1, 30, seed=7)
    assert torch.equal(logits(loaded, x), logits(wrapped, x))
    if dtype == torch.float32:
        assert torch.equal(logits(loaded, x), logits(fm, x))


# --- attention maps --------------------------------------------------------------------------


def _eager(arch="llama", **cfg):
    ref, fm = focus(arch, model_overrides={"attn_implementation": "eager"}, **cfg)
    return ref, fm


@pytest.mark.parametrize("layers", [None, (0,), (1,)])
def test_output_attentions_gives_one_map_per_layer_in_order(layers):
    ref, fm = _eager(layers=layers)
    x = ids(2, 24, seed=8)
    with torch.no_grad():
        got = fm(input_ids=x, output_attentions=True).attentions
        base = ref(input_ids=x, output_attentions=True).attentions
    assert len(got) == len(base) == 2
    for i, (a, b) in enumerate(zip(got, base, strict=True)):
        assert a.shape == b.shape == (2, 4, 24, 24)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 4, 24))
        assert not a.triu(1).any()  # causal
        if i < min(fm.focus_layers):  # the same input as in the base model
            assert torch.equal(a, b)


def test_focus_attention_maps_are_zero_outside_the_groups():
    """With top_k = 1 a query attends only to its window, the sink tokens and the keys of its
    own group: the probability of every other key is exactly 0, and the map is what the
    dense oracle computes over the Focus mask."""
    _, fm = _eager(window=4, sink_tokens=1)
    x = ids(1, 32, seed=9)
    with torch.no_grad(), fm.record_routing() as records:
        maps = fm(input_ids=x, output_attentions=True).attentions
    for layer, rec in zip(fm.focus_layers, records, strict=True):
        queries, keys = rec["query_groups"][0].float(), rec["key_groups"][0].float()
        shared = (queries @ keys.T) > 0  # sink tokens are in every group
        n = queries.shape[0]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & ((i - j < 4) | shared)
        assert not maps[layer][0][:, ~allowed].any()
        assert (maps[layer][0][:, allowed] > 0).all()


def test_attention_maps_are_not_computed_unless_asked():
    _, fm = _eager()
    with torch.no_grad():
        out = fm(input_ids=ids(1, 16, seed=10))
    assert getattr(out, "attentions", None) is None


def test_output_attentions_with_a_non_eager_base_says_what_to_do():
    _, fm = focus("llama", model_overrides={"attn_implementation": "sdpa"})
    with torch.no_grad():
        try:
            out = fm(input_ids=ids(1, 16, seed=11), output_attentions=True)
        except ValueError as err:
            assert "eager" in str(err)
        else:
            assert len(out.attentions) == 2


# --- implementation switches -----------------------------------------------------------------


@pytest.mark.parametrize("impl", ["eager", "sdpa", None])
def test_switching_the_attention_implementation_is_refused(impl):
    _, fm = focus("llama")
    x = ids(1, 20, seed=12)
    before = logits(fm, x)
    with pytest.raises(ValueError, match="disable_focus"):
        fm.set_attn_implementation(impl)
    assert torch.equal(logits(fm, x), before)


@pytest.mark.parametrize("how", ["set_attn_implementation", "config"])
def test_a_switch_behind_focus_is_refused_at_the_next_call(how):
    """Switched on the base model (transformers cannot be stopped from doing it), the next
    call of the model, its base or ``generate`` refuses instead of running dense."""
    _, fm = focus("llama")
    x = ids(1, 20, seed=13)
    if how == "config":
        fm.base_model.config._attn_implementation = "eager"
    else:
        fm.base_model.set_attn_implementation("eager")
    calls = [
        lambda: fm(input_ids=x),
        lambda: fm.base_model(input_ids=x),
        lambda: fm.generate(x, max_new_tokens=2),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="disable_focus"):
            call()


# --- what wrapping changes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "overrides", "layers", "warns"),
    [
        ("mistral", {"sliding_window": 16}, None, True),
        ("mistral", {"sliding_window": None}, None, False),
        ("llama", {}, None, False),
        ("gemma2", {}, None, False),  # Focus takes the full-attention layers only
        ("gemma2", {}, (0, 1), True),  # ... unless a sliding layer is chosen explicitly
    ],
)
def test_replacing_a_sliding_window_warns_once(arch, overrides, layers, warns):
    base = build_model(arch, **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_focus_model(base, FocusConfig(**{**FOCUS_DEFAULTS, "layers": layers}))
    found = [w for w in caught if issubclass(w.category, FocusSlidingWindowWarning)]
    assert len(found) == (1 if warns else 0)
    if warns:
        assert "sliding window" in str(found[0].message) and "README" in str(found[0].message)


def test_the_replaced_sliding_window_is_why_outputs_differ_from_the_base():
    """With every group kept (top_k = num_groups) a Focus layer is dense causal attention: it
    equals the base model without a sliding window, not the base model with one."""
    x = ids(1, 48, seed=14)
    windowed = build_model("mistral", sliding_window=16)
    full = build_model("mistral", sliding_window=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FocusSlidingWindowWarning)
        fm = get_focus_model(
            build_model("mistral", sliding_window=16), FocusConfig(**{**FOCUS_DEFAULTS, "top_k": 4})
        ).eval()
    got = logits(fm, x)
    torch.testing.assert_close(got, logits(full, x), **tolerance("oracle"))
    assert (got - logits(windowed, x)).abs().max() > 1e-2


# --- mixed precision -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_autocast_runs_and_routes_as_without_it(arch, mode):
    """Inside ``torch.autocast`` (mixed-precision training) a Focus layer receives float32
    queries beside bfloat16 values; it attends in the autocast dtype and routes in float32,
    so the first layer (whose input autocast leaves alone) routes exactly as the float32
    model, and gradients reach the routers."""
    _, fm = focus(arch)
    getattr(fm, mode)()
    x = ids(2, 40, seed=15)
    with fm.record_routing() as plain:
        fm(input_ids=x)
    with torch.autocast("cpu", dtype=torch.bfloat16), fm.record_routing() as mixed:
        out = fm(input_ids=x, labels=x)
    assert torch.isfinite(out.loss)
    key = "probs" if mode == "train" else "query_groups"
    assert len(plain) == len(mixed) == len(fm.focus_layers)
    if fm.focus_layers[0] == 0:  # gemma2's layer 0 is a sliding (base) layer
        assert torch.equal(plain[0][key], mixed[0][key])
    assert all(r[key].dtype == plain[0][key].dtype for r in mixed)
    if mode == "train":
        out.loss.backward()
        assert all(p.grad is not None for p in fm.routers.parameters() if p.ndim == 2)


# --- wrappers, threads, counts, configs ------------------------------------------------------


class _Parent(torch.nn.Module):
    def __init__(self, child):
        super().__init__()
        self.module = child


@pytest.mark.parametrize("wrapper", ["parent", "compile", "averaged"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_wrapped_focus_model_loads_its_state_with_the_config(wrapper, strict):
    """Inside torch.compile, an EMA copy or any parent module, ``load_state_dict`` of the
    wrapper restores the routers and the config (also with ``strict=False``) and does not
    expect the base weights, which the Focus state does not hold."""
    wrap = {
        "parent": _Parent,
        "compile": torch.compile,
        "averaged": torch.optim.swa_utils.AveragedModel,
    }[wrapper]
    _, saved = focus("llama", top_k=2, window=4)
    trained_like(saved)
    state = wrap(saved).state_dict()
    _, fresh = focus("llama")
    wrapped = wrap(fresh)
    fresh = getattr(wrapped, "module", fresh)  # AveragedModel holds a copy
    result = wrapped.load_state_dict(state, strict=strict)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert fresh.focus_config == saved.focus_config
    x = ids(1, 40, seed=16)
    assert torch.equal(logits(fresh, x), logits(saved, x))


def test_threads_sharing_one_model_get_their_own_results():
    """Two threads calling one model at once (a threaded server): each gets exactly the
    logits and generations it gets alone."""
    import threading

    _, fm = focus("llama")
    xs = [ids(2, 48, seed=s) for s in (1, 2)]
    want = [logits(fm, x) for x in xs]
    gen = [fm.generate(x, max_new_tokens=12, do_sample=False) for x in xs]
    failures: list[str] = []

    def worker(i: int) -> None:
        for _ in range(20):
            try:
                if not torch.equal(logits(fm, xs[i]), want[i]):
                    failures.append(f"thread {i}: other logits")
                with torch.no_grad():
                    out = fm.generate(xs[i], max_new_tokens=12, do_sample=False)
                if not torch.equal(out, gen[i]):
                    failures.append(f"thread {i}: other generation")
            except Exception as err:  # noqa: BLE001 - reported below
                failures.append(f"thread {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_parameter_counts_include_the_routers():
    _, fm = focus("llama")
    routers = sum(p.numel() for p in fm.routers.parameters())
    base = fm.base_model.num_parameters()
    assert fm.num_parameters() == base + routers
    assert fm.num_parameters(only_trainable=True) == routers == fm.get_nb_trainable_parameters()[0]
    fm.requires_grad_(False)
    assert fm.num_parameters(only_trainable=True) == 0
    router_bytes = sum(t.numel() * t.element_size() for t in fm.routers.state_dict().values())
    assert fm.get_memory_footprint() == fm.base_model.get_memory_footprint() + router_bytes


def test_a_model_built_from_a_focus_models_config_says_how_to_get_a_plain_one():
    _, fm = focus("llama")
    config = copy.deepcopy(fm.config)  # from_config shares the config object it is given
    with pytest.raises(ValueError, match=r"from_config\(copy.deepcopy"):
        AutoModelForCausalLM.from_config(config)(ids(1, 8))
    plain = AutoModelForCausalLM.from_config(copy.deepcopy(fm.config), attn_implementation="sdpa")
    assert plain(ids(1, 8)).logits.shape == (1, 8, 256)
    assert fm.config._attn_implementation == "focus"  # the Focus model is left as it was


def test_calibrate_with_reset_sets_the_bias_from_that_batch_alone():
    _, fm = focus("llama")
    trained_like(fm)  # centroids and a bias collected elsewhere
    fresh = copy.deepcopy(fm)
    with torch.no_grad():
        for router in fresh.routers.values():  # what a router that never saw a batch holds
            router.routing_bias.zero_()
            router.bias_updates.zero_()
    x = ids(2, 64, seed=17)
    fm.calibrate(x, reset=True)
    fresh.calibrate(x)
    for i, router in fm.routers.items():
        assert int(router.bias_updates) == 1
        assert torch.equal(router.routing_bias, fresh.routers[i].routing_bias)
    fm.calibrate(x)  # without reset it averages in
    assert all(int(r.bias_updates) == 2 for r in fm.routers.values())


@pytest.mark.parametrize("name", ["merge_and_unload", "merge_adapter", "unmerge_adapter"])
def test_peft_merge_methods_name_focus_model_and_what_to_call_instead(name):
    """A PEFT user's first call: the AttributeError names FocusModel, unload() and focus
    export instead of the base class; ``hasattr`` stays False (tools that detect PEFT models
    by it are not misled), and other missing attributes keep the base class's message."""
    _, fm = focus("llama")
    with pytest.raises(AttributeError) as err:
        getattr(fm, name)()
    message = str(err.value)
    assert message.startswith(f"FocusModel has no {name}()")
    assert "unload()" in message and "focus export" in message
    assert not hasattr(fm, name)
    with pytest.raises(AttributeError, match="LlamaForCausalLM"):
        fm.no_such_attribute  # noqa: B018
