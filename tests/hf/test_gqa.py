"""Grouped-query heads: on tiny-llama and every GQA architecture, zeroing the values of
KV head 1 zeroes exactly the query heads that share it, in soft and top-k routing."""

from __future__ import annotations

import pytest
import torch
from tiny import GQA_ARCHS, build_tiny_llama, focus, ids

from focus_attention.hf import FocusConfig, get_focus_model


def zero_kv_head(model, kv_head: int, head_dim: int) -> None:
    rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
    with torch.no_grad():
        for layer in model.model.layers:
            v = layer.self_attn.v_proj
            v.weight[rows] = 0
            if v.bias is not None:
                v.bias[rows] = 0


def head_outputs(fm, x, num_heads: int) -> dict[int, torch.Tensor]:
    """Per layer, the attention output entering o_proj as ``[B, N, H, D]``."""
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(fm.base_model.model.layers):

        def grab(module, args, i=i):
            a = args[0]
            got[i] = a.reshape(*a.shape[:2], num_heads, -1)

        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(grab))
    with torch.no_grad():
        fm(input_ids=x, use_cache=False)
    for h in hooks:
        h.remove()
    return got


def check_heads(fm, x, num_heads: int, num_kv: int, kv_zero: int = 1) -> None:
    per = num_heads // num_kv
    zero = set(range(kv_zero * per, (kv_zero + 1) * per))
    for routing in ("topk", "soft"):
        fm.set_routing(routing)
        for layer, out in head_outputs(fm, x, num_heads).items():
            for h in range(num_heads):
                if h in zero:
                    assert torch.equal(out[:, :, h], torch.zeros_like(out[:, :, h])), (layer, h)
                else:
                    assert out[:, :, h].abs().max() > 0, (routing, layer, h)


def test_zeroed_kv_head_zeroes_exactly_its_query_heads(reference_llama):
    zero_kv_head(reference_llama.base_model, 1, 16)
    check_heads(reference_llama, ids(2, 96, seed=50, vocab=1000), num_heads=8, num_kv=2)


def test_one_group_equals_dense_attention():
    base = build_tiny_llama()
    fm = get_focus_model(build_tiny_llama(), FocusConfig(num_groups=1, top_k=1, window=32))
    x = ids(2, 96, seed=51, vocab=1000)
    with torch.no_grad():
        want = base(input_ids=x).logits
        got = fm.eval()(input_ids=x).logits
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", GQA_ARCHS)
def test_zeroed_kv_head_on_every_gqa_architecture(arch):
    _, fm = focus(arch, num_groups=4, top_k=1, window=8)
    zero_kv_head(fm.base_model, 1, 16)
    check_heads(fm, ids(1, 48, seed=52), num_heads=4, num_kv=2)
