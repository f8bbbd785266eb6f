"""The diagnostic visibility masks (top-k by q.k, k-means groups of keys) against pair-by-pair
float64 references written from their documented rule."""

from __future__ import annotations

import math

import pytest
import torch

from focus_attention.ops.diagnostic import (
    distant_kept_share,
    group_visibility,
    kmeans_keys,
    near_and_distant,
    oracle_visibility,
)

#: (B, H, H_kv, Nq, Nk, window, sinks): MHA and GQA 3:1, odd lengths, decode-like Nq < Nk
SHAPES = [
    (1, 2, 2, 13, 13, 3, 0),
    (2, 3, 1, 17, 17, 4, 2),
    (1, 6, 2, 5, 23, 2, 1),
    (2, 3, 3, 1, 11, 1, 0),
    (1, 3, 1, 9, 9, 20, 1),  # window above Nk: no distant key
]


def _case(b, h, h_kv, nq, nk, sinks, seed=0, padded=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(b, h_kv, nk, 8, generator=g, dtype=torch.float64)
    sink = torch.zeros(b, nk, dtype=torch.bool)
    sink[:, :sinks] = True
    real = None
    if padded:  # left padding of the first row, its sinks after it
        real = torch.ones(b, nk, dtype=torch.bool)
        real[0, :2] = False
        sink[0] = False
        sink[0, 2 : 2 + sinks] = True
    return q, k, (sink if sinks else None), real


def _kind(i, j, window, sinks, real, b):
    """``"near"``, ``"distant"`` or None for query position ``i`` and key ``j`` (pair rule)."""
    if j > i or (real is not None and not real[b, j]):
        return None
    if i - j < window or (sinks is not None and sinks[b, j]):
        return "near"
    return "distant"


def _pooled(q, k_or_c, b, kv, t, rep):
    """max over the query heads of key-value head ``kv`` of q.x, float64 ``[M]``."""
    heads = range(kv * rep, (kv + 1) * rep)
    return torch.stack([k_or_c[b, kv] @ q[b, h, t] for h in heads]).max(dim=0).values


def _check_oracle(mask, q, k, window, groups, sinks, real, top_k=1):
    b_, h, nq, _ = q.shape
    h_kv, nk = k.shape[1], k.shape[2]
    rep = h // h_kv
    for b in range(b_):
        for kv in range(h_kv):
            for t in range(nq):
                i = nk - nq + t
                kinds = [_kind(i, j, window, sinks, real, b) for j in range(nk)]
                far = [j for j in range(nk) if kinds[j] == "distant"]
                scores = _pooled(q, k, b, kv, t, rep)
                kept = [j for j in far if mask[b, kv, t, j]]
                assert len(kept) == math.ceil(top_k * len(far) / groups)  # the budget, exactly
                dropped = [j for j in far if not mask[b, kv, t, j]]
                if kept and dropped:  # the kept are the best
                    assert min(scores[kept]) >= max(scores[dropped])
                for j in range(nk):  # near always, nothing else
                    if kinds[j] != "distant":
                        assert bool(mask[b, kv, t, j]) == (kinds[j] == "near")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("groups", [1, 3, 4])
def test_oracle_keeps_the_budget_of_best_distant_keys(shape, groups):
    b, h, h_kv, nq, nk, window, sinks = shape
    q, k, sink, real = _case(b, h, h_kv, nq, nk, sinks)
    mask = oracle_visibility(q, k, window, groups, sinks=sink)
    assert mask.shape == (b, h_kv, nq, nk) and mask.dtype == torch.bool
    _check_oracle(mask, q, k, window, groups, sink, None)


@pytest.mark.parametrize(("groups", "top_k"), [(4, 2), (3, 2), (8, 3), (4, 4)])
def test_oracle_at_a_larger_budget_keeps_top_k_groups_worth(groups, top_k):
    """``top_k`` of ``num_groups``: each query keeps ``ceil(top_k * distant / K)`` of its
    best distant keys (all of them at top_k = K), a superset of top-1's choice."""
    q, k, sink, real = _case(2, 6, 2, 19, 23, 2, seed=7, padded=True)
    mask = oracle_visibility(q, k, 3, groups, top_k=top_k, sinks=sink, real=real)
    _check_oracle(mask, q, k, 3, groups, sink, real, top_k=top_k)
    one = oracle_visibility(q, k, 3, groups, sinks=sink, real=real)
    assert torch.equal(one & mask, one) and mask.sum() > one.sum()


def test_oracle_with_padding_and_float32():
    q, k, sink, real = _case(2, 3, 1, 15, 15, 1, seed=3, padded=True)
    mask = oracle_visibility(q.float(), k.float(), 3, 4, sinks=sink, real=real)
    _check_oracle(mask, q, k, 3, 4, sink, real)


def test_oracle_with_one_group_is_causal_attention():
    q, k, _, _ = _case(1, 3, 1, 11, 11, 0)
    mask = oracle_visibility(q, k, 2, 1)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], causal)


def _naive_kmeans(k, start, iters, real):
    """Lloyd's rounds pair by pair in float64 from the initial centroids ``start``."""
    b_, h_kv, nk, _ = k.shape
    cents = start.clone()
    labels = torch.zeros(b_, h_kv, nk, dtype=torch.long)

    def assign():
        for b in range(b_):
            for kv in range(h_kv):
                for j in range(nk):
                    d = [float(((k[b, kv, j] - c) ** 2).sum()) for c in cents[b, kv]]
                    labels[b, kv, j] = d.index(min(d))

    for _ in range(iters):
        assign()
        for b in range(b_):
            for kv in range(h_kv):
                for c in range(cents.shape[2]):
                    members = [j for j in range(nk) if labels[b, kv, j] == c
                               and (real is None or real[b, j])]  # fmt: skip
                    if members:
                        cents[b, kv, c] = k[b, kv, members].mean(dim=0)
    assign()
    return labels, cents


@pytest.mark.parametrize("padded", [False, True])
def test_kmeans_equals_naive_lloyd(padded):
    _, k, _, real = _case(2, 3, 3, 19, 19, 1, seed=5, padded=padded)
    start = kmeans_keys(k, 4, iters=0, seed=7, real=real)[1]
    if real is not None:  # the seeds are real keys, distinct
        for b in range(2):
            for kv in range(3):
                rows = [int((k[b, kv] == c).all(-1).nonzero()[0]) for c in start[b, kv]]
                assert len(set(rows)) == 4 and all(real[b, r] for r in rows)
    labels, cents = kmeans_keys(k, 4, iters=5, seed=7, real=real)
    want_labels, want_cents = _naive_kmeans(k, start, 5, real)
    assert torch.equal(labels, want_labels)
    torch.testing.assert_close(cents, want_cents, rtol=0, atol=1e-12)
    assert torch.equal(kmeans_keys(k, 4, iters=5, seed=7, real=real)[0], labels)  # seeded


def _check_groups(mask, q, k, window, cents, top, sinks):
    b_, h, nq, _ = q.shape
    h_kv, nk, groups = k.shape[1], k.shape[2], cents.shape[2]
    labels = _naive_kmeans(k, cents, 0, None)[0]
    for b in range(b_):
        for kv in range(h_kv):
            for t in range(nq):
                i = nk - nq + t
                scores = _pooled(q, cents, b, kv, t, h // h_kv).tolist()
                best = sorted(range(groups), key=lambda c: -scores[c])[:top]
                for j in range(nk):
                    kind = _kind(i, j, window, sinks, None, b)
                    want = kind == "near" or (kind == "distant" and int(labels[b, kv, j]) in best)
                    assert bool(mask[b, kv, t, j]) == want


@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize(("groups", "top"), [(3, 1), (8, 4)])
def test_groups_show_the_best_groups_distant_keys(shape, groups, top):
    b, h, h_kv, nq, nk, window, sinks = shape
    q, k, sink, _ = _case(b, h, h_kv, nq, nk, sinks, seed=2)
    if groups > nk:
        pytest.skip("more groups than keys")
    cents = kmeans_keys(k, groups, iters=4, seed=11)[1]
    mask = group_visibility(q, k, window, cents, top, sinks=sink)
    assert mask.shape == (b, h_kv, nq, nk)
    _check_groups(mask, q, k, window, cents, top, sink)


def test_groups_of_a_prompt_take_new_keys_to_their_nearest_centroid():
    q, k, sink, _ = _case(1, 6, 2, 4, 21, 1, seed=8)
    cents = kmeans_keys(k[:, :, :17], 3, iters=3, seed=1)[1]  # fitted on the prompt's keys
    mask = group_visibility(q, k, 3, cents, 2, sinks=sink)
    _check_groups(mask, q, k, 3, cents, 2, sink)


def test_all_groups_is_causal_attention():
    q, k, _, _ = _case(1, 3, 1, 10, 10, 0)
    mask = group_visibility(q, k, 2, kmeans_keys(k, 3)[1], 3)
    assert torch.equal(mask[0, 0], torch.ones(10, 10, dtype=torch.bool).tril())


def test_kept_share_counts_distant_keys_only():
    q, k, sink, _ = _case(1, 3, 1, 12, 12, 1)
    near, distant = near_and_distant(12, 12, 3, sinks=sink)
    assert distant_kept_share(near, 3, sinks=sink) == 0.0
    assert distant_kept_share(near | distant, 3, sinks=sink) == 1.0
    mask = oracle_visibility(q, k, 3, 2, sinks=sink)
    counts = distant[0].sum(-1)
    want = torch.tensor([math.ceil(c / 2) / c for c in counts.tolist() if c]).double().mean()
    assert distant_kept_share(mask, 3, sinks=sink) == pytest.approx(float(want))
    assert distant_kept_share(near, 50) is None


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda q, k: oracle_visibility(q, k, 0, 2), "window"),
        (lambda q, k: oracle_visibility(q, k, 2, 0), "num_groups"),
        (lambda q, k: oracle_visibility(q, k, 2, 2, top_k=0), "top_k"),
        (lambda q, k: oracle_visibility(q, k, 2, 2, top_k=3), "top_k.*num_groups = 2"),
        (lambda q, k: oracle_visibility(q, k[:, :, :, :4], 2, 2), "key"),
        (lambda q, k: oracle_visibility(q[:, :2], k[:, :, :3], 2, 2), "key"),
        (lambda q, k: kmeans_keys(k, 99), "num_clusters"),
        (lambda q, k: group_visibility(q, k, 2, k[:, :, :2], 3), "top_groups"),
        (lambda q, k: group_visibility(q, k, 2, k[:, :, :2, :4], 1), "centroids"),
        (lambda q, k: oracle_visibility(q, k, 2, 2, sinks=torch.ones(1, 3)), "sinks"),
        (lambda q, k: distant_kept_share(torch.ones(2, 2), 2), "mask"),
    ],
)
def test_bad_input_names_it(call, match):
    q, k, _, _ = _case(1, 3, 1, 6, 6, 0)
    with pytest.raises(ValueError, match=match):
        call(q, k)
