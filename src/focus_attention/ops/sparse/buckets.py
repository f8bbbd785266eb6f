"""Group buckets: per group, the positions of the cached keys in it, so that a decoding step
reads only its window and its groups' keys (docs/method.md §4-§5, "KV-cache decoding").

With token-level groups laid out in token order, no block of a key-value cache holds keys
of one group only, so a sparse decoding step cannot skip blocks of the cache: it needs the
list of its groups' keys. A :class:`GroupBuckets` keeps that list per group, for a batch of
``B`` rows and ``R`` routing rows (``R = 1``: one routing shared by every key-value head;
``R = H_kv``: a routing per key-value head), over a cache of capacity ``C``:

- ``index`` int32 ``[B, R, K, C + 1]``: the positions of the keys of group ``g``, increasing;
  the first ``count[b, r, g]`` are valid. Column ``C`` is a scratch slot that absorbs the
  writes of non-members, so an append is a fixed-shape scatter.
- ``count`` int32 ``[B, R, K]``: the number of keys in each group.
- ``codes`` int64 ``[B, R, C]``: the group code of each key position (bit ``g`` set iff the key
  is in group ``g``; :func:`~.triton_support.group_codes`), 0 where nothing was written.

Every method is a fixed sequence of device operations whose shapes depend on the input
shapes only: no host synchronisation, so they can be captured in a CUDA graph. Memory:
``4 x B x R x K x (C + 1)`` bytes for the index (a key is listed once per group it is in;
``K = 8``, ``C = 32768``, ``B = R = 1``: 1 MiB) plus ``8 x B x R x C`` for the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...utils.checks import check_int
from ..checks import check_bool, check_device, check_tensor, fail
from .triton_support import MAX_KERNEL_GROUPS, group_codes

__all__ = ["GroupBuckets"]

_OWNER = "GroupBuckets"


@dataclass
class GroupBuckets:
    """The keys of each group of a key-value cache, as position lists (see the module
    docstring for the layout). Build with :meth:`empty` or :meth:`from_groups`, grow with
    :meth:`append_`; :func:`~.triton_decode.bucket_decode` reads them.

    Attributes:
        index: int32 ``[B, R, K, C + 1]``, per group the increasing key positions (the first
            ``count`` valid; column ``C`` is scratch).
        count: int32 ``[B, R, K]``, keys per group.
        codes: int64 ``[B, R, C]``, each key position's group code (0 if not written).

    Raises:
        ValueError: (on construction) tensors of the wrong rank, dtype, shape or device, or
            ``K`` outside ``1..62`` (:data:`~.triton_support.MAX_KERNEL_GROUPS`).
    """

    index: torch.Tensor
    count: torch.Tensor
    codes: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor("index", self.index, 4)
        check_tensor("count", self.count, 3)
        check_tensor("codes", self.codes, 3)
        b, r, k, c1 = self.index.shape
        if self.index.dtype != torch.int32 or self.count.dtype != torch.int32:
            fail("index/count", f"dtypes {self.index.dtype}/{self.count.dtype}", "torch.int32")
        if self.codes.dtype != torch.int64:
            fail("codes", f"dtype {self.codes.dtype}", "torch.int64")
        if not 1 <= k <= MAX_KERNEL_GROUPS:
            fail("index", f"K = {k} groups", f"1 <= K <= {MAX_KERNEL_GROUPS}")
        if c1 < 1:
            fail("index", f"shape {tuple(self.index.shape)}", "[B, R, K, C + 1] with C >= 0")
        if tuple(self.count.shape) != (b, r, k):
            fail("count", f"shape {tuple(self.count.shape)}", f"[B={b}, R={r}, K={k}]")
        if tuple(self.codes.shape) != (b, r, c1 - 1):
            fail("codes", f"shape {tuple(self.codes.shape)}", f"[B={b}, R={r}, C={c1 - 1}]")
        check_device("count", self.count, self.index.device, "index")
        check_device("codes", self.codes, self.index.device, "index")

    @property
    def batch(self) -> int:
        """``B``, the rows of the batch."""
        return self.index.shape[0]

    @property
    def rows(self) -> int:
        """``R``, the routing rows (1, or one per key-value head)."""
        return self.index.shape[1]

    @property
    def num_groups(self) -> int:
        """``K``, the groups."""
        return self.index.shape[2]

    @property
    def capacity(self) -> int:
        """``C``, the key positions the buckets can hold (``0 .. C - 1``)."""
        return self.index.shape[3] - 1

    @property
    def device(self) -> torch.device:
        return self.index.device

    @classmethod
    def empty(
        cls,
        batch: int,
        rows: int,
        num_groups: int,
        capacity: int,
        device: torch.device | str | None = None,
    ) -> GroupBuckets:
        """Buckets holding no key: zero counts and codes (the index is zero-filled too).

        Args:
            batch: ``B >= 0``. rows: ``R >= 1``. num_groups: ``K`` in ``1..62``.
            capacity: ``C >= 0``, the key positions ``0 .. C - 1`` the buckets can hold.
            device: where the tensors live (default: the CPU).

        Raises:
            ValueError: an argument that is not an int in its range.
        """
        check_int(_OWNER, "batch", batch, 0)
        check_int(_OWNER, "rows", rows, 1)
        check_int(_OWNER, "num_groups", num_groups, 1)
        check_int(_OWNER, "capacity", capacity, 0)
        if num_groups > MAX_KERNEL_GROUPS:
            fail(f"{_OWNER}.num_groups", repr(num_groups), f"an int in 1..{MAX_KERNEL_GROUPS}")
        index = torch.zeros(batch, rows, num_groups, capacity + 1, dtype=torch.int32,
                            device=device)  # fmt: skip
        count = torch.zeros(batch, rows, num_groups, dtype=torch.int32, device=device)
        codes = torch.zeros(batch, rows, capacity, dtype=torch.int64, device=device)
        return cls(index, count, codes)

    @classmethod
    def from_groups(cls, key_groups: torch.Tensor, capacity: int | None = None) -> GroupBuckets:
        """Buckets of the keys at positions ``0 .. Nk - 1`` with memberships ``key_groups``.

        Args:
            key_groups: bool ``[B, R, Nk, K]`` (a sink key is in every group, a padding key
                in none).
            capacity: ``C >= Nk`` (default ``Nk``).

        Raises:
            ValueError: ``key_groups`` not bool of rank 4, ``K`` outside ``1..62``,
                ``capacity < Nk``.
        """
        check_tensor("key_groups", key_groups, 4)
        check_bool("key_groups", key_groups)
        b, r, nk, k = key_groups.shape
        if not 1 <= k <= MAX_KERNEL_GROUPS:
            fail("key_groups", f"K = {k} groups", f"1 <= K <= {MAX_KERNEL_GROUPS}")
        capacity = nk if capacity is None else capacity
        check_int(_OWNER, "capacity", capacity, nk)
        buckets = cls.empty(b, r, k, capacity, key_groups.device)
        positions = torch.arange(nk, device=key_groups.device)
        buckets.append_(positions, key_groups)
        return buckets

    def append_(self, positions: torch.Tensor, groups: torch.Tensor) -> GroupBuckets:
        """Append keys in place: key ``n`` of row ``b`` at position ``positions[b, n]`` (or
        ``positions[n]`` for every row) joins the groups where ``groups[b, r, n]`` is True.

        A fixed sequence of device operations (a cumulative sum of the memberships gives
        each member its slot after the group's ``count``; one scatter writes the positions,
        non-members writing to the scratch column; one scatter writes the codes), with no
        host synchronisation, so it can run during CUDA-graph capture.

        Args:
            positions: int64 ``[N]`` or ``[B, N]``: per row increasing, after every position
                already appended, and below the capacity (not checked: that would read
                the device; a position at or beyond ``C`` is an indexing error).
            groups: bool ``[B, R, N, K]``, the keys' memberships (a sink key is in every
                group; a padding key in none).

        Returns:
            ``self``.

        Raises:
            ValueError: wrong ranks, shapes, dtypes or devices.
        """
        self._check_append(positions, groups)
        b, r, k, c1 = self.index.shape
        n = groups.shape[2]
        if n == 0 or b == 0:
            return self
        pos = positions.expand(b, n)
        member = groups.transpose(2, 3)  # [B, R, K, N]
        rank = member.cumsum(dim=-1, dtype=torch.int32)
        slot = torch.where(member, rank + (self.count[..., None] - 1), c1 - 1)
        values = pos[:, None, None, :].to(torch.int32).expand(b, r, k, n)
        self.index.scatter_(-1, slot.to(torch.int64), values)
        self.count.add_(rank[..., -1])
        self.codes.scatter_(-1, pos[:, None, :].expand(b, r, n), group_codes(groups))
        return self

    def _check_append(self, positions: torch.Tensor, groups: torch.Tensor) -> None:
        """Validate the arguments of :meth:`append_`."""
        b, r, k, _ = self.index.shape
        check_tensor("groups", groups, 4)
        check_bool("groups", groups)
        n = groups.shape[2]
        if (groups.shape[0], groups.shape[1], groups.shape[3]) != (b, r, k):
            fail("groups", f"shape {tuple(groups.shape)}", f"[B={b}, R={r}, N, K={k}]")
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64:
            what = f"dtype {positions.dtype}" if isinstance(positions, torch.Tensor) else positions
            fail("positions", what, "an int64 tensor [N] or [B, N]")
        if tuple(positions.shape) not in ((n,), (b, n)):
            fail("positions", f"shape {tuple(positions.shape)}", f"[N={n}] or [B={b}, N={n}]")
        check_device("positions", positions, self.device, "the buckets")
        check_device("groups", groups, self.device, "the buckets")

    def index_select(self, batch_index: torch.Tensor) -> GroupBuckets:
        """New buckets of the rows ``batch_index`` (int64 ``[B']``, on the buckets' device):
        batch selection, or the reordering of beam search. Fixed-shape."""
        return GroupBuckets(
            self.index.index_select(0, batch_index),
            self.count.index_select(0, batch_index),
            self.codes.index_select(0, batch_index),
        )

    def reorder_(self, batch_index: torch.Tensor) -> GroupBuckets:
        """:meth:`index_select` written into these buckets' own tensors (``B' = B``): the
        buffers keep their addresses, as a captured CUDA graph needs. Returns ``self``."""
        selected = self.index_select(batch_index)
        if selected.batch != self.batch:
            fail("batch_index", f"{selected.batch} rows", f"B = {self.batch} rows")
        self.index.copy_(selected.index)
        self.count.copy_(selected.count)
        self.codes.copy_(selected.codes)
        return self

    def crop_(self, length: int | torch.Tensor) -> GroupBuckets:
        """Remove, in place, every key at a position ``>= length`` (an int for every row,
        or an int tensor ``[B]`` per row): as a cache's ``crop``, e.g. after rejected
        speculative tokens. Fixed-shape, ``O(B x R x K x C)`` work (each count is recounted
        from the index), no host synchronisation. Returns ``self``.

        Raises:
            ValueError: ``length`` not an int ``>= 0`` nor an integer tensor ``[B]``.
        """
        b, _, _, c1 = self.index.shape
        if isinstance(length, torch.Tensor):
            if length.shape != (b,) or length.is_floating_point() or length.dtype == torch.bool:
                fail("length", f"a {length.dtype} tensor of shape {tuple(length.shape)}",
                     f"an int or an integer tensor [B={b}]")  # fmt: skip
            check_device("length", length, self.device, "the buckets")
            limit = length.to(torch.int64)
        else:
            check_int(f"{_OWNER}.crop_", "length", length, 0)
            limit = torch.full((b,), int(length), dtype=torch.int64, device=self.device)
        slots = torch.arange(c1 - 1, device=self.device)
        kept = (self.index[..., :-1] < limit[:, None, None, None]) & (slots < self.count[..., None])
        self.count.copy_(kept.sum(dim=-1, dtype=torch.int32))
        self.codes.masked_fill_(slots >= limit[:, None, None], 0)
        return self
