"""Bad input raises ValueError naming the argument, what was received and what was
expected."""

from __future__ import annotations

import math

import pytest
import torch

from focus_attention.ops import (
    focus_mask,
    gated_attention,
    group_scores,
    pairs_retained,
    sinkhorn,
    sparse_attention,
    topk_memberships,
)

from .helpers import make_case

B, H, HKV, NQ, NK, D, K = 2, 4, 2, 5, 7, 8, 3


def _good() -> dict:
    g = torch.Generator().manual_seed(0)
    kg = torch.rand(B, NK, K, generator=g) < 0.5
    return dict(
        query=torch.randn(B, H, NQ, D, generator=g),
        key=torch.randn(B, HKV, NK, D, generator=g),
        value=torch.randn(B, HKV, NK, D, generator=g),
        query_groups=kg[:, NK - NQ :].clone(),
        key_groups=kg,
        window=2,
        key_padding_mask=torch.ones(B, NK, dtype=torch.bool),
    )


def _call_sparse(**over):
    a = {**_good(), **over}
    extra = {k: a.pop(k) for k in list(a) if k not in _good()}
    return sparse_attention(
        a["query"],
        a["key"],
        a["value"],
        a["query_groups"],
        a["key_groups"],
        a["window"],
        key_padding_mask=a["key_padding_mask"],
        **extra,
    )


def _expect(fn, names: tuple[str, ...], received: str | None = None):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert any(n in msg for n in names), f"message does not name {names}: {msg!r}"
    if received is not None:
        assert received in msg, f"message does not say what was received ({received}): {msg!r}"
    assert "expected" in msg.lower() or "expect" in msg.lower(), f"no expectation: {msg!r}"


def _r(*shape):
    return torch.randn(*shape)


SPARSE_BAD = [
    # wrong ranks
    ("query-rank3", dict(query=_r(B, NQ, D)), ("query",), "(2, 5, 8)"),
    ("key-rank5", dict(key=_r(B, HKV, NK, D, 1)), ("key",), "(2, 2, 7, 8, 1)"),
    ("value-rank3", dict(value=_r(B, NK, D)), ("value",), "(2, 7, 8)"),
    ("query_groups-rank2", dict(query_groups=torch.ones(B, NQ).bool()), ("query_groups",), None),
    ("key_groups-rank4", dict(key_groups=torch.ones(B, NK, K, 1).bool()), ("key_groups",), None),
    ("padding-rank1", dict(key_padding_mask=torch.ones(NK).bool()), ("key_padding_mask",), None),
    # mismatched batch
    ("key-batch", dict(key=_r(B + 1, HKV, NK, D), value=_r(B + 1, HKV, NK, D)), ("key",), "3"),
    ("value-shape", dict(value=_r(B, HKV, NK + 1, D)), ("value",), "(2, 2, 8, 8)"),
    ("qgroups-batch", dict(query_groups=torch.ones(B + 1, NQ, K).bool()), ("query_groups",), "3"),
    ("kgroups-batch", dict(key_groups=torch.ones(B + 1, NK, K).bool()), ("key_groups",), "3"),
    (
        "padding-batch",
        dict(key_padding_mask=torch.ones(B + 1, NK).bool()),
        ("key_padding_mask",),
        None,
    ),
    # mismatched lengths
    ("qgroups-length", dict(query_groups=torch.ones(B, NQ + 1, K).bool()), ("query_groups",), "6"),
    (
        "kgroups-length",
        dict(key_groups=torch.ones(B, NK - 1, K).bool(), key_padding_mask=None),
        ("key_groups",),
        "6",
    ),
    (
        "padding-length",
        dict(key_padding_mask=torch.ones(B, NK + 2).bool()),
        ("key_padding_mask",),
        "9",
    ),
    # mismatched K and D
    (
        "K-mismatch",
        dict(key_groups=torch.ones(B, NK, K + 1).bool()),
        ("key_groups", "query_groups"),
        "4",
    ),
    (
        "K-zero",
        dict(query_groups=torch.ones(B, NQ, 0).bool(), key_groups=torch.ones(B, NK, 0).bool()),
        ("query_groups", "key_groups"),
        "0",
    ),
    ("D-mismatch", dict(key=_r(B, HKV, NK, D + 1), value=_r(B, HKV, NK, D + 1)), ("key",), "9"),
    # heads
    ("H%Hkv", dict(key=_r(B, 3, NK, D), value=_r(B, 3, NK, D)), ("key", "H_kv"), "3"),
    # window
    ("window0", dict(window=0), ("window",), "0"),
    ("window-neg", dict(window=-3), ("window",), "-3"),
    ("window-float", dict(window=2.5), ("window",), "2.5"),
    # Nq > Nk
    (
        "Nq>Nk",
        dict(
            query=_r(B, H, NK + 1, D),
            query_groups=torch.ones(B, NK + 1, K).bool(),
        ),
        ("query", "Nq"),
        "8",
    ),
    # non-boolean masks
    ("qgroups-float", dict(query_groups=torch.ones(B, NQ, K)), ("query_groups",), "float32"),
    (
        "kgroups-int",
        dict(key_groups=torch.ones(B, NK, K, dtype=torch.int64)),
        ("key_groups",),
        "int64",
    ),
    ("padding-float", dict(key_padding_mask=torch.ones(B, NK)), ("key_padding_mask",), "float32"),
    # dtypes and backend
    ("key-dtype", dict(key=_r(B, HKV, NK, D).double()), ("key",), "float64"),
    ("int-query", dict(query=torch.ones(B, H, NQ, D, dtype=torch.int64)), ("query",), "int64"),
    ("backend", dict(backend="cuda_magic"), ("backend",), "cuda_magic"),
    ("cpu_flash+softcap", dict(backend="cpu_flash", softcap=5.0), ("backend", "softcap"), None),
]


@pytest.mark.parametrize(
    "over,names,received", [pytest.param(*row[1:], id=row[0]) for row in SPARSE_BAD]
)
def test_sparse_attention_rejects(over, names, received):
    _expect(lambda: _call_sparse(**over), names, received)


def test_good_inputs_are_accepted(kernel_built):
    """The baseline every rejection case perturbs is itself valid."""
    out = _call_sparse()
    assert out.shape == (B, H, NQ, D)
    a = _good()
    assert focus_mask(a["query_groups"], a["key_groups"], 2).shape == (B, NQ, NK)


FOCUS_MASK_BAD = [
    (
        "qg-rank",
        (torch.ones(NQ, K).bool(), torch.ones(B, NK, K).bool(), 2, None),
        ("query_groups",),
    ),
    ("kg-float", (torch.ones(B, NQ, K).bool(), torch.ones(B, NK, K), 2, None), ("key_groups",)),
    (
        "K",
        (torch.ones(B, NQ, K).bool(), torch.ones(B, NK, K + 2).bool(), 2, None),
        ("key_groups", "query_groups"),
    ),
    (
        "batch",
        (torch.ones(B, NQ, K).bool(), torch.ones(B + 1, NK, K).bool(), 2, None),
        ("key_groups", "query_groups"),
    ),
    (
        "Nq>Nk",
        (torch.ones(B, NK + 1, K).bool(), torch.ones(B, NK, K).bool(), 2, None),
        ("query_groups", "Nq"),
    ),
    ("window", (torch.ones(B, NQ, K).bool(), torch.ones(B, NK, K).bool(), 0, None), ("window",)),
    (
        "padding-shape",
        (torch.ones(B, NQ, K).bool(), torch.ones(B, NK, K).bool(), 2, torch.ones(B, NQ).bool()),
        ("key_padding_mask",),
    ),
    (
        "padding-dtype",
        (torch.ones(B, NQ, K).bool(), torch.ones(B, NK, K).bool(), 2, torch.ones(B, NK)),
        ("key_padding_mask",),
    ),
]


@pytest.mark.parametrize("args,names", [pytest.param(*r[1:], id=r[0]) for r in FOCUS_MASK_BAD])
def test_focus_mask_and_pairs_retained_reject(args, names):
    _expect(lambda: focus_mask(*args), names)
    _expect(lambda: pairs_retained(*args), names)


@pytest.mark.parametrize("top_k", [0, -1, K + 1, 1.0, True])
def test_topk_memberships_rejects_top_k(top_k):
    _expect(lambda: topk_memberships(torch.randn(B, NK, K), top_k), ("top_k",), str(top_k))


@pytest.mark.parametrize(
    "scores,name",
    [
        pytest.param(torch.randn(NK, K), "scores", id="rank2"),
        pytest.param(torch.ones(B, NK, K, dtype=torch.int64), "scores", id="int"),
    ],
)
def test_topk_memberships_rejects_scores(scores, name):
    _expect(lambda: topk_memberships(scores, 1), (name,))


@pytest.mark.parametrize("where", [(0, 0, 0), (1, NK - 1, K - 1)])
def test_nan_scores_rejected(where):
    x = torch.randn(B, NK, K)
    x[where] = math.nan
    _expect(lambda: topk_memberships(x, 1), ("scores",), "NaN")
    _expect(lambda: sinkhorn(x, 3), ("log_scores",), "NaN")


@pytest.mark.parametrize(
    "call,names",
    [
        pytest.param(lambda: sinkhorn(torch.randn(NK, K), 3), ("log_scores",), id="rank"),
        pytest.param(
            lambda: sinkhorn(torch.randn(B, NK, K), -1), ("n_iter",), id="n_iter-negative"
        ),
        pytest.param(
            lambda: sinkhorn(torch.randn(B, NK, K), 3, padding_mask=torch.ones(B, NK)),
            ("padding_mask",),
            id="pad-dtype",
        ),
        pytest.param(
            lambda: sinkhorn(torch.randn(B, NK, K), 3, padding_mask=torch.ones(B, NK + 1).bool()),
            ("padding_mask",),
            id="pad-shape",
        ),
    ],
)
def test_sinkhorn_rejects(call, names):
    _expect(call, names)


@pytest.mark.parametrize(
    "args,names",
    [
        pytest.param((_r(B, NK), _r(D, 4), _r(K, 4), 0.1), ("hidden",), id="hidden-rank"),
        pytest.param((_r(B, NK, D), _r(D + 1, 4), _r(K, 4), 0.1), ("proj",), id="proj-dmodel"),
        pytest.param((_r(B, NK, D), _r(D, 4), _r(K, 5), 0.1), ("centroids",), id="centroid-dg"),
        pytest.param((_r(B, NK, D), _r(D, 4), _r(K, 4), 0.0), ("temperature",), id="tau0"),
        pytest.param((_r(B, NK, D), _r(D, 4), _r(K, 4), -1.0), ("temperature",), id="tau-neg"),
    ],
)
def test_group_scores_rejects(args, names):
    _expect(lambda: group_scores(*args), names)


def _gated(**over):
    a = _good()
    probs_k = torch.softmax(torch.randn(B, NK, K), -1)
    base = dict(
        query=a["query"],
        key=a["key"],
        value=a["value"],
        query_probs=probs_k[:, NK - NQ :],
        key_probs=probs_k,
        window=2,
    )
    base.update(over)
    pos = [base.pop(n) for n in ("query", "key", "value", "query_probs", "key_probs", "window")]
    return gated_attention(*pos, **base)


@pytest.mark.parametrize(
    "over,names",
    [
        pytest.param(dict(gate="hard"), ("gate",), id="gate"),
        pytest.param(dict(window=0), ("window",), id="window"),
        pytest.param(dict(query_probs=torch.rand(B, NQ + 1, K)), ("query_probs",), id="qprobs"),
        pytest.param(dict(key_probs=torch.rand(B, NK, K + 1)), ("key_probs",), id="kprobs-K"),
        pytest.param(dict(key_probs=torch.rand(NK, K)), ("key_probs",), id="kprobs-rank"),
        pytest.param(dict(key=_r(B, 3, NK, D), value=_r(B, 3, NK, D)), ("key",), id="H%Hkv"),
        pytest.param(
            dict(query=_r(B, H, NK + 1, D), query_probs=torch.rand(B, NK + 1, K)),
            ("query", "Nq"),
            id="Nq>Nk",
        ),
        pytest.param(
            dict(key_padding_mask=torch.ones(B, NK)), ("key_padding_mask",), id="pad-dtype"
        ),
        pytest.param(
            dict(always_visible=torch.ones(B, NK + 1).bool()), ("always_visible",), id="sinks"
        ),
    ],
)
def test_gated_attention_rejects(over, names):
    _expect(lambda: _gated(**over), names)


@pytest.mark.parametrize("name", ["scale", "softcap"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "0.1"])
def test_scale_and_softcap_must_be_positive_finite(name, bad):
    """PyTorch's CPU flash kernel answers NaN for a causal call with scale <= 0: refuse it."""
    q = torch.randn(1, 2, 8, 4)
    k = v = torch.randn(1, 2, 8, 4)
    g = torch.zeros(1, 8, 2, dtype=torch.bool)
    g[..., 0] = True
    with pytest.raises(ValueError, match=name):
        sparse_attention(q, k, v, g, g, 2, **{name: bad})
    with pytest.raises(ValueError, match=name):
        gated_attention(q, k, v, g.float(), g.float(), 2, **{name: bad})


def test_tensors_on_another_device_are_refused():
    case = make_case(nk=20, seed=14)
    meta = {"query_groups": case.qg.to("meta"), "key_groups": case.kg.to("meta")}
    for name, tensor in meta.items():
        args = dict(query_groups=case.qg, key_groups=case.kg) | {name: tensor}
        with pytest.raises(ValueError, match=name):
            sparse_attention(case.q, case.k, case.v, window=4, **args)
    with pytest.raises(ValueError, match="key_padding_mask"):
        sparse_attention(
            case.q,
            case.k,
            case.v,
            case.qg,
            case.kg,
            4,
            key_padding_mask=torch.ones(1, 20, dtype=torch.bool, device="meta"),
        )
    with pytest.raises(ValueError, match="key"):
        sparse_attention(case.q, case.k.to("meta"), case.v, case.qg, case.kg, 4)


def test_a_zero_head_dim_is_refused():
    case = make_case(nk=20, seed=15)
    with pytest.raises(ValueError, match="D >= 1"):
        sparse_attention(case.q[..., :0], case.k[..., :0], case.v[..., :0], case.qg, case.kg, 4)
