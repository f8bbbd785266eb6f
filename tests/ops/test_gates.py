"""Soft gates for training (docs/method.md §3): gate="paper" (Eq. 2) and gate="log"."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops import gated_attention, group_scores, group_shares, sinkhorn

from .helpers import HYP, brute_mask, gen, naive_attention, padding_mask


def eq2_reference(
    q,
    k,
    v,
    gq,
    gk,
    window,
    *,
    gate,
    sharpness=10.0,
    eps=1e-6,
    scale=None,
    softcap=None,
    kpm=None,
    always_visible=None,
):
    """docs/method.md §3 written out in float64 for query i (absolute position Nk - Nq + t)
    and key j <= i with a_ij = g_i . g_j:
    paper: s_ij = (q_i . k_j) * scale * (local + (1 - local) * sigmoid(lambda * a_ij));
    log:   s_ij = (q_i . k_j) * scale + (1 - local) * log(eps + a_ij).
    ``always_visible`` keys count as local; causality and padding are hard masks."""
    batch, heads, nq, dim = q.shape
    nk = k.shape[2]
    rep = heads // k.shape[1]
    scale = dim**-0.5 if scale is None else scale
    i = torch.arange(nk - nq, nk)[:, None]
    j = torch.arange(nk)[None, :]
    local = ((i - j >= 0) & (i - j < window))[None].expand(batch, nq, nk)
    if always_visible is not None:
        local = local | always_visible[:, None, :]
    visible = (j <= i)[None].expand(batch, nq, nk)
    if kpm is not None:
        visible = visible & kpm[:, None, :]
    aff = gq.double() @ gk.double().transpose(1, 2)
    out = torch.zeros(batch, heads, nq, dim, dtype=torch.float64)
    for h in range(heads):
        s = q[:, h].double() @ k[:, h // rep].double().transpose(1, 2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if gate == "paper":
            s = s * torch.where(local, torch.ones_like(aff), torch.sigmoid(sharpness * aff))
        else:
            s = s + torch.where(local, torch.zeros_like(aff), torch.log(eps + aff))
        s = s.masked_fill(~visible, -math.inf)
        row = visible.any(-1, keepdim=True)
        p = torch.softmax(torch.where(row, s, torch.zeros_like(s)), dim=-1) * row
        out[:, h] = p @ v[:, h // rep].double()
    return out


def _soft_rows(g, batch, n, k, sharp):
    return torch.softmax(torch.randn(batch, n, k, generator=g) * sharp, dim=-1)


@st.composite
def gate_params(draw):
    kv = draw(st.integers(1, 2))
    nk = draw(st.integers(1, 48))
    return dict(
        batch=draw(st.integers(1, 2)),
        heads=kv * draw(st.integers(1, 2)),
        kv_heads=kv,
        nk=nk,
        nq=draw(st.sampled_from([nk, 1, max(1, nk // 2)])),
        dim=draw(st.sampled_from([1, 4, 16])),
        k=draw(st.integers(1, 6)),
        window=draw(st.integers(1, nk + 2)),
        padding=draw(st.sampled_from([None, "left", "right", "random"])),
        sharp=draw(st.sampled_from([0.3, 3.0, 30.0])),
        sharpness=draw(st.sampled_from([1.0, 10.0, 50.0])),
        softcap=draw(st.sampled_from([None, None, 1.5])),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _build(p):
    g = gen(p["seed"])
    q = torch.randn(p["batch"], p["heads"], p["nq"], p["dim"], generator=g)
    k = torch.randn(p["batch"], p["kv_heads"], p["nk"], p["dim"], generator=g)
    v = torch.randn(p["batch"], p["kv_heads"], p["nk"], p["dim"], generator=g)
    gk = _soft_rows(g, p["batch"], p["nk"], p["k"], p["sharp"])
    gq = gk[:, p["nk"] - p["nq"] :]
    kpm = padding_mask(g, p["batch"], p["nk"], p["padding"])
    sinks = None
    if p["sinks"]:
        sinks = torch.zeros(p["batch"], p["nk"], dtype=torch.bool)
        sinks[:, 0] = True
    return q, k, v, gq, gk, kpm, sinks


@pytest.mark.parametrize("gate", ["paper", "log"])
@given(p=gate_params())
@HYP
def test_gate_equals_direct_float64_implementation(gate, p):
    q, k, v, gq, gk, kpm, sinks = _build(p)
    kw = dict(gate=gate, sharpness=p["sharpness"], softcap=p["softcap"], always_visible=sinks)
    out = gated_attention(q, k, v, gq, gk, p["window"], key_padding_mask=kpm, **kw)
    ref = eq2_reference(q, k, v, gq, gk, p["window"], kpm=kpm, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= 1e-5, f"{gate} gate differs from the float64 implementation by {err:.3g}"


def test_paper_gate_tempers_but_never_prunes():
    """Eq. 2 keeps at least half of each distant logit for non-negative affinities: with
    orthogonal routing rows a distant key still gets weight exp(0.5 * logit) > 0."""
    n, window = 12, 2
    q = torch.ones(1, 1, n, 4)
    k = torch.ones(1, 1, n, 4)
    v = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 4).contiguous()
    rows = torch.eye(n)[None]  # a_ij = 0 for every i != j
    c = 4 * 4**-0.5  # q.k * scale
    out = gated_attention(q, k, v, rows, rows, window, gate="paper")[0, 0, :, 0]
    for i in range(n):
        w = [math.exp(c if i - j < window else 0.5 * c) for j in range(i + 1)]
        want = sum(wj * j for j, wj in enumerate(w)) / sum(w)
        assert abs(out[i].item() - want) <= 1e-5, (i, out[i].item(), want)


@pytest.mark.parametrize("window", [1, 2, 4, 7])
@pytest.mark.parametrize("gate", ["paper", "log"])
def test_window_boundary_convention(window, gate):
    """Key j is local to query i iff 0 <= i - j < window: with orthogonal routing rows the
    log gate leaves exactly the window (eps -> 0), the paper gate halves distant logits."""
    n = 16
    q = torch.ones(1, 1, n, 4)
    k = torch.ones(1, 1, n, 4)
    v = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 4).contiguous()
    rows = torch.eye(n)[None]
    out = gated_attention(q, k, v, rows, rows, window, gate=gate, eps=1e-30)[0, 0, :, 0]
    c = 4 * 4**-0.5
    for i in range(n):
        if gate == "log":
            lo = max(0, i - window + 1)
            want = sum(range(lo, i + 1)) / (i + 1 - lo)
        else:
            w = [math.exp(c if i - j < window else 0.5 * c) for j in range(i + 1)]
            want = sum(wj * j for j, wj in enumerate(w)) / sum(w)
        assert abs(out[i].item() - want) <= 1e-5, (i, out[i].item(), want)


@pytest.mark.parametrize("eps,tol", [(1e-30, 1e-5), (1e-6, 5e-3)])
@given(p=gate_params(), top_k_src=st.integers(0, 10**6))
@HYP
def test_log_gate_with_one_hot_rows_equals_hard_mask_oracle(eps, tol, p, top_k_src):
    """Hard limit of the log gate: one-hot routing rows give exactly the Focus mask (up to
    the eps leak, bounded here by ``tol`` for the default eps = 1e-6)."""
    q, k, v, _, _, kpm, _ = _build(p)
    g = gen(top_k_src)
    groups = torch.randint(0, p["k"], (p["batch"], p["nk"]), generator=g)
    gk = torch.nn.functional.one_hot(groups, p["k"]).float()
    gq = gk[:, p["nk"] - p["nq"] :]
    out = gated_attention(q, k, v, gq, gk, p["window"], gate="log", eps=eps, key_padding_mask=kpm)
    mask = brute_mask(gq.bool(), gk.bool(), p["window"], kpm)
    ref, _ = naive_attention(q, k, v, mask)
    # Rows whose hard mask is empty although some causal real key exists (only a padded
    # query, which is not even local to itself, can be in that state) have no hard limit:
    # the gate renormalises over its -log(eps)-biased keys. Compare every other row.
    rows = mask.any(-1)[:, None, :, None].expand_as(ref)
    err = (out.double() - ref).abs()[rows].max().item() if rows.any() else 0.0
    assert err <= tol, f"log gate with one-hot rows differs from the hard oracle by {err:.3g}"


@pytest.mark.parametrize("gate", ["paper", "log"])
def test_always_visible_keys(gate):
    """A sink key is ungated for every later query, never visible to earlier ones (causality
    wins) and never visible when it is padding."""
    n, window = 20, 3
    g = gen(21)
    q = torch.randn(1, 2, n, 8, generator=g)
    k = torch.randn(1, 2, n, 8, generator=g)
    v = torch.randn(1, 2, n, 8, generator=g)
    rows = torch.eye(n)[None]  # nobody shares a group
    sinks = torch.zeros(1, n, dtype=torch.bool)
    sinks[0, [0, 10]] = True
    out = gated_attention(q, k, v, rows, rows, window, gate=gate, eps=1e-30, always_visible=sinks)
    ref = eq2_reference(q, k, v, rows, rows, window, gate=gate, eps=1e-30, always_visible=sinks)
    torch.testing.assert_close(out.double(), ref, **tolerance("oracle"))
    if gate == "log":  # hard limit: window plus the sinks, causally
        mask = brute_mask(rows.bool(), rows.bool(), window)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        mask = mask | ((j <= i) & sinks[0][None])
        hard, _ = naive_attention(q, k, v, mask)
        torch.testing.assert_close(out.double(), hard, **tolerance("oracle"))
        # query 5 must not see the later sink at position 10
        without = sinks.clone()
        without[0, 10] = False
        o2 = gated_attention(
            q, k, v, rows, rows, window, gate=gate, eps=1e-30, always_visible=without
        )
        torch.testing.assert_close(o2[:, :, :10], out[:, :, :10], **tolerance("rounding"))
    # a padded sink is invisible
    kpm = torch.ones(1, n, dtype=torch.bool)
    kpm[0, 0] = False
    o3 = gated_attention(
        q, k, v, rows, rows, window, gate=gate, always_visible=sinks, key_padding_mask=kpm
    )
    r3 = eq2_reference(q, k, v, rows, rows, window, gate=gate, always_visible=sinks, kpm=kpm)
    torch.testing.assert_close(o3.double(), r3, **tolerance("oracle"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["paper", "log"])
def test_fully_padded_rows_are_zero_and_finite(gate, dtype):
    n = 10
    g = gen(31)
    q = torch.randn(2, 2, n, 8, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(2, 1, n, 8, generator=g).to(dtype).requires_grad_(True)
    v = torch.randn(2, 1, n, 8, generator=g).to(dtype).requires_grad_(True)
    probs = _soft_rows(g, 2, n, 4, 3.0).requires_grad_(True)
    kpm = torch.ones(2, n, dtype=torch.bool)
    kpm[0] = False  # a sequence with no real key at all
    kpm[1, :4] = False  # left padding: queries 0..3 see no real key
    out = gated_attention(q, k, v, probs, probs, 3, gate=gate, key_padding_mask=kpm)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[1, :, :4] == 0).all()
    out.float().pow(2).sum().backward()
    for t in (q, k, v, probs):
        assert torch.isfinite(t.grad).all()
    assert (k.grad[0] == 0).all() and (v.grad[1, :, :4] == 0).all()


@pytest.mark.parametrize("gate", ["paper", "log"])
def test_gradients_match_float64_reference(gate):
    """fp32 gradients of every input (q, k, v and both routing-row tensors) agree with
    autograd through the float64 implementation."""
    g = gen(41)
    nk, nq = 9, 6
    base = [
        torch.randn(1, 2, nq, 4, generator=g),
        torch.randn(1, 1, nk, 4, generator=g),
        torch.randn(1, 1, nk, 4, generator=g),
        _soft_rows(g, 1, nq, 3, 2.0),
        _soft_rows(g, 1, nk, 3, 2.0),
    ]
    kpm = torch.ones(1, nk, dtype=torch.bool)
    kpm[0, 1] = False
    cot = torch.randn(1, 2, nq, 4, generator=g)

    def grads(fn, dtype):
        leaves = [t.detach().clone().to(dtype).requires_grad_(True) for t in base]
        (fn(*leaves) * cot.to(dtype)).sum().backward()
        return [t.grad for t in leaves]

    kw = dict(gate=gate, sharpness=3.0, eps=1e-3)
    got = grads(lambda *a: gated_attention(*a, 2, key_padding_mask=kpm, **kw), torch.float32)
    want = grads(lambda *a: eq2_reference(*a, 2, kpm=kpm, **kw), torch.float64)
    for name, a, b in zip(["q", "k", "v", "gq", "gk"], got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, **tolerance("gradient"), msg=f"d{name}")


@pytest.mark.parametrize("gate", ["paper", "log"])
def test_gradcheck_float64(gate):
    g = gen(51)
    nk, nq = 5, 4
    inputs = (
        torch.randn(1, 2, nq, 3, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(1, 1, nk, 3, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(1, 1, nk, 3, generator=g, dtype=torch.float64, requires_grad=True),
        _soft_rows(g, 1, nq, 3, 1.0).double().requires_grad_(True),
        _soft_rows(g, 1, nk, 3, 1.0).double().requires_grad_(True),
    )
    assert torch.autograd.gradcheck(
        lambda *a: gated_attention(*a, 2, gate=gate, sharpness=3.0, eps=1e-3), inputs
    )


def _clustered_router(kind: str):
    """Hidden states in one tight cluster and 16 centroids: one on the cluster and 15
    pointing away ("far"), all identical, or all zero."""
    g = gen(10)
    d_model, d_g, k = 32, 16, 16
    proj = torch.randn(d_model, d_g, generator=g) / d_model**0.5
    base = torch.randn(1, 1, d_model, generator=g)
    hidden = base + 0.05 * torch.randn(2, 60, d_model, generator=g)  # one tight cluster
    direction = torch.nn.functional.normalize((base @ proj)[0, 0], dim=0)
    if kind == "far":  # centroid 0 on the cluster, 15 centroids pointing away from it
        cents = -direction.repeat(k, 1) + 0.1 * torch.randn(k, d_g, generator=g)
        cents[0] = direction
    elif kind == "identical":
        cents = torch.randn(1, d_g, generator=g).repeat(k, 1)
    else:  # "zero": centroids never initialised
        cents = torch.zeros(k, d_g)
    return hidden, proj.requires_grad_(True), cents.requires_grad_(True)


@pytest.mark.parametrize("gate", ["paper", "log"])
@pytest.mark.parametrize("kind", ["far", "identical", "zero"])
def test_a_training_step_with_empty_or_identical_groups_stays_finite(kind, gate):
    hidden, proj, cents = _clustered_router(kind)
    scores = group_scores(hidden, proj, cents, 0.1)
    pad = torch.ones(2, 60, dtype=torch.bool)
    pad[1, :7] = False
    probs = sinkhorn(scores, 10, padding_mask=pad)
    g = gen(11)
    q = torch.randn(2, 4, 60, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 60, 16, generator=g)
    v = torch.randn(2, 2, 60, 16, generator=g)
    out = gated_attention(q, k, v, probs, probs, 8, gate=gate, key_padding_mask=pad)
    assert torch.isfinite(out).all()
    out.pow(2).mean().backward()
    for name, t in (("proj", proj), ("centroids", cents), ("query", q)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), f"{name} grad not finite"
    # the unused centroids (every centroid but 0 in "far") still get finite gradients
    assert torch.isfinite(cents.grad[1:]).all()
    # Sinkhorn still spreads the mass over all 16 groups (that is what it is for)
    shares = group_shares(sinkhorn(scores.detach(), 300))
    assert (shares - 1 / 16).abs().max() <= 1e-2
    if kind in ("identical", "zero"):  # identical rows: the uniform distribution exactly
        want = torch.full_like(probs, 1 / 16).masked_fill(~pad[..., None], 0.0)
        torch.testing.assert_close(probs, want, **tolerance("rounding"))  # padding rows are zero


@pytest.mark.parametrize("gate", ["log", "paper"])
@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("nq,nk,padded", [(23, 23, False), (23, 23, True), (9, 30, True)])
def test_chunked_rows_equal_the_whole_call_with_gradients(gate, chunk, nq, nk, padded):
    """Query chunks recomputed in backward (docs/method.md §6) give the same output and the
    same gradients for query, key, value and both routing rows."""
    g = gen(nq * nk + chunk)
    b, h, h_kv, d, groups = 2, 4, 2, 8, 3
    q = torch.randn(b, h, nq, d, generator=g)
    k = torch.randn(b, h_kv, nk, d, generator=g)
    v = torch.randn(b, h_kv, nk, d, generator=g)
    probs = torch.softmax(torch.randn(b, nk, groups, generator=g), -1)
    kpm = padding_mask(g, b, nk, "left") if padded else None
    sinks = torch.zeros(b, nk, dtype=torch.bool)
    sinks[:, :2] = True

    def run(chunk_size):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, probs)]
        qq, kk, vv, pp = leaves
        out = gated_attention(qq, kk, vv, pp[:, nk - nq :], pp, 4, gate=gate,
                              key_padding_mask=kpm, always_visible=sinks,
                              chunk_size=chunk_size)  # fmt: skip
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    want, want_grads = run(None)
    got, got_grads = run(chunk)
    torch.testing.assert_close(got, want, **tolerance("reordered"))
    for a, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, w, **tolerance("gradient"))


def test_chunk_size_must_be_positive():
    q = torch.randn(1, 2, 6, 4)
    k = torch.randn(1, 2, 6, 4)
    p = torch.full((1, 6, 2), 0.5)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_attention(q, k, k, p, p, 2, chunk_size=0)
