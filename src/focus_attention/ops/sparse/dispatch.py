"""The backends of :func:`~focus_attention.ops.sparse_attention` and of
:func:`~focus_attention.ops.sparse.decode_attention`, and how one is chosen: the one dispatcher
of the op (docs/method.md §5, "Backends").

A backend is a :class:`SparseBackend`: a name, a function that runs the op, and what it
declares it can do (devices, dtypes, gradients, soft-capping, at most how many groups,
whether it decodes over a cache's :class:`~.buckets.GroupBuckets`, and an optional check of
its own, e.g. whether a kernel could be built). From these :meth:`SparseBackend.why_not`
says why it cannot run a call, or None. One call of :func:`register_backend` adds a backend
(a GPU backend, say); ``"auto"`` takes the first backend that can run the call in increasing
``priority``: ``triton`` (7, chosen by ``"auto"`` on CUDA: this package's Triton kernels),
``gather`` (8, chosen by ``"auto"`` on CUDA for decoding-sized calls), ``masked`` (9, chosen
by ``"auto"`` only to decode over group buckets where ``triton`` cannot), ``cpu_fused`` (10),
``cpu_flash`` (20), ``flex`` (50, chosen by ``"auto"`` on CUDA only), ``math`` (100). A
backend may restrict where ``"auto"`` chooses it (``auto_devices``, ``auto_check``) while
still running elsewhere when asked for by name. :func:`run_backend` is the only place a
backend runs.

A call is *decoding-sized* when it has at most :data:`MAX_DECODE_QUERIES` queries (a
decoding step, or a few speculative tokens): the one bound that the backends, the static
cache and the Focus layer use to tell decoding from a prompt.

The op itself is the custom operator ``torch.ops.focus_attention.sparse_attention``
(``torch.library.custom_op``): ``torch.compile`` sees one opaque call with a fake
implementation for shapes, and runs it eagerly, so compiled callers get bitwise the eager
result (an opaque op is never traced: inductor once compiled the op's Python body wrongly).
Tested: ``opcheck`` passes and ``torch.compile(fn, fullgraph=True)`` equals eager bitwise on
every backend (tests/ops/test_compile.py). The operator does not check its arguments
(:func:`~focus_attention.ops.sparse_attention` does), and on ``meta`` tensors the fake
implementation answers without running a backend.

Calls that need gradients do not go through the operator: a custom operator's
implementation runs below autograd, so a backend's autograd graph cannot be built inside it
(``torch.autograd.grad`` there fails: "element 0 of tensors does not require grad"), and a
hand-written backward would duplicate the decomposition. They run the backend in Python
under ``torch.compiler.disable`` (:func:`run_differentiable`): compiled callers graph-break
there and get the eager result and gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..checks import fail
from .buckets import GroupBuckets

__all__ = [
    "CPU_DTYPES",
    "MAX_DECODE_QUERIES",
    "BackendUnavailable",
    "SparseBackend",
    "SparseInputs",
    "SparseRequest",
    "backend_names",
    "check_backend_name",
    "decoding_sized",
    "fold_heads",
    "register_backend",
    "resolve_backend",
    "run_backend",
    "run_differentiable",
    "run_inference",
    "sparse_attention_op",
    "unfold_heads",
]

#: input dtypes of the built-in CPU kernels.
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: most queries of a decoding-sized call (a decoding step, or a few speculative tokens): the
#: one bound by which the backends, the static cache and the Focus layer tell decoding from
#: a prompt (the union of a few queries' visible keys stays far below every key).
MAX_DECODE_QUERIES = 8


def decoding_sized(num_queries: int) -> bool:
    """Whether a call of ``num_queries`` queries is decoding-sized (at most
    :data:`MAX_DECODE_QUERIES`)."""
    return num_queries <= MAX_DECODE_QUERIES


class BackendUnavailable(ValueError):
    """The backend asked for cannot run a call: not registered, or it declines the call (the
    message names it and gives the reason), or ``"auto"`` found none that can (every
    backend's reason). A ``ValueError``, so callers that catch bad arguments catch it."""


def _refuse(received: str, expected: str) -> None:
    """Raise :class:`BackendUnavailable` in the message format of the other argument checks."""
    raise BackendUnavailable(f"backend: received {received}, expected {expected}")


@dataclass(frozen=True)
class SparseRequest:
    """What a backend is told about a call to decide whether it can run it."""

    device: torch.device
    dtype: torch.dtype
    needs_grad: bool
    num_groups: int
    softcap: bool = False
    #: queries in the call (0: not said; backends that decide by shape then decline)
    num_queries: int = 0
    #: the keys' groups come as a cache's group buckets only (no key memberships): a
    #: decoding step over a static cache, which reads nothing back to the host
    over_buckets: bool = False


@dataclass(frozen=True)
class SparseInputs:
    """One validated call (docs/method.md §5): ``query [B, H, Nq, D]``, ``key``/``value``
    ``[B, H_kv, Nk, D]``, bool ``query_groups [B, Nq, K]``, ``key_groups [B, Nk, K]`` (or
    both per key-value head, ``[B, Nq, H_kv, K]`` and ``[B, Nk, H_kv, K]``: a backend
    without ``head_routing`` is given them folded, see :func:`fold_heads`),
    ``key_padding_mask [B, Nk]`` or None, ``1 <= window <= max(1, Nk)``, the logit
    ``scale``, the ``softcap`` or None, whether gradients are wanted, and whether the caller
    reads the log-sum-exp (when not, a backend may return None in its place).

    A call over a cache (:func:`~focus_attention.ops.sparse.decode_attention`) gives the keys'
    groups as the cache's ``buckets`` instead (``key_groups`` None; ``key``/``value`` then
    ``[B, H_kv, C, D]`` of capacity ``C``) with ``key_lengths`` int ``[B]``, the keys cached
    per row; a backend that decodes over buckets may also be given both, and then reads the
    buckets (``(B, H_kv, K, C)`` with per-head query memberships)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_groups: torch.Tensor
    key_groups: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    window: int
    scale: float
    softcap: float | None
    needs_grad: bool
    needs_lse: bool = True
    buckets: GroupBuckets | None = None
    key_lengths: torch.Tensor | None = None

    @property
    def request(self) -> SparseRequest:
        q = self.query
        k = self.query_groups.shape[-1]
        return SparseRequest(q.device, q.dtype, self.needs_grad, k, self.softcap is not None,
                             q.shape[2], self.key_groups is None)  # fmt: skip


#: ``run(inputs) -> (out [B, Nq, H, D] in the query's dtype, lse [B, Nq, H])``: token-major
#: and contiguous; ``lse`` float32 (float64 for float64 inputs), ``-inf`` where no key is
#: visible, or None if ``inputs.needs_lse`` is False. Called with no zero-size dimension.
Run = Callable[[SparseInputs], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class SparseBackend:
    """A backend and what it declares it can run.

    Attributes:
        name: the ``backend=`` argument that selects it.
        run: the implementation (see ``Run`` in this module).
        priority: ``"auto"`` tries backends in increasing priority.
        devices: device types it runs on (``"cpu"``, ``"cuda"``, ...), None for any.
        dtypes: input dtypes it takes, None for any floating dtype.
        differentiable: whether its output supports autograd.
        softcap: whether it applies logit soft-capping.
        max_groups: most groups ``K`` it takes, None for any.
        buckets: whether it decodes over a cache's group buckets (calls whose keys' groups
            come as :class:`~.buckets.GroupBuckets` only, inference only).
        check: an extra test of its own, ``check(request) -> reason or None`` (e.g. a kernel
            that could not be built); run last, only when the declarations allow the call.
        summary: one line for messages and documentation.
        auto_devices: device types on which ``"auto"`` may choose it, None for wherever it
            can run (a backend that is exact but slow on some device runs there only when
            asked for by name); ``()`` for nowhere (a backend run only by name).
        auto_check: ``auto_check(request) -> reason or None``: calls ``"auto"`` leaves to
            other backends although this one may run them (e.g. shapes it is slow on);
            asked before :meth:`why_not`.
        head_routing: whether it takes memberships per key-value head (``[B, N, H_kv, K]``,
            buckets ``(B, H_kv, K, C)``) itself; others are run on the call folded by
            :func:`fold_heads` (each key-value head a batch row of its own).
    """

    name: str
    run: Run
    priority: int
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    differentiable: bool = False
    softcap: bool = False
    max_groups: int | None = None
    buckets: bool = False
    check: Callable[[SparseRequest], str | None] | None = None
    summary: str = ""
    auto_devices: tuple[str, ...] | None = None
    auto_check: Callable[[SparseRequest], str | None] | None = None
    head_routing: bool = False

    def why_not(self, request: SparseRequest) -> str | None:
        """Why this backend cannot run ``request`` (one sentence), or None if it can."""
        if self.devices is not None and request.device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)} tensors only, received {request.device}"
        if self.dtypes is not None and request.dtype not in self.dtypes:
            names = ", ".join(str(t).removeprefix("torch.") for t in self.dtypes)
            return f"takes {names} inputs, received {request.dtype}"
        if request.over_buckets:
            if not self.buckets:
                able = [b.name for b in _ordered() if b.buckets]
                return f"does not decode over group buckets (those that do: {able})"
            if request.needs_grad:
                return "decodes over group buckets without gradients, and the inputs require grad"
        if request.needs_grad and not self.differentiable:
            able = [b.name for b in _ordered() if b.differentiable]
            return f"is inference only, and the inputs require grad (differentiable: {able})"
        if request.softcap and not self.softcap:
            return "does not apply softcap ('math' does)"
        if self.max_groups is not None and request.num_groups > self.max_groups:
            limit = self.max_groups
            return f"takes K <= {limit} groups, received K = {request.num_groups}"
        return None if self.check is None else self.check(request)

    def why_not_auto(self, request: SparseRequest) -> str | None:
        """Why ``"auto"`` does not choose this backend for ``request``, or None if it may: a
        device outside ``auto_devices``, ``auto_check``'s reason, or :meth:`why_not`."""
        devices = self.auto_devices
        if devices == ():
            return "is never chosen by 'auto' (ask for it by name)"
        if devices is not None and request.device.type not in devices:
            where = "/".join(devices)
            return f"is chosen by 'auto' on {where} only (ask for it by name on {request.device})"
        reason = None if self.auto_check is None else self.auto_check(request)
        return self.why_not(request) if reason is None else reason


_REGISTRY: dict[str, SparseBackend] = {}


def _ordered() -> tuple[SparseBackend, ...]:
    """The registered backends in increasing priority (``"auto"``'s order)."""
    return tuple(sorted(_REGISTRY.values(), key=lambda b: b.priority))


def register_backend(backend: SparseBackend) -> None:
    """Make ``backend`` selectable by name and by ``"auto"`` (by its priority).

    Raises:
        ValueError: the name is ``"auto"`` or already registered.
    """
    if backend.name == "auto" or backend.name in _REGISTRY:
        fail("backend.name", repr(backend.name), "a name not yet registered (nor 'auto')")
    _REGISTRY[backend.name] = backend


def backend_names() -> tuple[str, ...]:
    """The registered backends in ``"auto"``'s order (increasing priority)."""
    return tuple(b.name for b in _ordered())


def check_backend_name(name: object) -> None:
    """Raise :class:`BackendUnavailable` unless ``name`` is ``"auto"`` or a registered
    backend (the message lists them)."""
    if not isinstance(name, str) or (name != "auto" and name not in _REGISTRY):
        _refuse(repr(name), f"one of {('auto', *backend_names())}")


def resolve_backend(name: str, request: SparseRequest) -> SparseBackend:
    """The backend that runs ``request`` when ``backend=name`` is asked.

    ``"auto"``: the first registered backend, in increasing priority, whose
    :meth:`SparseBackend.why_not_auto` is None (it can run the call, on a device where
    ``"auto"`` may choose it). Any other name: that backend, if it can run the
    call.

    Raises:
        BackendUnavailable: (a ``ValueError``) an unknown name; a named backend that cannot
            run the call (the message names it and gives its reason); ``"auto"`` when no
            backend can (the message gives every backend's reason).
    """
    check_backend_name(name)
    if name != "auto":
        backend = _REGISTRY[name]
        reason = backend.why_not(request)
        if reason is not None:
            _refuse(f"{name!r}, which cannot run this call: it {reason}", _hint(name, request))
        return backend
    reasons = []
    for candidate in _ordered():
        reason = candidate.why_not_auto(request)
        if reason is None:
            return candidate
        reasons.append(f"{candidate.name!r} {reason}")
    _refuse("'auto', but no backend can run this call: " + "; ".join(reasons), _hint("", request))
    raise AssertionError  # unreachable: _refuse() raised


def _hint(name: str, request: SparseRequest) -> str:
    """What to ask for instead: the other registered backends that can run ``request``."""
    able = [b.name for b in _ordered() if b.name != name and b.why_not(request) is None]
    if not able:
        return "inputs that a registered backend can run (none can run these: see the reasons)"
    return f"a backend that can run it: {', '.join(map(repr, able))} or 'auto'"


def _empty_result(inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of a call with a zero-size dimension: token-major zeros and ``-inf``."""
    b, h, nq, d = inputs.query.shape
    q = inputs.query
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(b, nq, h, d, dtype=q.dtype, device=q.device)
    return out, torch.full((b, nq, h), -math.inf, dtype=lse_dtype, device=q.device)


def run_backend(name: str, inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Resolve ``name`` for ``inputs`` and run it (a zero-size call returns its empty
    result on every backend): ``(out [B, Nq, H, D], lse [B, Nq, H])``, token-major; ``lse``
    may be None when ``inputs.needs_lse`` is False."""
    backend = resolve_backend(name, inputs.request)
    if inputs.query.numel() == 0:
        return _empty_result(inputs)
    if inputs.query_groups.dim() == 4 and not backend.head_routing:
        b, h_kv = inputs.key.shape[:2]
        out, lse = backend.run(fold_heads(inputs))
        return unfold_heads(out, b, h_kv), None if lse is None else unfold_heads(lse, b, h_kv)
    return backend.run(inputs)


# --------------------------------------------------------------------------------------
# memberships per key-value head: each head a batch row of its own
# --------------------------------------------------------------------------------------


def fold_heads(inputs: SparseInputs) -> SparseInputs:
    """A call with memberships per key-value head as one with shared memberships, each
    key-value head a batch row of its own (row ``b * H_kv + h``): ``query [B, H, Nq, D]``
    to ``[B * H_kv, H / H_kv, Nq, D]``, ``key``/``value`` ``[B, H_kv, Nk, D]`` to
    ``[B * H_kv, 1, Nk, D]`` (views where the strides allow, else copies), memberships
    ``[B, N, H_kv, K]`` to ``[B * H_kv, N, K]``, buckets ``(B, H_kv, K, C)`` to
    ``(B * H_kv, 1, K, C)``, the per-row ``key_padding_mask`` and ``key_lengths`` repeated
    per head. Differentiable (reshapes). :func:`unfold_heads` gives back the layout of the
    results."""
    b, h, nq, d = inputs.query.shape
    h_kv = inputs.key.shape[1]
    rows = b * h_kv

    def per_head(x: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, H_kv, ...]`` to ``[B * H_kv, 1, ...]``."""
        return None if x is None else x.reshape(rows, 1, *x.shape[2:])

    def groups(x: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, N, H_kv, K]`` to ``[B * H_kv, N, K]``."""
        return None if x is None else x.transpose(1, 2).reshape(rows, x.shape[1], x.shape[3])

    def per_row(x: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, ...]`` to ``[B * H_kv, ...]``, row ``b`` repeated per head."""
        return None if x is None else x.repeat_interleave(h_kv, dim=0)

    buckets = inputs.buckets
    if buckets is not None:
        buckets = GroupBuckets(per_head(buckets.index), per_head(buckets.count),
                               per_head(buckets.codes))  # fmt: skip
    return replace(
        inputs, query=inputs.query.reshape(rows, h // h_kv, nq, d), key=per_head(inputs.key),
        value=per_head(inputs.value), query_groups=groups(inputs.query_groups),
        key_groups=groups(inputs.key_groups), key_padding_mask=per_row(inputs.key_padding_mask),
        key_lengths=per_row(inputs.key_lengths), buckets=buckets,
    )  # fmt: skip


def unfold_heads(result: torch.Tensor, batch: int, kv_heads: int) -> torch.Tensor:
    """A token-major result of a call folded by :func:`fold_heads`, ``out [B * H_kv, Nq,
    H / H_kv, D]`` or ``lse [B * H_kv, Nq, H / H_kv]``, in the call's own layout ``[B, Nq,
    H, D]`` / ``[B, Nq, H]`` (query head ``h * H / H_kv + r`` is row ``b * H_kv + h``'s head
    ``r``), contiguous."""
    nq, rep = result.shape[1], result.shape[2]
    split = result.reshape(batch, kv_heads, nq, rep, *result.shape[3:])
    return split.transpose(1, 2).reshape(batch, nq, kv_heads * rep, *result.shape[3:])


# --------------------------------------------------------------------------------------
# the custom operator
# --------------------------------------------------------------------------------------

_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor query_groups, Tensor key_groups, "
    "Tensor? key_padding_mask, int window, float scale, float? softcap, str backend, "
    "bool needs_lse=True) -> (Tensor, Tensor)"
)


@torch.library.custom_op(
    "focus_attention::sparse_attention",
    mutates_args=(),
    schema=_SCHEMA,
)
def sparse_attention_op(
    query, key, value, query_groups, key_groups, key_padding_mask, window, scale, softcap,
    backend, needs_lse=True,
):  # fmt: skip
    """``run_backend(backend, ...)`` without gradients, as an opaque operator: token-major
    ``(out [B, Nq, H, D], lse [B, Nq, H])``, contiguous as the fake implementation says;
    with ``needs_lse`` False the backend runs as in an eager call that does not ask for the
    log-sum-exp (the same path, so the same result) and ``lse`` is an empty tensor."""
    args = (query, key, value, query_groups, key_groups, key_padding_mask, window, scale)
    inputs = SparseInputs(*args, softcap, needs_grad=False, needs_lse=needs_lse)
    out, lse = run_inference(backend, inputs)
    if not needs_lse:
        return out, _no_lse(query)
    assert lse is not None  # asked for, so every backend returns it
    return out, lse


def _no_lse(query: torch.Tensor) -> torch.Tensor:
    """The operator's ``lse`` when none is asked for: empty, of the log-sum-exp's dtype."""
    return query.new_empty(0, dtype=torch.promote_types(query.dtype, torch.float32))


def run_inference(name: str, inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`run_backend` with contiguous results, as the operator's fake implementation
    says (``lse`` None only if ``inputs.needs_lse`` is False)."""
    out, lse = run_backend(name, inputs)
    return out.contiguous(), None if lse is None else lse.contiguous()


@sparse_attention_op.register_fake
def _sparse_attention_fake(
    query, key, value, query_groups, key_groups, key_padding_mask, window, scale, softcap,
    backend, needs_lse=True,
):  # fmt: skip
    b, h, nq, d = query.shape
    lse_dtype = torch.promote_types(query.dtype, torch.float32)
    lse = query.new_empty(b, nq, h, dtype=lse_dtype) if needs_lse else _no_lse(query)
    return query.new_empty(b, nq, h, d), lse


@torch.compiler.disable
def run_differentiable(name: str, inputs: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`run_backend` for calls that need gradients, eagerly (a graph break under
    ``torch.compile``; see the module docstring). A zero-size call's empty result is still
    connected to ``query``, ``key`` and ``value``, so backward gives them zero gradients."""
    out, lse = run_backend(name, inputs)
    if inputs.query.numel() == 0:
        tie = sum(t.sum() for t in (inputs.query, inputs.key, inputs.value)) * 0
        out = out + tie.to(out.dtype)
    return out, lse
