"""Recording the aten operations a call dispatches, for the tests that a call's operation
sequence depends on shapes only and never reads the device from the host (what a CUDA
graph's capture needs)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten operations that read a device value on the host, or give a shape that depends on one
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_scatter", "allclose",
})  # fmt: skip


def describe(arg):
    """An operation's argument without the values of tensors: a tensor's shape and dtype,
    a storage's size (Triton's interpreter passes storages), the repr of anything else."""
    if isinstance(arg, torch.Tensor):
        return tuple(arg.shape), arg.dtype
    if isinstance(arg, (torch.UntypedStorage, torch.TypedStorage)):
        return "storage", arg.nbytes()
    return repr(arg)


class OpRecorder(TorchDispatchMode):
    """Inside the context, ``ops`` lists each dispatched aten operation as
    ``(name, overload, described arguments)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        self.ops.append((func.overloadpacket.__name__, str(func), tuple(map(describe, flat))))
        return func(*args, **(kwargs or {}))

    def names(self) -> set[str]:
        return {name for name, *_ in self.ops}


def assert_same_operations(first: OpRecorder, second: OpRecorder) -> None:
    """Both recorded the same non-empty sequence, with no host synchronisation."""
    assert first.ops, "nothing recorded"
    assert first.ops == second.ops
    assert not first.names() & SYNC_OPS, sorted(first.names() & SYNC_OPS)
