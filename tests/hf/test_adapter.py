"""Adapter files, only the centroids train, and the PEFT-like API."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import ARCHS, build_model, focus, ids, left_pad
from transformers import GPT2Config, GPT2LMHeadModel

from focus_attention.hf import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    FocusBaseMismatchWarning,
    FocusConfig,
    FocusModel,
    FocusSlidingWindowWarning,
    get_focus_model,
)
from focus_attention.hf.compat import enable_activation_checkpointing
from focus_attention.hf.files import CARD_NAME

# --------------------------------------------------------------------------------------------
# trainable parameters
# --------------------------------------------------------------------------------------------


def test_gpt2_124m_has_exactly_148224_trainable_parameters(capsys):
    with torch.device("meta"):
        base = GPT2LMHeadModel(GPT2Config())  # 12 layers, d_model 768: GPT-2 124M
    fm = get_focus_model(base, FocusConfig(num_groups=4, group_dim=16))
    trainable, total = fm.get_nb_trainable_parameters()
    assert trainable == 12 * (768 * 16 + 4 * 16) == 148_224
    assert sum(p.numel() for p in fm.routers.parameters()) == 148_224
    assert total == 148_224 + sum(p.numel() for p in base.parameters())
    fm.print_trainable_parameters()
    line = capsys.readouterr().out.strip()
    assert line == (
        f"trainable params: 148,224 || all params: {total:,d} || "
        f"trainable%: {100 * 148_224 / total:.4f}"
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_trainable_parameters_match_the_formula(arch):
    _, fm = focus(arch, num_groups=4, group_dim=8)
    d, n = fm.config.hidden_size, len(fm.focus_layers)
    assert fm.get_nb_trainable_parameters()[0] == n * (d * 8 + 4 * 8)
    assert all(not p.requires_grad for p in fm.base_model.parameters())


def train_step(fm, x, mask):
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2, weight_decay=0.1)
    fm.train()
    out = fm(input_ids=x, attention_mask=mask, labels=x, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in fm.routers.named_parameters()}
    opt.step()
    return grads


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_training_changes_only_the_routers(arch, checkpointing):
    _, fm = focus(arch, num_groups=4, top_k=1, window=8)
    if checkpointing is not None:
        enable_activation_checkpointing(fm, use_reentrant=checkpointing == "reentrant")
        assert any(getattr(m, "gradient_checkpointing", False) for m in fm.base_model.modules())
    before = {n: p.detach().clone() for n, p in fm.base_model.named_parameters()}
    routers = {n: p.detach().clone() for n, p in fm.routers.named_parameters()}
    x, mask = left_pad([ids(1, 40, seed=60)[0], ids(1, 25, seed=61)[0]])
    grads = train_step(fm, x, mask)
    for n, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, n
    for n, p in fm.base_model.named_parameters():
        assert torch.equal(p, before[n]), n  # byte-identical
        assert p.grad is None
    for n, p in fm.routers.named_parameters():
        assert not torch.equal(p, routers[n]), n


# --------------------------------------------------------------------------------------------
# adapter files
# --------------------------------------------------------------------------------------------


def trained(arch: str = "llama", **cfg):
    _, fm = focus(arch, num_groups=4, top_k=1, window=8, **cfg)
    x, mask = left_pad([ids(1, 40, seed=62)[0], ids(1, 25, seed=63)[0]])
    train_step(fm, x, mask)
    return fm.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_reload_is_bit_identical(tmp_path, arch):
    fm = trained(arch)
    fm.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CARD_NAME, CONFIG_NAME, WEIGHTS_NAME]
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    assert set(tensors) == {
        f"layer.{i}.{n}"
        for i in fm.focus_layers
        for n in ("proj", "centroids", "routing_bias", "bias_updates")
    }
    doc = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert doc["base_model_fingerprint"]["model_type"] == fm.config.model_type
    assert doc["layers"] == fm.focus_layers
    x = ids(2, 50, seed=64)
    with torch.no_grad():
        want = fm(input_ids=x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same base: no mismatch warning
        warnings.simplefilter("ignore", FocusSlidingWindowWarning)  # Mistral's default window
        again = FocusModel.from_pretrained(build_model(arch), tmp_path)
    for (n1, a), (n2, b) in zip(
        fm.routers.state_dict().items(), again.routers.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(a, b), n1
    assert again.focus_config == fm.focus_config
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, want)
    # loading for inference: frozen and in eval (top-k) mode
    assert not any(p.requires_grad for p in again.parameters())
    assert again.routing_mode == "topk"
    trainable = FocusModel.from_pretrained(build_model(arch), tmp_path, is_trainable=True)
    assert all(p.requires_grad for p in trainable.routers.parameters())


def test_save_overwrites_atomically(tmp_path):
    fm = trained()
    fm.save_pretrained(tmp_path)
    first = (tmp_path / WEIGHTS_NAME).read_bytes()
    with torch.no_grad():
        for p in fm.routers.parameters():
            p.add_(1.0)
    fm.save_pretrained(tmp_path)
    assert (tmp_path / WEIGHTS_NAME).read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == [CARD_NAME, CONFIG_NAME, WEIGHTS_NAME]


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(num_hidden_layers=3), "num_hidden_layers"),
        (dict(hidden_size=96, intermediate_size=128), "hidden_size"),
    ],
)
def test_loading_onto_another_structure_is_an_error(tmp_path, overrides, match):
    trained().save_pretrained(tmp_path)
    other = build_model("llama", **overrides)
    with pytest.raises(ValueError, match=match):
        FocusModel.from_pretrained(other, tmp_path)
    assert other.config._attn_implementation != "focus"


def test_loading_onto_another_model_type_is_an_error(tmp_path):
    trained().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        FocusModel.from_pretrained(build_model("mistral"), tmp_path)


def test_loading_onto_other_weights_of_the_same_shapes_warns(tmp_path):
    trained().save_pretrained(tmp_path)
    with pytest.warns(FocusBaseMismatchWarning, match="same shapes but different weights"):
        FocusModel.from_pretrained(build_model("llama", seed=1), tmp_path)


def test_loading_onto_a_bf16_copy_of_the_same_base_does_not_warn(tmp_path):
    trained().save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FocusModel.from_pretrained(build_model("llama", dtype=torch.bfloat16), tmp_path)


@pytest.mark.parametrize("change", ["missing", "extra", "shape", "nan", "inf", "float64-overflow"])
def test_bad_weight_files_are_errors(tmp_path, change):
    fm = trained()
    fm.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    if change == "missing":
        tensors.pop("layer.1.centroids")
        match = r"missing keys \['layer.1.centroids'\]"
    elif change == "extra":
        tensors["layer.1.gate"] = torch.zeros(3)
        match = r"unexpected keys \['layer.1.gate'\]"
    elif change == "shape":
        tensors["layer.0.proj"] = torch.zeros(3, 16)
        match = "layer.0.proj has shape"
    elif change == "float64-overflow":  # finite in float64, infinite in the router's float32
        name = "layer.0.proj"
        tensors[name] = tensors[name].double()
        tensors[name][0, 0] = 1e300
        match = f"{name} holds NaN or infinite values"
    else:  # damaged values: on a GPU the routing does not check its scores per call
        name = "layer.1.centroids" if change == "nan" else "layer.0.routing_bias"
        tensors[name].view(-1)[1] = math.nan if change == "nan" else math.inf
        match = f"{name} holds NaN or infinite values"
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        metadata = f.metadata()  # the config copy: these files belong together
    save_file(tensors, str(tmp_path / WEIGHTS_NAME), metadata=metadata)
    base = build_model("llama")
    with pytest.raises(ValueError, match=match):
        FocusModel.from_pretrained(base, tmp_path)
    # a failed load leaves the base model untouched and re-wrappable
    assert base.config._attn_implementation != "focus"
    get_focus_model(base, FocusConfig(num_groups=4))


def test_missing_files_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        FocusModel.from_pretrained(build_model("llama"), tmp_path)


# --------------------------------------------------------------------------------------------
# wrapping rules
# --------------------------------------------------------------------------------------------


def test_wrapping_twice_is_an_error_and_unload_allows_it_again():
    base = build_model("llama")
    fm = get_focus_model(base, FocusConfig(num_groups=4))
    with pytest.raises(ValueError, match="already"):
        get_focus_model(base, FocusConfig(num_groups=4))
    fm.unload()
    get_focus_model(base, FocusConfig(num_groups=4))


def test_unsupported_model_type_lists_supported_ones():
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(
        OPTConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            ffn_dim=64,
            word_embed_proj_dim=32,
        )
    )
    with pytest.raises(ValueError) as err:
        get_focus_model(opt, FocusConfig())
    msg = str(err.value)
    assert "'opt'" in msg
    for name in ARCHS:
        assert name in msg


def test_layer_selection():
    with pytest.raises(ValueError, match=r"layers \[5\] do not exist"):
        get_focus_model(build_model("llama"), FocusConfig(layers=[0, 5]))
    fm = get_focus_model(build_model("llama"), FocusConfig(num_groups=4, layers=[1]))
    assert fm.focus_layers == [1] and list(fm.routers) == ["1"]
    with pytest.raises(ValueError, match="no full-attention layer"):
        get_focus_model(build_model("gemma2", layer_types=["sliding_attention"] * 2), FocusConfig())


def test_getattr_falls_through_to_the_base_model():
    _, fm = focus("llama")
    assert fm.config is fm.base_model.config
    assert fm.get_input_embeddings() is fm.base_model.get_input_embeddings()


def test_corrupt_config_file_is_a_value_error(tmp_path):
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text((tmp_path / CONFIG_NAME).read_text()[:40])
    with pytest.raises(ValueError, match=f"{CONFIG_NAME}: not a valid Focus config.*invalid JSON"):
        FocusModel.from_pretrained(build_model("llama"), tmp_path)


def test_refused_router_values_load_nothing(tmp_path):
    """A load refused for damaged values (here the last layer's) leaves every router of the
    model as it was: the tensors are all checked before any is copied."""
    trained().save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    tensors["layer.1.centroids"][0, 0] = math.nan
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        metadata = f.metadata()
    save_file(tensors, str(tmp_path / WEIGHTS_NAME), metadata=metadata)
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    before = {k: v.clone() for k, v in fm.focus_state_dict().items()}
    with pytest.raises(ValueError, match="layer.1.centroids holds NaN or infinite values"):
        fm.load_routers(tmp_path)
    after = fm.focus_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_load_state_dict_refuses_router_values_that_are_not_finite(value):
    """The state-dict route (Trainer checkpoints, torch.load) checks the values as the
    adapter files do, before it loads anything."""
    state = trained().state_dict()
    state["routers.1.centroids"] = state["routers.1.centroids"].clone()
    state["routers.1.centroids"][0, 0] = value
    _, fm = focus("llama", num_groups=4, top_k=1, window=8)
    before = {k: v.clone() for k, v in fm.focus_state_dict().items()}
    with pytest.raises(ValueError, match=r"routers\.1\.centroids holds NaN or infinite"):
        fm.load_state_dict(state)
    after = fm.focus_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


# --------------------------------------------------------------------------------------------
# PEFT's habits
# --------------------------------------------------------------------------------------------


def test_disable_adapter_is_a_context_of_the_base_models_output():
    """PEFT's ``with model.disable_adapter():``: exactly the base model inside, Focus after."""
    reference, fm = focus("llama", window=4, top_k=1)
    x = ids(1, 40, seed=3)
    with torch.no_grad():
        dense, focused = reference(input_ids=x).logits, fm(input_ids=x).logits
        with fm.disable_adapter():
            assert torch.equal(fm(input_ids=x).logits, dense)
        assert torch.equal(fm(input_ids=x).logits, focused)
    assert not torch.equal(focused, dense)


def test_get_base_model_is_the_wrapped_transformers_model():
    base = build_model("llama")
    fm = get_focus_model(base)
    assert fm.get_base_model() is base is fm.base_model
    assert fm.get_base_model().config._attn_implementation == "focus"  # Focus runs in it


@pytest.mark.parametrize(
    ("name", "instead"),
    [
        ("peft_config", "model.focus_config"),
        ("peft_type", "model.focus_config"),
        ("active_adapter", "disable_focus()"),
        ("disable_adapter_layers", "disable_focus()"),
        ("enable_adapter_layers", "disable_focus()"),
    ],
)
def test_peft_attributes_without_an_equivalent_name_focus_model_and_what_to_use(name, instead):
    """One AttributeError naming FocusModel and what to use, not the base class's; and
    ``hasattr`` stays False, so tools that detect PEFT models (``hasattr(model,
    "peft_config")``) are not misled."""
    _, fm = focus("llama")
    with pytest.raises(AttributeError) as err:
        getattr(fm, name)
    message = str(err.value)
    assert message.startswith(f"FocusModel has no {name} (PEFT's): ") and instead in message
    assert "LlamaForCausalLM" not in message
    assert not hasattr(fm, name)
