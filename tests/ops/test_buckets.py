"""``GroupBuckets``: the per-group key positions of a cache (docs/method.md §5, "KV-cache
decoding"), checked against memberships written out by hand: built at once, grown by
appends of any size with shared or per-row positions, cropped, selected by rows; argument
checks; and that appends and crops are fixed sequences of operations without host
synchronisation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_attention.ops.sparse.buckets import GroupBuckets

from .helpers import HYP, gen
from .op_record import OpRecorder, assert_same_operations


def memberships(batch=2, rows=1, n=30, groups=5, seed=0, sinks=1, padding=True) -> torch.Tensor:
    """Random bool ``[B, R, n, K]``: each key in each group with probability 0.3 (some in
    none, groups may be empty), the first ``sinks`` keys in every group, and with
    ``padding`` the last three keys of row 0 in none."""
    m = torch.rand(batch, rows, n, groups, generator=gen(seed)) < 0.3
    m[:, :, :sinks] = True
    if padding:
        m[0, :, n - 3 :] = False
    return m


def assert_holds(buckets: GroupBuckets, groups: torch.Tensor) -> None:
    """``buckets`` hold exactly the keys of ``groups`` (bool ``[B, R, N, K]`` for positions
    ``0 .. N - 1``; none beyond): per group its positions in increasing order, the count,
    and each position's code."""
    b, r, n, k = groups.shape
    assert buckets.capacity >= n
    for bi in range(b):
        for ri in range(r):
            for g in range(k):
                expected = groups[bi, ri, :, g].nonzero().flatten().to(torch.int32)
                count = int(buckets.count[bi, ri, g])
                assert count == len(expected)
                assert torch.equal(buckets.index[bi, ri, g, :count], expected)
    bits = 2 ** torch.arange(k, dtype=torch.int64)
    codes = torch.zeros(b, r, buckets.capacity, dtype=torch.int64)
    codes[:, :, :n] = (groups.long() * bits).sum(-1)
    assert torch.equal(buckets.codes, codes)


def same(first: GroupBuckets, second: GroupBuckets) -> bool:
    """Equal valid contents (the entries past each count and the scratch column may differ)."""
    if not (torch.equal(first.count, second.count) and torch.equal(first.codes, second.codes)):
        return False
    valid = torch.arange(first.capacity) < first.count[..., None]
    return torch.equal(first.index[..., :-1][valid], second.index[..., :-1][valid])


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("capacity", [None, 41])
def test_from_groups(rows, capacity):
    groups = memberships(rows=rows, groups=6, seed=rows)
    groups[:, :, :, 4] = False  # an empty group
    buckets = GroupBuckets.from_groups(groups, capacity)
    assert buckets.capacity == (30 if capacity is None else capacity)
    assert (buckets.batch, buckets.rows, buckets.num_groups) == (2, rows, 6)
    assert buckets.index.dtype == buckets.count.dtype == torch.int32
    assert_holds(buckets, groups)


def test_sixty_two_groups():
    groups = memberships(groups=62, n=20, seed=4)
    groups[1, 0, 7, 61] = True  # the highest bit of a code
    assert_holds(GroupBuckets.from_groups(groups), groups)


@pytest.mark.parametrize("chunks", [[1] * 30, [7, 1, 1, 5, 16], [30], [0, 12, 0, 18]])
def test_appends_equal_buckets_built_at_once(chunks):
    groups = memberships(rows=2, seed=len(chunks))
    grown = GroupBuckets.empty(2, 2, 5, 30)
    start = 0
    for size in chunks:
        positions = torch.arange(start, start + size)
        if size % 2:  # per-row positions ([B, N]) on odd chunks
            positions = positions[None].expand(2, size).contiguous()
        grown.append_(positions, groups[:, :, start : start + size])
        start += size
    assert same(grown, GroupBuckets.from_groups(groups))
    assert_holds(grown, groups)


def test_rows_at_different_positions():
    """Rows appended at positions of their own (rows of different lengths in one batch)."""
    groups = memberships(n=20, seed=9, padding=False)
    grown = GroupBuckets.empty(2, 1, 5, 24)
    offsets = torch.tensor([0, 4])
    for p in range(20):
        grown.append_((offsets + p)[:, None], groups[:, :, p : p + 1])
    expected = torch.zeros(2, 1, 24, 5, dtype=torch.bool)
    expected[0, :, :20] = groups[0]
    expected[1, :, 4:24] = groups[1]
    assert_holds(grown, expected)


def test_crop_then_append():
    """Cropping (an int, or per row) forgets the later keys; appending after a crop gives
    the buckets of the new sequence (rejected speculative tokens replaced)."""
    groups = memberships(n=30, rows=2, seed=3)
    buckets = GroupBuckets.from_groups(groups, capacity=34)
    buckets.crop_(22)
    assert_holds(buckets, groups[:, :, :22])
    other = memberships(n=12, rows=2, seed=5, sinks=0)
    buckets.append_(torch.arange(22, 34), other)
    assert_holds(buckets, torch.cat([groups[:, :, :22], other], dim=2))
    buckets.crop_(torch.tensor([10, 25]))
    expected = torch.cat([groups[:, :, :22], other], dim=2)[:, :, :25].clone()
    expected[0, :, 10:] = False
    assert_holds(buckets, expected)
    buckets.crop_(0)
    assert int(buckets.count.sum()) == 0 and int(buckets.codes.abs().sum()) == 0


def test_index_select_and_reorder():
    groups = memberships(batch=3, rows=2, seed=6)
    buckets = GroupBuckets.from_groups(groups)
    order = torch.tensor([2, 0, 2])
    assert_holds(buckets.index_select(order), groups[order])
    pointer = buckets.index.data_ptr()
    buckets.reorder_(order)
    assert buckets.index.data_ptr() == pointer
    assert_holds(buckets, groups[order])
    with pytest.raises(ValueError, match="batch_index: received 2 rows, expected B = 3"):
        buckets.reorder_(torch.tensor([0, 1]))


@st.composite
def append_plan(draw) -> tuple:
    n = draw(st.integers(0, 25))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
    return n, [0, *cuts, n], draw(st.integers(1, 7)), draw(st.integers(0, 2**31 - 1))


@given(plan=append_plan())
@settings(HYP, max_examples=25)
def test_property_appends(plan):
    n, cuts, k, seed = plan
    groups = memberships(n=n, groups=k, seed=seed, sinks=min(n, 1), padding=n >= 3)
    grown = GroupBuckets.empty(2, 1, k, n + 2)
    for a, b in zip(cuts, cuts[1:], strict=False):
        grown.append_(torch.arange(a, b), groups[:, :, a:b])
    assert_holds(grown, groups)


def test_operations_do_not_depend_on_values():
    """Appends and crops of two different contents dispatch the same operations on the
    same shapes, none of which reads the device from the host."""
    records = []
    for seed in (1, 2):
        groups = memberships(n=12, rows=2, seed=seed)
        buckets = GroupBuckets.from_groups(groups[:, :, :8], capacity=16)
        with OpRecorder() as recorder:
            buckets.append_(torch.arange(8, 12), groups[:, :, 8:])
            buckets.append_(torch.full((2, 1), 12), groups[:, :, :1])
            buckets.crop_(torch.tensor([5, 10 + seed]))
            buckets.crop_(4)
            buckets.reorder_(torch.tensor([1, 0]))
        records.append(recorder)
    assert_same_operations(*records)


def _bad_calls():
    rows = []

    def add(name, call, match):
        rows.append(pytest.param(call, match, id=name))

    buckets = lambda: GroupBuckets.empty(2, 1, 4, 10)  # noqa: E731
    groups = torch.zeros(2, 1, 3, 4, dtype=torch.bool)
    add("empty-K63", lambda: GroupBuckets.empty(1, 1, 63, 4), "num_groups: received 63")
    add("empty-K0", lambda: GroupBuckets.empty(1, 1, 0, 4), "num_groups: received 0")
    add("empty-rows", lambda: GroupBuckets.empty(1, 0, 2, 4), "rows: received 0")
    add("empty-capacity", lambda: GroupBuckets.empty(1, 1, 2, -1), "capacity: received -1")
    add("empty-bool", lambda: GroupBuckets.empty(True, 1, 2, 4), "batch: received True")
    add(
        "from-float", lambda: GroupBuckets.from_groups(groups.float()), "key_groups: received dtype"
    )
    add("from-rank", lambda: GroupBuckets.from_groups(groups[0]), "key_groups: .*rank 4")
    add("from-K63", lambda: GroupBuckets.from_groups(torch.zeros(1, 1, 2, 63, dtype=torch.bool)),
        "K = 63")  # fmt: skip
    add("from-capacity", lambda: GroupBuckets.from_groups(groups, capacity=2), "capacity")
    add("append-int32", lambda: buckets().append_(torch.arange(3, dtype=torch.int32), groups),
        "positions: received dtype torch.int32")  # fmt: skip
    add("append-list", lambda: buckets().append_([0, 1, 2], groups), "positions: received")
    add("append-shape", lambda: buckets().append_(torch.arange(4), groups), r"\[N=3\]")
    add("append-groups-K", lambda: buckets().append_(torch.arange(3), groups[..., :3]),
        r"groups: .*K=4")  # fmt: skip
    add("append-groups-bool", lambda: buckets().append_(torch.arange(3), groups.int()),
        "groups: received dtype")  # fmt: skip
    add("crop-negative", lambda: buckets().crop_(-1), "length: received -1")
    add("crop-float", lambda: buckets().crop_(torch.tensor([1.0, 2.0])), "length: received")
    add("crop-shape", lambda: buckets().crop_(torch.tensor([1, 2, 3])), r"\[B=2\]")
    add("index-dtype", lambda: GroupBuckets(torch.zeros(1, 1, 2, 5, dtype=torch.int64),
        torch.zeros(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 4, dtype=torch.int64)),
        "index/count: received dtypes")  # fmt: skip
    add("codes-shape", lambda: GroupBuckets(torch.zeros(1, 1, 2, 5, dtype=torch.int32),
        torch.zeros(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 5, dtype=torch.int64)),
        r"codes: .*C=4")  # fmt: skip
    return rows


@pytest.mark.parametrize(("call", "match"), _bad_calls())
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
