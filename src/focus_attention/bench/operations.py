"""Operations a call dispatches, counted: what bounds a step when each operation costs more to
launch than to compute (a small model on a GPU; docs/deploy.md, "Speed").

:func:`count_operations` runs a call once under a ``TorchDispatchMode`` (PyTorch's hook at
the dispatcher, below autograd, the level where each ATen operation runs its kernel) and
counts the operations that reach it, less views (which launch no kernel), and the host
synchronisations among them: operations whose result, or size, is read back to the host
(``.item()``, ``bool(tensor)``, ``nonzero``...), which wait for the device to finish. The
counts depend on the path the call takes, so on the device (the CPU routes with a fused
kernel, CUDA does not) and the backend; they are exact on whatever device runs them.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_SYNC_OPERATIONS", "OperationCounter", "count_operations"]

#: ATen operations that read a value or a size back to the host (on a GPU they wait for
#: every queued kernel): ``.item()`` and ``bool(tensor)``, and outputs whose size depends on
#: the data
HOST_SYNC_OPERATIONS = frozenset(
    {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "masked_select", "unique",
     "_unique", "_unique2", "unique_consecutive", "unique_dim", "equal"}
)  # fmt: skip


class OperationCounter(TorchDispatchMode):
    """Counts, per ATen operation name, the operations dispatched while it is active
    (``counts``), views apart (``views``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, Any]:
        """``{"operations", "host_syncs", "views", "by_name"}``: operations other than views,
        those of them in :data:`HOST_SYNC_OPERATIONS`, views, and the count per name."""
        syncs = sum(n for name, n in self.counts.items() if name in HOST_SYNC_OPERATIONS)
        return {"operations": sum(self.counts.values()), "host_syncs": syncs,
                "views": self.views, "by_name": dict(self.counts.most_common())}  # fmt: skip


def count_operations(call: Callable[[], Any], context: Callable[[], Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run ``call()`` once (inside ``context()``, a context-manager factory, if given) and
    return :meth:`OperationCounter.summary` of what it dispatched."""
    counter = OperationCounter()
    with context() if context is not None else contextlib.nullcontext(), counter:
        call()
    return counter.summary()
