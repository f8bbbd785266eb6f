"""How ``sparse_attention`` picks a backend (docs/method.md §5, "Backends"): the registry,
``"auto"``'s order, what each backend refuses and why, the fused kernel's fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

import pytest
import torch

from focus_attention.ops import (
    BACKENDS,
    BackendUnavailable,
    SparseBackend,
    SparseRequest,
    backend_names,
    dense_attention,
    focus_mask,
    register_backend,
    resolve_backend,
    sparse_attention,
)
from focus_attention.ops.names import SPARSE_BACKENDS
from focus_attention.ops.sparse import Backend, cpu_fused, dispatch

from .helpers import assert_matches_oracle, make_case

CPU = torch.device("cpu")


def _request(**kw) -> SparseRequest:
    base = dict(device=CPU, dtype=torch.float32, needs_grad=False, num_groups=4, num_queries=512)
    return SparseRequest(**{**base, **kw})


def _spy_fused(monkeypatch) -> list[bool]:
    """Record each launch of the fused kernel."""
    calls: list[bool] = []
    real = cpu_fused.launch_kernel

    def spy(*args, **kwargs):
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_fused, "launch_kernel", spy)
    return calls


def test_backends_are_listed_in_autos_order():
    """The built-in backends in the order "auto" tries them (docs/method.md §5): stated
    here once; every other list of names is the registry's (see the next test)."""
    intended = ("triton", "gather", "masked", "cpu_fused", "cpu_flash", "flex", "math")
    assert backend_names() == intended


def test_every_list_of_backend_names_is_the_registry():
    """The torch-free names (settings, command-line choices), the ``Backend`` type and the
    package's ``BACKENDS`` are ``"auto"`` then the registry's names, in its order."""
    names = ("auto", *backend_names())
    assert names == SPARSE_BACKENDS
    assert typing.get_args(Backend) == names
    assert names == BACKENDS


@pytest.mark.parametrize(
    "request_kw,expected",
    [
        pytest.param({}, "cpu_fused", id="cpu-fp32"),
        pytest.param(dict(dtype=torch.bfloat16), "cpu_fused", id="cpu-bf16"),
        pytest.param(dict(num_groups=65), "cpu_flash", id="65-groups"),
        pytest.param(dict(needs_grad=True), "math", id="grad"),
        pytest.param(dict(softcap=True), "math", id="softcap"),
        pytest.param(dict(dtype=torch.float64), "math", id="float64"),
        pytest.param(dict(device=torch.device("meta")), "math", id="other-device"),
    ],
)
def test_auto_takes_the_first_backend_that_can_run(request_kw, expected, fused_kernel):
    assert resolve_backend("auto", _request(**request_kw)).name == expected


@pytest.mark.parametrize(
    "name,request_kw,words",
    [
        ("cpu_fused", dict(num_groups=70), ("K <= 64", "70")),
        ("cpu_fused", dict(dtype=torch.float64), ("float64",)),
        ("cpu_flash", dict(needs_grad=True), ("require grad",)),
        ("cpu_flash", dict(softcap=True), ("softcap",)),
        ("cpu_flash", dict(device=torch.device("meta")), ("cpu", "meta")),
    ],
)
def test_a_backend_that_cannot_run_says_which_and_why(name, request_kw, words):
    with pytest.raises(BackendUnavailable) as info:
        resolve_backend(name, _request(**request_kw))
    msg = str(info.value)
    assert msg.startswith("backend:") and repr(name) in msg and "expected" in msg
    for word in words:
        assert word in msg, msg


def test_auto_with_no_capable_backend_gives_every_reason(monkeypatch):
    monkeypatch.delitem(dispatch._REGISTRY, "math")
    with pytest.raises(BackendUnavailable) as info:
        resolve_backend("auto", _request(needs_grad=True))
    msg = str(info.value)
    assert "'auto'" in msg and "'cpu_fused'" in msg and "'cpu_flash'" in msg
    assert msg.count("require grad") == 2


def test_unknown_backend_names_the_registered_ones():
    with pytest.raises(BackendUnavailable, match="cpu_flash.*flex"):
        resolve_backend("cuda_kernels", _request())


def test_backend_errors_are_value_errors_of_their_own_type():
    """Callers catch a backend's refusal by type (a Focus layer names its setting then),
    and bad arguments stay plain ValueErrors."""
    assert issubclass(BackendUnavailable, ValueError)
    q = torch.randn(1, 2, 3, 4)
    groups = torch.ones(1, 3, 2, dtype=torch.bool)
    with pytest.raises(BackendUnavailable, match="cuda_kernels"):
        sparse_attention(q, q, q, groups, groups, 2, backend="cuda_kernels")
    with pytest.raises(BackendUnavailable, match="inference only"):
        sparse_attention(q.requires_grad_(), q, q, groups, groups, 2, backend="masked")
    with pytest.raises(ValueError) as info:
        sparse_attention(q, q, q, groups, groups, 0, backend="masked")
    assert not isinstance(info.value, BackendUnavailable)


def test_a_new_backend_is_registered_by_one_call(monkeypatch, kernel_built):
    """A new backend (here: CPU float64 only, ahead of the built-in ones) is picked by
    "auto" where it can run and skipped, with its reason, where it cannot; names are
    unique."""
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    ran = []

    def run(inputs):
        ran.append(inputs.query.dtype)
        return dispatch.run_backend("math", inputs)

    backend = SparseBackend(
        name="fp64_test", run=run, priority=5, devices=("cpu",), dtypes=(torch.float64,)
    )
    register_backend(backend)
    assert backend_names()[0] == "fp64_test"
    assert resolve_backend("auto", _request(dtype=torch.float64)).name == "fp64_test"
    assert resolve_backend("auto", _request()).name != "fp64_test"
    with pytest.raises(ValueError, match="fp64_test.*float32"):
        resolve_backend("fp64_test", _request())
    with pytest.raises(ValueError, match="fp64_test"):
        register_backend(SparseBackend(name="fp64_test", run=run, priority=6))
    with pytest.raises(ValueError, match="auto"):
        register_backend(SparseBackend(name="auto", run=run, priority=6))
    case = make_case(nk=30, top_k=2, seed=3)
    q, k, v = (t.double() for t in (case.q, case.k, case.v))
    out = sparse_attention(q, k, v, case.qg, case.kg, 4)
    assert ran == [torch.float64]
    ref, _ = dense_attention(q, k, v, focus_mask(case.qg, case.kg, 4))
    torch.testing.assert_close(out, ref)


def test_the_benchmark_reports_the_resolvers_choice(fused_kernel):
    from focus_attention.bench.kernel import sparse_backend_name

    assert sparse_backend_name("auto") == "cpu_fused"
    assert sparse_backend_name("auto", 70) == "cpu_flash"
    assert sparse_backend_name("math") == "math"
    with pytest.raises(ValueError, match="cpu_fused"):
        sparse_backend_name("cpu_fused", 70)


# --------------------------------------------------------------------------------------
# cpu_fused: when "auto" uses it, its fallback, and running without it
# --------------------------------------------------------------------------------------


def test_auto_uses_the_fused_kernel_on_cpu(monkeypatch, fused_kernel):
    calls = _spy_fused(monkeypatch)
    case = make_case(nk=80, top_k=2, groups=4, padding="random", seed=8)
    out, lse = case.sparse("auto", return_lse=True)
    assert calls == [True]
    assert_matches_oracle(case, out, lse)


def test_many_small_classes_still_use_the_fused_kernel(monkeypatch, fused_kernel):
    """Every query in a class of its own (K = 16, top_k = 4 on 60 tokens): "auto" keeps
    cpu_fused (it was measured 1.4-16x faster than cpu_flash even then) and stays exact."""
    calls = _spy_fused(monkeypatch)
    case = make_case(nk=70, nq=60, groups=16, top_k=4, window=5, padding="random", seed=9)
    out, lse = case.sparse("auto", return_lse=True)
    assert len(calls) == 1
    assert_matches_oracle(case, out, lse)


def test_more_than_64_groups_are_refused_by_cpu_fused_and_auto_uses_cpu_flash(monkeypatch):
    """The kernel's membership codes hold 64 groups: more is refused explicitly and "auto"
    uses cpu_flash (exact)."""
    calls = _spy_fused(monkeypatch)
    case = make_case(nk=40, groups=70, top_k=3, seed=10)
    with pytest.raises(ValueError, match="K <= 64"):
        case.sparse("cpu_fused")
    out, lse = case.sparse("auto", return_lse=True)
    assert calls == []
    assert_matches_oracle(case, out, lse)


def test_float64_is_refused_by_cpu_fused_and_auto_computes_it_in_float64():
    case = make_case(nk=20, seed=15)
    q, k, v = (t.double() for t in (case.q, case.k, case.v))
    with pytest.raises(ValueError, match="float64"):
        sparse_attention(q, k, v, case.qg, case.kg, 4, backend="cpu_fused")
    out = sparse_attention(q, k, v, case.qg, case.kg, 4)  # auto: math, in float64
    assert out.dtype == torch.float64


@pytest.mark.slow
def test_without_the_extension_auto_falls_back_and_cpu_fused_refuses():
    """FOCUS_NO_EXTENSION=1 (or a failed build): one RuntimeWarning, exact results from
    cpu_flash, and a ValueError that names cpu_fused and the reason for an explicit
    cpu_fused."""
    script = """
import warnings, torch
from focus_attention.ops import sparse_attention, dense_attention, focus_mask
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 30, 8, generator=g) for _ in range(3))
groups = torch.rand(1, 30, 3, generator=g) > 0.5
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = sparse_attention(q, k, v, groups, groups, 4)
    sparse_attention(q, k, v, groups, groups, 4)
assert [w.category for w in caught] == [RuntimeWarning], caught
assert "FOCUS_NO_EXTENSION" in str(caught[0].message)
ref, _ = dense_attention(q, k, v, focus_mask(groups, groups, 4))
assert (out - ref).abs().max() < 1e-5
try:
    sparse_attention(q, k, v, groups, groups, 4, backend="cpu_fused")
except ValueError as err:
    assert "FOCUS_NO_EXTENSION" in str(err) and "'cpu_fused'" in str(err), err
else:
    raise AssertionError("cpu_fused ran without the extension")
print("ok")
"""
    env = dict(os.environ, FOCUS_NO_EXTENSION="1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_cpu_kernels_refuse_inputs_that_require_grad():
    case = make_case(nk=30, seed=16)
    q = case.q.clone().requires_grad_(True)
    for backend in ("cpu_fused", "cpu_flash"):
        with pytest.raises(ValueError, match="require grad"):
            sparse_attention(q, case.k, case.v, case.qg, case.kg, 4, backend=backend)
    with torch.no_grad():  # no gradient wanted: they run
        out = sparse_attention(q, case.k, case.v, case.qg, case.kg, 4, backend="cpu_flash")
    mask = focus_mask(case.qg, case.kg, 4)
    torch.testing.assert_close(out, dense_attention(case.q, case.k, case.v, mask)[0])


def test_triton_runs_by_name_on_the_cpu_only_under_the_interpreter(monkeypatch):
    """On CPU tensors the ``triton`` backend runs under Triton's interpreter (the tests set
    ``TRITON_INTERPRET=1``) and only when named: ``"auto"`` chooses it on CUDA only; without
    the interpreter it refuses, saying where it runs."""
    request = _request()
    assert resolve_backend("triton", request).name == "triton"
    assert resolve_backend("auto", request).name != "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="runs on CUDA tensors .*TRITON_INTERPRET=1"):
        resolve_backend("triton", request)
