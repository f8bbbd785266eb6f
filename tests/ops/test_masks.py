"""The dense oracle mask ``focus_mask`` and the dense oracle ``dense_attention``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from tolerances import tolerance

from focus_attention.ops import dense_attention, expand_kv_heads, focus_mask
from focus_attention.ops.masks import CODE_BITS, code_groups, group_code_words, group_codes

from .helpers import HYP, brute_mask, case_params, gen, make_case, naive_attention


def _loop_mask(qg, kg, window, kpm=None) -> torch.Tensor:
    """The rule of docs/method.md §4 evaluated pair by pair in plain Python."""
    batch, nq, k = qg.shape
    nk = kg.shape[1]
    out = torch.zeros(batch, nq, nk, dtype=torch.bool)
    for b in range(batch):
        for t in range(nq):
            i = nk - nq + t
            for j in range(nk):
                share = any(bool(qg[b, t, c]) and bool(kg[b, j, c]) for c in range(k))
                real = True if kpm is None else bool(kpm[b, j])
                out[b, t, j] = j <= i and real and (i - j < window or share)
    return out


@given(params=case_params(max_nk=24, long_nk=40))
@HYP
def test_focus_mask_equals_pairwise_rule(params):
    case = make_case(**params)
    got = focus_mask(case.qg, case.kg, case.window, case.kpm)
    assert got.dtype == torch.bool and got.shape == (case.q.shape[0], case.nq, case.nk)
    assert torch.equal(got, _loop_mask(case.qg, case.kg, case.window, case.kpm))
    assert torch.equal(got, brute_mask(case.qg, case.kg, case.window, case.kpm))


@pytest.mark.parametrize("nq", [1, 5, 30])
def test_focus_mask_rows_are_bottom_right_aligned(nq):
    """Any query block equals the matching rows of the full prefill mask."""
    case = make_case(nk=30, groups=4, top_k=2, window=3, padding="random", seed=nq)
    full = focus_mask(case.kg, case.kg, case.window, case.kpm)
    part = focus_mask(case.kg[:, 30 - nq :], case.kg, case.window, case.kpm)
    assert torch.equal(part, full[:, 30 - nq :])


def test_focus_mask_limits():
    case = make_case(nk=40, groups=4, top_k=1, window=5, seed=1)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None]
    # window >= N and top_k = K (everyone in every group) are dense causal attention
    assert torch.equal(focus_mask(case.kg, case.kg, 40), causal)
    assert torch.equal(focus_mask(case.kg, case.kg, 10**6), causal)
    every = torch.ones(1, 40, 4, dtype=torch.bool)
    assert torch.equal(focus_mask(every, every, 1), causal)
    # K = 1 with everyone in the single group: dense causal
    one = torch.ones(1, 40, 1, dtype=torch.bool)
    assert torch.equal(focus_mask(one, one, 1), causal)
    # window 1 and no groups: the diagonal only (the window counts the query itself)
    none = torch.zeros(1, 40, 4, dtype=torch.bool)
    assert torch.equal(focus_mask(none, none, 1), torch.eye(40, dtype=torch.bool)[None])
    # window w, no groups: the band 0 <= i - j < w
    band = focus_mask(none, none, 4)[0]
    i, j = torch.arange(40)[:, None], torch.arange(40)[None]
    assert torch.equal(band, (i - j >= 0) & (i - j < 4))


def test_dense_attention_matches_naive_reference_and_empty_rows():
    case = make_case(nk=50, nq=20, batch=2, heads=6, kv_heads=2, top_k=2, padding="left")
    case.kpm[1] = False  # every key of sequence 1 is padding: all its rows are empty
    case.kpm[0, :45] = False  # most of sequence 0 too
    mask = case.mask()
    out, lse = dense_attention(case.q, case.k, case.v, mask)
    ref, ref_lse = naive_attention(case.q, case.k, case.v, mask)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (lse[1] == -math.inf).all()
    torch.testing.assert_close(out.double(), ref, **tolerance("rounding"))
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], **tolerance("oracle"))


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 6])
def test_expand_kv_heads_grouping(kv_heads):
    """GQA: query head h uses key/value head h // (H // H_kv)."""
    x = torch.randn(2, kv_heads, 5, 3, generator=gen(kv_heads))
    out = expand_kv_heads(x, 6)
    assert out.shape == (2, 6, 5, 3)
    for h in range(6):
        assert torch.equal(out[:, h], x[:, h // (6 // kv_heads)])


# --------------------------------------------------------------------------------------
# group codes: memberships as bits
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 5, 62])
def test_group_codes_hold_bit_g_for_group_g_and_unpack(k):
    groups = torch.rand(3, 17, k, generator=gen(k)) < 0.3
    groups[0, 0] = True  # every group: the highest code
    codes = group_codes(groups)
    assert codes.dtype == torch.int64 and codes.shape == (3, 17)
    want = [[sum(1 << g for g in range(k) if groups[b, n, g]) for n in range(17)] for b in range(3)]
    assert codes.tolist() == want
    assert torch.equal(code_groups(codes, k), groups)


@pytest.mark.parametrize("k", [1, 5, 62, 63, 130])
def test_group_code_words_share_a_bit_exactly_when_rows_share_a_group(k):
    a = torch.rand(40, k, generator=gen(k)) < 0.05
    b = torch.rand(40, k, generator=gen(k + 1)) < 0.05
    words_a, words_b = group_code_words(a), group_code_words(b)
    assert len(words_a) == -(-k // CODE_BITS)
    share = torch.zeros(40, 40, dtype=torch.bool)
    for wa, wb in zip(words_a, words_b, strict=True):
        share |= (wa[:, None] & wb[None, :]) != 0
    assert torch.equal(share, (a.float() @ b.float().t()) > 0)


def test_group_codes_refuse_more_groups_than_a_word_and_non_boolean_memberships():
    with pytest.raises(ValueError, match=f"K <= {CODE_BITS}"):
        group_codes(torch.zeros(2, CODE_BITS + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="expected torch.bool"):
        group_codes(torch.zeros(2, 4))
