"""The default real model, smollm2-135m (LLaMA, GQA 9/3), with Focus: needs the assets
prepared by `focus setup` (marked ``assets``; skipped when they are absent)."""

from __future__ import annotations

import pytest
import torch

from focus_attention.assets.models import is_prepared, load_model
from focus_attention.hf import FocusConfig, get_focus_model

NAME = "smollm2-135m"


def load_prepared():
    if not is_prepared(NAME):
        pytest.skip(f"{NAME} is not prepared (run `focus setup` to download the assets)")
    return load_model(NAME)


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_with_focus():
    model, tokenizer = load_prepared()
    assert model.config.model_type == "llama"
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    text = "The quick brown fox jumps over the lazy dog. " * 12
    x = tokenizer(text, return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        dense = model(input_ids=x).logits
    fm = get_focus_model(model, FocusConfig(num_groups=8, top_k=2, window=32)).eval()
    n_layers, d = model.config.num_hidden_layers, model.config.hidden_size
    assert fm.get_nb_trainable_parameters()[0] == n_layers * (d * 16 + 8 * 16)
    with torch.no_grad():
        sparse = fm(input_ids=x).logits
        with fm.disable_focus():
            assert torch.equal(fm(input_ids=x).logits, dense)
        # dense where the window covers the sequence
        fm.focus_config = fm.focus_config.replace(window=128)
        assert (fm(input_ids=x).logits - dense).abs().max() <= 1e-4
        fm.focus_config = fm.focus_config.replace(window=32)
        assert torch.isfinite(sparse).all()
        kw = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(x))
        assert torch.equal(
            fm.generate(x, use_cache=True, **kw), fm.generate(x, use_cache=False, **kw)
        )
    fm.unload()
