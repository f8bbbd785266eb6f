"""Every backend on the layouts real models hand the op (tests/ops/layouts.py: splits of a
fused projection, transposes, cache slices, expanded heads and batch rows, one query, a
last dimension that is not contiguous), forward and, where the backend is differentiable
here, backward, against the float64 oracle.

Each (layout, backend, direction) runs in a child process forked from a clean server
process (``multiprocessing``'s forkserver, which has imported torch and the package once and
never ran an operator): a kernel that writes past its buffers aborts the child ("double
free", SIGSEGV) and fails its test, instead of taking the session down or corrupting memory
that a later test reads. The Triton kernels run under Triton's interpreter on the CPU
(small shapes), and compiled on a CUDA device in :func:`test_layouts_on_gpu`."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import traceback

import pytest
import torch

from focus_attention.ops import backend_names
from focus_attention.ops.sparse import dispatch
from focus_attention.ops.sparse.dispatch import SparseRequest
from focus_attention.ops.sparse.triton_support import triton_reason

from .layouts import LAYOUTS, check_every_layout, check_layout

#: seconds a child may take (the interpreter runs the Triton backward in a few seconds)
CHILD_TIMEOUT = 600
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "focus_attention.ops.sparse", "ops.layouts"])


def _child(connection, function, args) -> None:
    """Run ``function(*args)`` and send back its result, or the traceback of its error."""
    try:
        connection.send(("rows", function(*args)))
    except BaseException:  # reported to the parent, which fails the test with it
        connection.send(("error", traceback.format_exc()))
    connection.close()


def run_in_child(*args, function=check_layout) -> list[tuple]:
    """``function(*args)`` (:func:`check_layout`) in a child process; fails the test,
    naming the signal, when the child dies (a memory error) or does not answer in time."""
    receive, send = _CONTEXT.Pipe(duplex=False)
    child = _CONTEXT.Process(target=_child, args=(send, function, args), daemon=True)
    child.start()
    send.close()
    message = None
    answered = receive.poll(CHILD_TIMEOUT)  # also True when the child died (end of file)
    if answered:
        with contextlib.suppress(EOFError):  # it died before answering
            message = receive.recv()
    child.join(10 if answered else 0)
    if child.is_alive():
        child.kill()
        child.join()
    code = child.exitcode
    if message is None:
        died = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit {code}"
        pytest.fail(f"{args}: the child process died ({died}) or timed out: a memory error?")
    kind, payload = message
    if kind == "error":
        pytest.fail(f"{args} raised in the child:\n{payload}")
    return payload


def _differentiable_on_cpu(name: str) -> bool:
    """Whether backend ``name`` declares gradients on CPU float32 inputs (its own check
    included, e.g. FlexAttention's CPU refusal)."""
    backend = dispatch._REGISTRY[name]
    if not backend.differentiable:
        return False
    request = SparseRequest(torch.device("cpu"), torch.float32, True, 4, False, 1)
    return backend.why_not(request) is None


def _grid() -> list:
    rows = []
    for layout in LAYOUTS:
        for backend in backend_names():
            directions = ("forward", "backward") if _differentiable_on_cpu(backend) else ("forward",)  # fmt: skip
            for direction in directions:
                rows.append(pytest.param(layout, backend, direction,
                                         id=f"{layout}-{backend}-{direction}"))  # fmt: skip
    return rows


@pytest.mark.parametrize(("layout", "backend", "direction"), _grid())
def test_layout_matches_the_oracle(layout, backend, direction, request):
    if backend == "cpu_fused":
        request.getfixturevalue("fused_kernel")  # built once, in the session
    if backend == "triton" and triton_reason(torch.device("cpu")) is not None:
        pytest.skip(f"triton on CPU: {triton_reason(torch.device('cpu'))}")
    for what, err, bound in run_in_child(layout, backend, direction):
        assert err <= bound, f"{layout} on {backend} ({direction}): {what} error {err:.3g} > {bound:.3g}"  # fmt: skip


def test_a_dying_child_fails_the_test_naming_the_signal():
    """The runner turns a child killed by a signal into a test failure (not a hang)."""
    with pytest.raises(pytest.fail.Exception, match="SIGABRT"):
        run_in_child("transposed", "math", "forward", function=_abort)


def _abort(*args):
    os.abort()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layouts_on_gpu():
    """The compiled kernels, and every backend that runs on CUDA, on each layout, forward
    and backward where differentiable (one child process for the whole grid: a memory error
    there surfaces as a CUDA error or a dead child, failing this test)."""
    backends = ("triton", "flex", "gather", "masked", "math")
    differentiable = tuple(b for b in backends if dispatch._REGISTRY[b].differentiable)
    rows = run_in_child("cuda", backends, differentiable, function=check_every_layout)
    failures = [f"{layout} on {backend} ({direction}): {what} error {err:.3g} > {bound:.3g}"
                for layout, backend, direction, what, err, bound in rows if not err <= bound]  # fmt: skip
    assert len(rows) > len(LAYOUTS) * len(backends) and failures == [], "\n".join(failures)
