"""Operations a call dispatches, counted: what bounds a step when each operation costs more to
launch than to compute (a small model on a GPU; docs/deploy.md, "Speed").

:func:`count_operations` runs a call once under a ``TorchDispatchMode`` (PyTorch's hook at
the dispatcher, below autograd, the level where each ATen operation runs its kernel) and
counts the operations that reach it, less views (which launch no kernel), and the host
synchronisations among them: operations whose result, or size, is read back to the host
(``.item()``, ``bool(tensor)``, ``nonzero``, indexing by a bool mask...), which wait for the
device to finish. A higher-order operator (FlexAttention) counts as one operation. The
counts depend on the path the call takes, so on the device (the CPU routes with a fused
kernel, CUDA does not) and the backend; they are exact on whatever device runs them, except
that reads which bypass the dispatcher (``.tolist()``, ``.numpy()``, used by the ``math`` and
``cpu_flash`` backends' planning, not on the CUDA path) are not seen.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BOOL_INDEX_OPERATIONS", "HOST_SYNC_OPERATIONS", "OperationCounter", "count_operations"]

#: ATen operations that read a value or a size back to the host (on a GPU they wait for
#: every queued kernel): ``.item()`` and ``bool(tensor)``, and outputs whose size depends on
#: the data
HOST_SYNC_OPERATIONS = frozenset(
    {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "masked_select", "unique",
     "_unique", "_unique2", "unique_consecutive", "unique_dim", "equal"}
)  # fmt: skip


#: operations that read back to the host when given a bool index (its count of True)
BOOL_INDEX_OPERATIONS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


class OperationCounter(TorchDispatchMode):
    """Counts, per ATen operation name, the operations dispatched while it is active
    (``counts``), views apart (``views``), and the host syncs among them (``syncs``)."""

    #: FlexAttention's higher-order operator reaches the mode (counted as one operation)
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.views = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "is_view", False):
            self.views += 1
        else:
            packet = getattr(func, "overloadpacket", func)
            name = getattr(packet, "__name__", str(func))
            self.counts[name] += 1
            self.syncs += _reads_back(name, args, kwargs)
        return func(*args, **kwargs)

    def summary(self) -> dict[str, Any]:
        """``{"operations", "host_syncs", "views", "by_name"}``: operations other than views,
        those of them that read back to the host, views, and the count per name."""
        return {"operations": sum(self.counts.values()), "host_syncs": self.syncs,
                "views": self.views, "by_name": dict(self.counts.most_common())}  # fmt: skip


def _reads_back(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether operation ``name`` on these arguments reads a value or a size back to the
    host: one of :data:`HOST_SYNC_OPERATIONS`, an index by a bool mask, or
    ``repeat_interleave`` by a tensor of counts without ``output_size``."""
    if name in HOST_SYNC_OPERATIONS:
        return True
    if name in BOOL_INDEX_OPERATIONS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(getattr(i, "dtype", None) in (torch.bool, torch.uint8) for i in indices or ())
    if name == "repeat_interleave":  # its Tensor overload: (repeats, *, output_size)
        return kwargs.get("output_size") is None and len(args) == 1
    return False


def count_operations(call: Callable[[], Any], context: Callable[[], Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run ``call()`` once (inside ``context()``, a context-manager factory, if given) and
    return :meth:`OperationCounter.summary` of what it dispatched."""
    counter = OperationCounter()
    with context() if context is not None else contextlib.nullcontext(), counter:
        call()
    return counter.summary()
