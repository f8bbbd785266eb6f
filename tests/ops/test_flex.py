"""The ``flex`` backend (PyTorch FlexAttention, docs/method.md §5 "Backends").

On CPU FlexAttention runs eagerly, where every pair goes through the ``mask_mod`` and the
block masks are not used; compiled kernels (CUDA) skip the blocks the block mask leaves out
and run "full" blocks without the ``mask_mod``. So the CPU tests check two things that
together give the compiled result: the eager result equals the dense oracle on the grids
of the other backends, and the block masks say exactly what the ``mask_mod`` says (every
visible pair lies in a kept block, every pair of a full block is visible). The tests that
need a GPU (compiled with log-sum-exp, gradients) skip without one.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import tolerance

from focus_attention.ops import (
    BACKENDS,
    SparseRequest,
    backend_names,
    gated_attention,
    resolve_backend,
    sparse_attention,
)
from focus_attention.ops.sparse import flex

from . import test_empty_inputs as empty_inputs
from . import test_gates as gates_tests
from . import test_sparse_attention as grids
from . import test_sparse_numerics as numerics
from .helpers import (
    HYP,
    HYP_SMALL,
    assert_matches_oracle,
    case_params,
    gen,
    low_precision_bound,
    make_case,
    padding_mask,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def _request(**kw) -> SparseRequest:
    base = dict(device=CPU, dtype=torch.float32, needs_grad=False, num_groups=4, num_queries=512)
    return SparseRequest(**{**base, **kw})


# --------------------------------------------------------------------------------------
# registration and refusals
# --------------------------------------------------------------------------------------


def test_flex_is_registered_between_the_cpu_kernels_and_math():
    names = backend_names()
    assert names.index("cpu_flash") < names.index("flex") < names.index("math")
    assert BACKENDS.index("cpu_flash") < BACKENDS.index("flex") < BACKENDS.index("math")


@pytest.mark.parametrize(
    "request_kw,chosen",
    [
        pytest.param({}, "triton", id="fp32"),
        pytest.param(dict(dtype=torch.bfloat16), "triton", id="bf16"),
        pytest.param(dict(dtype=torch.float64), "flex", id="fp64"),
        pytest.param(dict(needs_grad=True), "triton", id="grad"),
        pytest.param(dict(softcap=True), "triton", id="softcap"),
        pytest.param(dict(num_groups=100), "flex", id="100-groups"),
    ],
)
def test_auto_on_cuda_chooses_the_triton_kernels_then_flex(request_kw, chosen, monkeypatch):
    """Decided from the request alone (no GPU needed): with Triton present, "auto" takes the
    package's Triton kernels for CUDA calls they run (float32/bfloat16/float16, K <= 62,
    soft-capping, gradients), and flex for the others (float64, more groups)."""
    monkeypatch.setattr(flex, "triton_available", lambda: True)
    assert resolve_backend("auto", _request(device=CUDA, **request_kw)).name == chosen


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("queries", [1, 8, 9])
def test_auto_chooses_gather_for_decoding_sized_calls_with_many_groups_on_cuda(device, queries, monkeypatch):  # fmt: skip
    """Decoding-sized calls the Triton kernels do not take (more than 62 groups) go to
    gather on CUDA."""
    monkeypatch.setattr(flex, "triton_available", lambda: True)
    got = resolve_backend("auto", _request(device=device, num_queries=queries, num_groups=100)).name  # fmt: skip
    assert (got == "gather") == (queries <= 8 and device == CUDA)


@pytest.mark.parametrize(
    "name,request_kw,words",
    [
        ("flex", dict(needs_grad=True), ("no gradients on CPU", "'math'")),
        ("flex", dict(device=torch.device("meta")), ("cpu/cuda", "meta")),
        ("flex", dict(device=CUDA), ("Triton",)),
    ],
)
def test_flex_says_why_it_cannot_run(name, request_kw, words, monkeypatch):
    monkeypatch.setattr(flex, "triton_available", lambda: False)
    with pytest.raises(ValueError) as info:
        resolve_backend(name, _request(**request_kw))
    msg = str(info.value)
    assert msg.startswith("backend:") and "'flex'" in msg
    for word in words:
        assert word in msg, msg


def test_why_not_auto_names_the_device_restriction():
    reason = flex.BACKEND.why_not_auto(_request())
    assert reason is not None and "cuda" in reason and "by name" in reason
    assert flex.BACKEND.why_not(_request()) is None


def test_flex_refuses_inputs_that_require_grad_on_cpu():
    case = make_case(nk=30, seed=16)
    q = case.q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="'flex'.*no gradients on CPU"):
        sparse_attention(q, case.k, case.v, case.qg, case.kg, case.window, backend="flex")
    with torch.no_grad():  # no gradient wanted: it runs
        out = sparse_attention(q, case.k, case.v, case.qg, case.kg, case.window, backend="flex")
    assert_matches_oracle(case, out)


def test_a_failed_dynamic_compilation_falls_back_to_kernels_per_shape(monkeypatch):
    """When compiling FlexAttention with dynamic shapes fails (seen on CUDA, torch 2.11),
    the call and every later one run the per-shape compiled function, with one warning;
    the result is the oracle's (the functions are stood in for by eager FlexAttention)."""
    from torch._dynamo.exc import BackendCompilerFailed

    calls = {"dynamic": 0, "static": 0}

    def function(device, *, static=False):
        def run(*args, **kwargs):
            calls["static" if static else "dynamic"] += 1
            if not static:
                raise BackendCompilerFailed(None, RuntimeError("NoValidChoicesError"), None)
            return flex.flex_attention(*args, **kwargs)

        return run

    monkeypatch.setattr(flex, "_flex_function", function)
    monkeypatch.setattr(flex, "_STATIC_ONLY", False)
    case = make_case(nk=40, heads=4, kv_heads=2, dim=8, window=8, top_k=2, padding="random")
    args = (case.q, case.k, case.v, case.qg, case.kg, case.window)
    with pytest.warns(RuntimeWarning, match="did not compile with dynamic shapes"):
        out = sparse_attention(*args, key_padding_mask=case.kpm, backend="flex")
    assert_matches_oracle(case, out)
    assert calls["dynamic"] == 1 and calls["static"] >= 1
    static_calls = calls["static"]
    again = sparse_attention(*args, key_padding_mask=case.kpm, backend="flex")
    torch.testing.assert_close(again, out, **tolerance("bitwise"))
    assert calls["dynamic"] == 1 and calls["static"] == 2 * static_calls  # no second try


def test_the_custom_op_passes_opcheck_with_flex():
    case = make_case(nk=40, heads=4, kv_heads=2, dim=8, window=8, top_k=2, padding="random")
    args = (case.q, case.k, case.v, case.qg, case.kg, case.kpm, 8, 0.35, None, "flex")
    result = torch.library.opcheck(torch.ops.focus_attention.sparse_attention.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_a_compiled_caller_gets_the_eager_result():
    """Under ``torch.compile`` the op stays opaque and runs eagerly; on the first run of the
    compiled graph AOTAutograd checks custom operators inside a dispatch mode, where eager
    FlexAttention's vmap must still work (aot_eager: no C++ compiler needed)."""
    case = make_case(nk=40, heads=4, kv_heads=2, dim=8, window=8, top_k=2, padding="random")

    def user_code(q, k, v, qg, kg, kpm):
        out = sparse_attention(q * 1.0, k, v, qg, kg, 8, key_padding_mask=kpm, backend="flex")
        return out + 0.0

    args = (case.q, case.k, case.v, case.qg, case.kg, case.kpm)
    eager = user_code(*args)
    compiled = torch.compile(user_code, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # the first run (checked) and a later one
        assert torch.equal(compiled(*args), eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(empty_inputs.EMPTY_SHAPES))
def test_empty_inputs(name):
    empty_inputs.test_sparse_attention_on_empty_inputs(name, "flex")


# --------------------------------------------------------------------------------------
# exactness on the grids of the other backends (eager on CPU)
# --------------------------------------------------------------------------------------


#: the grid of the other backends; of its three lengths around 1024 (a block size of the
#: CPU kernels, not of flex) one is kept, to bound the run time of the eager CPU path.
GRID = [p for p in grids.GRID if p.id not in {"prefill-n1023", "prefill-n1027"}]


@pytest.mark.parametrize("params", GRID)
def test_grid_fp32_equals_oracle(params):
    case = make_case(**params)
    out, lse = case.sparse("flex", return_lse=True)
    assert_matches_oracle(case, out, lse)


@pytest.mark.parametrize("params", grids.HALF_GRID)
def test_grid_half_within_twice_dense_error(params, half_dtype):
    case = make_case(**params, dtype=half_dtype)
    out, lse = case.sparse("flex", return_lse=True)
    assert_matches_oracle(case, out, lse)


@given(params=case_params())
@HYP
def test_property_fp32_equals_oracle(params):
    case = make_case(**params)
    out, lse = case.sparse("flex", return_lse=True)
    assert_matches_oracle(case, out, lse)


@given(params=case_params(max_nk=48, long_nk=160), dtype=st.sampled_from(["bf16", "fp16"]))
@HYP_SMALL
def test_property_half_within_twice_dense_error(params, dtype):
    case = make_case(**params, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
    out, lse = case.sparse("flex", return_lse=True)
    assert_matches_oracle(case, out, lse)


def test_float64_is_computed_in_float64():
    case = make_case(nk=90, nq=40, heads=4, kv_heads=2, top_k=2, padding="random", seed=2)
    q, k, v = (t.double() for t in (case.q, case.k, case.v))
    out, lse = sparse_attention(
        q, k, v, case.qg, case.kg, case.window, key_padding_mask=case.kpm, backend="flex",
        return_lse=True,
    )  # fmt: skip
    ref, ref_lse = grids.naive_attention(case.q, case.k, case.v, case.mask())
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert (out - ref).abs().max() <= 1e-12
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse - ref_lse)[fin].abs().max() <= 1e-12


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("n", [n for n in grids.ODD_LENGTHS if n <= 129])  # longer: GRID
def test_short_and_odd_lengths_equal_oracle(n, batch):
    grids.test_short_and_odd_lengths_equal_oracle(n, batch, "flex")


@pytest.mark.parametrize("mode", ["prefill", "decode", "chunk"])
@pytest.mark.parametrize("window", [1, 2, 4, 7, 16, 40])
@pytest.mark.parametrize("n,membership", grids.WINDOW_SHAPES)
def test_window_counts_the_query_itself(n, membership, window, mode):
    grids.test_window_counts_the_query_itself(n, membership, window, mode, "flex")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [1, 4, 20])
def test_window_means_are_exact_in_half_precision(dtype, window):
    grids.test_window_means_are_exact_in_half_precision_and_decode_equals_prefill(
        dtype, window, "flex"
    )


def test_scale_argument_is_used():
    grids.test_scale_argument_is_used("flex")


def test_softcap_equals_oracle():
    """flex applies Gemma-2's soft-capping (a ``score_mod``), in both parts."""
    case = make_case(nk=120, nq=40, heads=4, kv_heads=2, top_k=2, padding="right", seed=5)
    case.q = case.q * 4  # large logits so the cap matters
    out, lse = case.sparse("flex", softcap=2.0, return_lse=True)
    ref, ref_lse = grids.naive_attention(case.q, case.k, case.v, case.mask(), softcap=2.0)
    assert (out.double() - ref).abs().max() <= 1e-5
    fin = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[fin].abs().max() <= 1e-4
    uncapped, _ = grids.naive_attention(case.q, case.k, case.v, case.mask())
    assert (uncapped - ref).abs().max() > 1e-2  # the cap changed something


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_a_single_group_equals_dense_causal(kv_heads):
    grids.test_a_single_group_equals_dense_causal(kv_heads, "flex")


def test_every_token_in_one_group_equals_dense_causal():
    grids.test_every_token_in_one_group_equals_dense_causal("flex")


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_a_zeroed_kv_head_zeroes_only_its_query_heads(kv_heads, mode):
    grids.test_a_zeroed_kv_head_zeroes_only_its_query_heads(kv_heads, mode, "flex")


@pytest.mark.parametrize("mode", ["prefill", "chunk", "decode"])
def test_non_contiguous_inputs(mode):
    grids.test_non_contiguous_inputs(mode, "flex")


def test_a_huge_window_means_every_causal_pair_is_local():
    grids.test_a_huge_window_means_every_causal_pair_is_local("flex")


def test_future_keys_never_change_earlier_outputs():
    """Future keys, values, memberships and padding perturbed (a property)."""
    grids.test_future_keys_never_change_earlier_outputs(backend="flex", memberships=True)


# --------------------------------------------------------------------------------------
# numerics: empty parts, log-sum-exp gaps, NaN, padding
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("nq_mode", ["prefill", "decode", "chunk"])
@pytest.mark.parametrize("kind", numerics.EMPTY_PART_KINDS)
def test_empty_parts_equal_local_attention(kind, nq_mode, padding):
    numerics.test_empty_parts_equal_local_attention(kind, nq_mode, padding, "flex")


def test_fully_padded_rows_output_zero_and_lse_minus_inf():
    numerics.test_fully_padded_rows_output_zero_and_lse_minus_inf("flex")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gap", [100.0, 1000.0])
@pytest.mark.parametrize("nq", [3, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dominant", ["group", "local"])
def test_a_huge_log_sum_exp_gap_between_the_parts_is_merged_exactly(
    dominant, top_k, nq, gap, dtype
):
    numerics.test_a_huge_log_sum_exp_gap_between_the_parts_is_merged_exactly(
        dominant, top_k, nq, gap, dtype, "flex"
    )


@pytest.mark.parametrize("scale", [5.0, 20.0])
def test_large_logits_are_merged_as_accurately_as_dense_fp32(scale):
    numerics.test_large_logits_are_merged_as_accurately_as_dense_fp32(scale, "flex")


@pytest.mark.parametrize("side", ["left", "right"])
def test_half_precision_with_padding_forward(side, half_dtype):
    numerics.test_half_precision_with_padding_forward(side, half_dtype, "flex")


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_slots_with_extreme_values_change_nothing(side, half_dtype):
    numerics.test_padding_slots_with_extreme_values_change_nothing(side, half_dtype, "flex")


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("where", ["query", "key"])
def test_nan_inputs_are_propagated_not_hidden(where, return_lse):
    numerics.test_nan_inputs_are_propagated_not_hidden("flex", where, return_lse)


# --------------------------------------------------------------------------------------
# the block masks say exactly what the mask_mods say (what compiled kernels rely on)
# --------------------------------------------------------------------------------------


def _blocks_dense(num, idx, n_kv_blocks: int) -> torch.Tensor:
    """bool ``[B, H, nQ, nK]`` of the blocks listed by ``(num, idx)``."""
    b, h, nq = num.shape
    out = torch.zeros(b, h, nq, n_kv_blocks + 1, dtype=torch.bool)  # + a column for unlisted
    listed = torch.arange(idx.shape[-1]) < num[..., None].long()
    out.scatter_(-1, torch.where(listed, idx.long(), n_kv_blocks), True)
    return out[..., :n_kv_blocks]


def _check_block_mask(block_mask) -> None:
    """Kept blocks cover every visible pair and full blocks hold visible pairs only."""
    from torch.nn.attention.flex_attention import create_mask

    q_len, kv_len = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    nkb = -(-kv_len // bk)
    batch = block_mask.kv_num_blocks.shape[0]
    partial = _blocks_dense(block_mask.kv_num_blocks, block_mask.kv_indices, nkb)
    full = torch.zeros_like(partial)
    if block_mask.full_kv_num_blocks is not None:
        full = _blocks_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nkb)
    assert not (partial & full).any(), "a block listed as both partial and full"
    dense = create_mask(block_mask.mask_mod, batch, 1, q_len, kv_len, device="cpu")[:, 0]

    def expand(blocks):  # [B, nQ, nK] -> [B, Lq, Lk]
        e = blocks[:, 0].repeat_interleave(bq, dim=1).repeat_interleave(bk, dim=2)
        return e[:, :q_len, :kv_len]

    kept = expand(partial | full)
    assert not (dense & ~kept).any(), "a visible pair in a block the kernel skips"
    assert dense[expand(full)].all(), "a masked pair in a full block"


class _Recorder:
    """Wraps ``flex.flex_attention`` to collect every block mask a call uses."""

    def __init__(self, monkeypatch) -> None:
        self.masks: list = []
        real = flex.flex_attention

        def spy(*args, block_mask=None, **kwargs):
            self.masks.append(block_mask)
            return real(*args, block_mask=block_mask, **kwargs)

        monkeypatch.setattr(flex, "flex_attention", spy)


BLOCK_GRID = [
    p
    for p in grids.GRID
    if p.id.startswith(("chunk", "topk", "many", "indep"))
    or p.id in {"decode-nk257", "pad-random", "pad-left-chunk", "pad-right-decode", "mqa"}
    or p.id in {"random-memberships", "empty-groups", "K8-topk8", "window1", "window151"}
]


@pytest.mark.parametrize("params", BLOCK_GRID)
def test_block_masks_agree_with_the_mask_mods(params, monkeypatch):
    """Blocks of 8 rows (the eager result does not depend on them: GRID checks it)."""
    monkeypatch.setattr(flex, "FLEX_BLOCK", 8)
    recorder = _Recorder(monkeypatch)
    make_case(**params).sparse("flex")
    assert len(recorder.masks) in (1, 2)  # the local part, and the group part if any
    for mask in recorder.masks:
        assert mask.BLOCK_SIZE == (8, 8)
        _check_block_mask(mask)


def test_full_blocks_exist_and_blocks_are_skipped(monkeypatch):
    """The group part's block mask is sparse: blocks across groups and above the causal
    staircase are skipped, and blocks of one group below it are full (no mask_mod)."""
    monkeypatch.setattr(flex, "FLEX_BLOCK", 8)
    recorder = _Recorder(monkeypatch)
    case = make_case(nk=256, groups=4, top_k=1, window=8, seed=3)
    case.sparse("flex")
    local, group = recorder.masks
    total = group.kv_num_blocks.shape[-1] * -(-group.seq_lengths[1] // 8)
    kept = int(group.kv_num_blocks.sum() + group.full_kv_num_blocks.sum())
    assert int(group.full_kv_num_blocks.sum()) > 0
    assert kept < 0.4 * total  # about 1/K of the causal half, plus the group edges
    band = int(local.kv_num_blocks.sum())
    assert band <= 2 * local.kv_num_blocks.shape[-1]  # window 8 = one block: <= 2 per row


@given(params=case_params(max_nk=60, long_nk=200), block=st.sampled_from([2, 8, 32]))
@HYP_SMALL
def test_property_block_masks_agree_with_the_mask_mods(params, block):
    before = flex.FLEX_BLOCK
    masks: list = []
    real = flex.flex_attention

    def spy(*args, block_mask=None, **kwargs):
        masks.append(block_mask)
        return real(*args, block_mask=block_mask, **kwargs)

    try:
        flex.FLEX_BLOCK, flex.flex_attention = block, spy
        case = make_case(**params)
        out, lse = case.sparse("flex", return_lse=True)
    finally:
        flex.FLEX_BLOCK, flex.flex_attention = before, real
    assert_matches_oracle(case, out, lse)
    for mask in masks:
        _check_block_mask(mask)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        pytest.param(dict(nk=1200, groups=2, top_k=1, window=64, padding="left"), id="top1"),
        pytest.param(
            dict(
                nk=600, nq=450, groups=5, top_k=2, window=40, padding="random", membership="random"
            ),
            id="top2-chunk",
        ),  # fmt: skip
    ],
)
def test_compiled_cpu_kernels_use_the_block_masks_as_eager_does(params, inductor, monkeypatch):
    """Compiled FlexAttention on CPU (block-sparse kernels; no log-sum-exp there) gives
    each part's eager output with the backend's block masks, full blocks included."""
    import torch._inductor.config
    from torch.nn.attention.flex_attention import flex_attention

    calls = []
    real = flex.flex_attention

    def spy(q, k, v, block_mask=None, **kwargs):
        calls.append((q, k, v, block_mask, kwargs))
        return real(q, k, v, block_mask=block_mask, **kwargs)

    monkeypatch.setattr(flex, "flex_attention", spy)
    make_case(batch=2, heads=2, kv_heads=1, seed=1, **params).sparse("flex")
    assert len(calls) == 2
    with torch._inductor.config.patch(compile_threads=1):
        compiled = torch.compile(flex_attention, dynamic=False)
        for q, k, v, mask, kwargs in calls:
            kwargs = {key: val for key, val in kwargs.items() if key != "return_aux"}
            eager = flex_attention(q, k, v, block_mask=mask, **kwargs)
            assert (compiled(q, k, v, block_mask=mask, **kwargs) - eager).abs().max() <= 1e-5
    if params["top_k"] == 1:
        assert int(calls[1][3].full_kv_num_blocks.sum()) > 0  # full blocks were exercised


def test_a_pair_sharing_several_groups_is_counted_once():
    """Every token in the same 3 of 4 groups: the group part must see each earlier key
    once (dense causal attention), not three times."""
    groups = torch.zeros(1, 50, 4, dtype=torch.bool)
    groups[..., :3] = True
    case = make_case(nk=50, heads=2, window=2, seed=4)
    case.qg, case.kg = groups, groups
    out, lse = case.sparse("flex", return_lse=True)
    assert_matches_oracle(case, out, lse)
    dense, dense_lse = grids.naive_attention(case.q, case.k, case.v, case.mask())
    assert (lse.double() - dense_lse).abs().max() <= 1e-4  # log 3 away if counted thrice
    assert math.isfinite(lse.max().item())


def test_membership_codes_share_exactly_when_rows_share_a_group():
    g = torch.Generator().manual_seed(0)
    for k in (1, 5, 62, 63, 130):
        a = torch.rand(40, k, generator=g) < 0.05
        b = torch.rand(40, k, generator=g) < 0.05
        ca, cb = flex.membership_codes(a), flex.membership_codes(b)
        assert len(ca) == -(-k // flex.CODE_BITS)
        share = torch.zeros(40, 40, dtype=torch.bool)
        for wa, wb in zip(ca, cb, strict=True):
            share |= (wa[:, None] & wb[None, :]) != 0
        want = (a.float() @ b.float().t()) > 0
        assert torch.equal(share, want), k


# --------------------------------------------------------------------------------------
# on a GPU: compiled kernels with log-sum-exp, gradients
# --------------------------------------------------------------------------------------

CUDA_GRID = [
    p
    for p in grids.GRID
    if p.id.startswith(("prefill-n1", "decode", "chunk", "topk", "pad-", "many", "indep"))
    or p.id in {"K1", "K8-topk8", "random-memberships", "no-memberships", "empty-groups", "mqa"}
]


def _cuda(case):
    return [t.cuda() if t is not None else None for t in (case.q, case.k, case.v, case.qg,
            case.kg, case.kpm)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("params", CUDA_GRID)
def test_cuda_compiled_flex_equals_oracle(params, dtype):
    """Compiled FlexAttention with log-sum-exp (block-sparse kernels) on the grid; "auto"
    gives bitwise the backend its resolver names for the call (flex, or gather for a call
    of at most 8 queries), and that backend matches the oracle too."""
    case = make_case(**params).to(dtype)
    q, k, v, qg, kg, kpm = _cuda(case)
    out, lse = sparse_attention(
        q, k, v, qg, kg, case.window, key_padding_mask=kpm, backend="flex", return_lse=True
    )
    assert out.device.type == "cuda"
    assert_matches_oracle(case, out.cpu(), lse.cpu())
    request = SparseRequest(q.device, q.dtype, False, qg.shape[-1], num_queries=qg.shape[1])
    chosen = resolve_backend("auto", request).name
    assert chosen == ("gather" if qg.shape[1] <= 8 else "flex")
    want, want_lse = sparse_attention(q, k, v, qg, kg, case.window, key_padding_mask=kpm,
                                      backend=chosen, return_lse=True)  # fmt: skip
    assert_matches_oracle(case, want.cpu(), want_lse.cpu())
    auto = sparse_attention(q, k, v, qg, kg, case.window, key_padding_mask=kpm)
    torch.testing.assert_close(auto, want, **tolerance("bitwise"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("params", grids.GRAD_CASES)
def test_cuda_flex_gradients_equal_math_gradients(params):
    """Backward through both compiled parts and the log-sum-exp merge: within 1e-4 of the
    math backend's gradients (fp32)."""
    case = make_case(**params)
    tensors = [t.cuda() for t in (case.q, case.k, case.v)]
    qg, kg = case.qg.cuda(), case.kg.cuda()
    kpm = None if case.kpm is None else case.kpm.cuda()
    cot = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(1)).cuda()

    def grads(backend):
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        out = sparse_attention(*leaves, qg, kg, case.window, key_padding_mask=kpm, backend=backend)
        return out, torch.autograd.grad((out * cot).sum(), leaves)

    out, got = grads("flex")
    ref, want = grads("math")
    assert (out - ref).abs().max() <= 1e-5
    for name, a, b in zip("qkv", got, want, strict=True):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        err = (a - b).abs().max().item()
        assert err <= 1e-4, f"d{name} differs from math by {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_long_sequence_top1_and_top2():
    """4,096 tokens, K = 8, window 128: compiled flex against the math backend."""
    for top_k in (1, 2):
        case = make_case(nk=4096, heads=4, kv_heads=2, dim=64, groups=8, top_k=top_k,
                         window=128, seed=top_k)  # fmt: skip
        q, k, v, qg, kg, _ = _cuda(case)
        out = sparse_attention(q, k, v, qg, kg, 128, backend="flex")
        ref = sparse_attention(q, k, v, qg, kg, 128, backend="math")
        assert (out - ref).abs().max() <= 1e-5, top_k


# --------------------------------------------------------------------------------------
# the soft gate (training path) as a score_mod: gated_attention(backend="flex")
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["paper", "log"])
@given(p=gates_tests.gate_params())
@HYP_SMALL
def test_flex_gate_equals_direct_float64_implementation(gate, p):
    q, k, v, gq, gk, kpm, sinks = gates_tests._build(p)
    kw = dict(gate=gate, sharpness=p["sharpness"], softcap=p["softcap"], always_visible=sinks)
    out = gated_attention(q, k, v, gq, gk, p["window"], key_padding_mask=kpm, backend="flex", **kw)
    ref = gates_tests.eq2_reference(q, k, v, gq, gk, p["window"], kpm=kpm, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= 1e-5, f"{gate} gate differs from the float64 implementation by {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["paper", "log"])
def test_flex_gate_in_half_precision_within_twice_the_dense_error(gate, dtype):
    """Against the float64 gate on the same half-precision values: at most twice the error
    of the dense backend in that dtype (at least half an ulp of the output)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4 if i == 0 else 2, 90, 16, generator=g) for i in range(3))
    probs = torch.softmax(torch.randn(2, 90, 5, generator=g) * 3, dim=-1)
    kpm = padding_mask_rows(g)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    args = (q, k, v, probs, probs, 8)
    ref = gates_tests.eq2_reference(*args, gate=gate, kpm=kpm)
    dense = gated_attention(*args, gate=gate, key_padding_mask=kpm)
    out = gated_attention(*args, gate=gate, key_padding_mask=kpm, backend="flex")
    assert out.dtype == dtype and torch.isfinite(out).all()
    bound = low_precision_bound((dense.double() - ref).abs().max().item(), ref, dtype)
    assert (out.double() - ref).abs().max().item() <= bound


def padding_mask_rows(g: torch.Generator) -> torch.Tensor:
    """Left padding of 30 tokens on the first row (fully padded query rows), none on the
    second."""
    kpm = torch.ones(2, 90, dtype=torch.bool)
    kpm[0, :30] = False
    return kpm


def test_flex_gate_fully_padded_rows_are_zero():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=g) for _ in range(3))
    probs = torch.softmax(torch.randn(2, 40, 3, generator=g), dim=-1)
    kpm = torch.ones(2, 40, dtype=torch.bool)
    kpm[0] = False
    kpm[1, :10] = False
    out = gated_attention(q, k, v, probs, probs, 4, key_padding_mask=kpm, backend="flex")
    assert (out[0] == 0).all() and (out[1, :, :10] == 0).all()
    assert (out[1, :, 10:].abs().sum(-1) > 0).all()


def test_flex_gate_refuses_gradients_on_cpu_and_unknown_backends():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    probs = torch.softmax(torch.randn(1, 20, 3, generator=g), dim=-1).requires_grad_(True)
    with pytest.raises(ValueError, match="backend.*require grad on CPU.*'dense'"):
        gated_attention(q, k, v, probs, probs, 4, backend="flex")
    with pytest.raises(ValueError, match="backend.*'sparse'.*dense"):
        gated_attention(q, k, v, probs, probs, 4, backend="sparse")
    with torch.no_grad():  # no gradient wanted: it runs
        out = gated_attention(q, k, v, probs, probs, 4, backend="flex")
    torch.testing.assert_close(out, gated_attention(q, k, v, probs.detach(), probs.detach(), 4))


@pytest.mark.parametrize("nq", [50, 17, 1])
@pytest.mark.parametrize("padding", [None, "random", "left"])
def test_causal_block_mask_agrees_with_its_mask_mod(nq, padding, monkeypatch):
    monkeypatch.setattr(flex, "FLEX_BLOCK", 8)
    kpm = padding_mask(gen(nq), 2, 50, padding, None if padding != "left" else [50, 13])
    mask = flex.causal_block_mask(nq, 50, kpm, "cpu")
    _check_block_mask(mask)
    assert int(mask.full_kv_num_blocks.sum()) > 0 or nq == 1 or padding == "random"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("gate", ["paper", "log"])
def test_cuda_flex_gate_gradients_equal_dense_gradients(gate, softcap):
    """Gradients of q, k, v and of the routing rows through the score_mod, against the
    dense gate, to 1e-4 (fp32), with padding, sinks and GQA."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 300, 32, generator=g)
    k, v = (torch.randn(2, 2, 300, 32, generator=g) for _ in range(2))
    logits = torch.randn(2, 300, 8, generator=g) * 3
    kpm = torch.ones(2, 300, dtype=torch.bool)
    kpm[0, :70] = False  # left padding on the first row
    sinks = torch.zeros(2, 300, dtype=torch.bool)
    sinks[:, :4] = True
    cot = torch.randn(q.shape, generator=g).cuda()
    fixed = dict(
        gate=gate, softcap=softcap, key_padding_mask=kpm.cuda(), always_visible=sinks.cuda()
    )

    def run(backend):
        leaves = [t.cuda().requires_grad_(True) for t in (q, k, v, logits)]
        probs = torch.softmax(leaves[3], dim=-1)
        out = gated_attention(*leaves[:3], probs, probs, 16, backend=backend, **fixed)
        return out, torch.autograd.grad((out * cot).sum(), leaves)

    out, got = run("flex")
    ref, want = run("dense")
    assert (out - ref).abs().max() <= 1e-5
    for name, a, b in zip(("q", "k", "v", "routing"), got, want, strict=True):
        err = (a - b).abs().max().item()
        assert err <= 1e-4, f"d{name} differs from the dense gate by {err:.3g}"
