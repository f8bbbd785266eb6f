"""The fused CPU kernel's build and threading (its exactness is in test_sparse_attention)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from focus_attention.ops import fused_kernel_available
from focus_attention.ops.sparse import extension
from focus_attention.utils.io import file_lock

from .helpers import assert_matches_oracle, make_case

pytestmark = pytest.mark.skipif(
    os.environ.get("FOCUS_NO_EXTENSION", "") not in ("", "0"), reason="FOCUS_NO_EXTENSION set"
)


def test_the_kernel_builds_here(kernel_built):
    """CI machines have a compiler: a silent fall back to cpu_flash would hide a broken build."""
    assert kernel_built and fused_kernel_available(), extension.unavailable_reason()


def test_the_kernel_source_ships_with_the_package():
    """pyproject's package-data must name the source's place in the package."""
    assert extension.SOURCE.is_file()
    assert extension.SOURCE.parent.parent.name == "sparse"


@pytest.mark.parametrize("top_k", [1, 2])
def test_threads_give_identical_results(top_k, fused_kernel):
    """Work items are pulled by every thread in any order; each writes its own rows, so
    the result is bitwise the same with 1 or 2 threads (and equals the oracle)."""
    case = make_case(
        batch=2,
        nk=700,
        nq=650,
        heads=6,
        kv_heads=2,
        groups=5,
        top_k=top_k,
        window=9,
        padding="random",
        seed=11,
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.sparse("cpu_fused", return_lse=True)
        torch.set_num_threads(2)
        two = case.sparse("cpu_fused", return_lse=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert_matches_oracle(case, *two)


@pytest.mark.slow
def test_a_stale_build_lock_does_not_hang(fused_kernel):
    """An interrupted build leaves torch's "lock" file behind; loading must not wait on it."""
    build = extension.build_directory()
    lock = build / "lock"
    with file_lock(build / ".focus-build.lock"):  # never while another process builds
        lock.write_text("")
    code = "from focus_attention.ops import fused_kernel_available as f; print(f())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=240
        )
    finally:
        lock.unlink(missing_ok=True)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


@pytest.mark.slow
def test_a_failed_build_says_why_and_where_from_the_callers_line(tmp_path):
    """A build that fails (here: no compiler) warns once, from the user's line, with the
    first error and the path of the full log; the op still answers through cpu_flash."""
    script = """
import warnings, torch
from focus_attention.ops import sparse_attention
q = k = v = torch.randn(1, 1, 8, 4)
g = torch.ones(1, 8, 2, dtype=torch.bool)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sparse_attention(q, k, v, g, g, 2)
assert len(caught) == 1 and caught[0].category is RuntimeWarning, caught
print(caught[0].filename)
print(caught[0].message)
"""
    env = dict(os.environ, FOCUS_HOME=str(tmp_path), CXX="/nonexistent/c++")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    filename, message = done.stdout.strip().split("\n", 1)
    assert filename == "<string>"  # the caller's code, not torch's or ours
    assert "build-error.log" in message
    logs = list(tmp_path.glob("extensions/*/build-error.log"))
    assert logs and "nonexistent" in logs[0].read_text()
