"""What Triton's interpreter cannot check, checked on any machine: every Triton kernel of the
package compiles for sm_80, sm_90 and sm_100 at the configurations its launchers choose
(``ops.sparse.triton_compile``: the launchers build the launches, Triton specialises them as
at a launch), within each target's shared memory (or a named excess) and without an unnamed
register spill, with
tensor-core dots in half precision; every product of a stride is 64-bit in the kernels'
TTIR; offsets at the supported sizes exceed 32 bits (so that matters); the launch grids stay
within CUDA's limits at the largest supported shapes.

The compilations run in a child process without ``TRITON_INTERPRET`` (the kernels of this
process are the interpreter's), once per test session for the representative shape; the
cross product of dtypes, head sizes, GQA ratios, flags and split counts is marked slow."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from focus_attention.ops.sparse import triton_compile
from focus_attention.ops.sparse.buckets import GroupBuckets
from focus_attention.ops.sparse.triton_decode import check_decode, decode_launches
from focus_attention.ops.sparse.triton_prefill import (
    MAX_HEAD_DIM,
    prefill_blocks,
    prefill_grids,
    prefill_launches,
)
from focus_attention.ops.sparse.triton_support import MAX_GRID, MAX_KERNEL_GROUPS

#: the targets every run compiles for
CAPABILITIES = (80, 90, 100)
#: every kernel of the two kernels modules
KERNELS = {
    "group_prefill_fwd",
    "group_prefill_bwd_delta",
    "group_prefill_bwd_dq",
    "group_prefill_bwd_dkdv",
    "decode_partials",
    "decode_merge",
}
#: the kernels that multiply tiles (tensor-core dots in half precision)
DOT_KERNELS = KERNELS - {"group_prefill_bwd_delta", "decode_merge"}
#: the supported sizes the offsets are computed at: tokens, heads, key-value heads, head size,
#: and the batch of a prefill (16 x 128K tokens) and of a decoding step over 128K-token caches
TOKENS, HEADS, KV_HEADS, HEAD_DIM, PREFILL_BATCH, DECODE_BATCH = 131_072, 32, 8, 128, 16, 256

#: run in the child: the compile table of a set of shapes as JSON, with each compiled
#: launch's TTIR for the first target
_COMPILE = """
import json, sys
from focus_attention.ops.sparse import triton_compile as tc
name, targets, out = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3]
table = tc.compile_table(tc.launch_shapes(name), targets, jobs=int(sys.argv[4]))
ttir = {}
for shape in tc.launch_shapes(name)[:1]:
    for module, launch in tc.example_launches(shape):
        ttir[launch.kernel] = tc.compile_launch(module, launch, targets[0]).ttir
json.dump({"table": table, "ttir": ttir}, open(out, "w"))
"""


def _compile_in_child(tmp: Path, name: str, jobs: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp / f"{name}.json"
    targets = ",".join(map(str, CAPABILITIES))
    args = [sys.executable, "-c", _COMPILE, name, targets, str(out), str(jobs)]
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def representative(tmp_path_factory) -> dict:
    """The compile table of the representative shape (bfloat16, D = 128, 32/8 heads, every
    flag) for every target, and its TTIR."""
    return _compile_in_child(tmp_path_factory.mktemp("compile"), "representative")


def _check_table(table: list[dict]) -> None:
    problems = triton_compile.table_problems(table)
    assert problems == [], "\n".join(problems)
    for row in table:
        if row["kernel"] in DOT_KERNELS and row["dtype"] != "fp32":
            assert row["tensor_core_ops"] > 0, f"{row['kernel']} {row['target']}: no tensor-core dot"  # fmt: skip


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_kernel_compiles_within_the_targets_limits(representative, capability):
    """Each kernel compiles for the target, its shared memory fits the target's largest
    block, ptxas reports no spill that is not named with its reason, and half-precision
    dots run on tensor cores."""
    rows = [r for r in representative["table"] if r["capability"] == capability]
    assert {r["kernel"] for r in rows} == KERNELS
    _check_table(rows)
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["shared"] >= 0, row


@pytest.fixture(scope="module")
def full_table(tmp_path_factory) -> list[dict]:
    """The full cross product of ``launch_shapes("full")`` (every dtype, every head-size tile
    class, GQA ratios 1, 3 and 64, flags on and off, per-head routing, 62 groups, 8 decoding
    queries, 2 to 128 splits) compiled for sm_80, sm_90 and sm_100."""
    table = _compile_in_child(tmp_path_factory.mktemp("full"), "full", jobs=2)["table"]
    assert {r["kernel"] for r in table} == KERNELS
    return table


@pytest.mark.slow
def test_every_half_precision_configuration_compiles_for_every_target(full_table):
    _check_table([r for r in full_table if r["dtype"] != "fp32"])


@pytest.mark.slow
def test_every_fp32_configuration_compiles_for_every_target(full_table):
    """float32 (FMA dots) compiles everywhere: its spills are named, and its one shared
    memory excess (the dk/dv tile of 64 query rows at D = 256 on sm_80) is named."""
    rows = [r for r in full_table if r["dtype"] == "fp32"]
    _check_table(rows)
    named = {(r["kernel"], r["target"]) for r in rows if r["named_shared"]}
    assert named <= {("group_prefill_bwd_dkdv", "sm_80")}, named


def _record(**changes) -> dict:
    record = {"kernel": "group_prefill_bwd_dkdv", "capability": 80, "dtype": "fp32",
              "config": {"BLOCK_D": 256, "BLOCK_M": 64}, "error": None, "shared": 172_032,
              "spill_stores": 0, "spill_loads": 0}  # fmt: skip
    record.update(changes)
    return record


@pytest.mark.parametrize(
    ("changes", "problem"),
    [({}, None),
     ({"dtype": "bf16"}, "shared memory 172,032 B"),
     ({"capability": 90, "shared": 240_000}, "shared memory 240,000 B"),
     ({"config": {"BLOCK_D": 256, "BLOCK_M": 32}}, "shared memory"),
     ({"shared": 200_000}, "shared memory 200,000 B")],
)  # fmt: skip
def test_shared_memory_beyond_the_target_is_a_problem_unless_named(changes, problem):
    record = _record(**changes)
    found = triton_compile.record_problems(record)
    if problem is None:
        assert found == [] and "float32 at D = 256" in record["named_shared"]
    else:
        assert len(found) == 1 and found[0].startswith(problem) and record["named_shared"] is None


def test_a_tile_the_device_cannot_hold_is_a_clear_error():
    """Triton's OutOfResources at launch becomes an error naming the kernel, the dtype, the
    tile and what to use instead."""
    from types import SimpleNamespace

    from triton.runtime.errors import OutOfResources

    from focus_attention.ops.sparse.triton_support import KernelLaunch

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise OutOfResources(172_032, 166_912, "shared memory")

            return run

    launch = KernelLaunch("group_prefill_bwd_dkdv", (1,), (torch.zeros(2),),
                          {"BLOCK_M": 64, "BLOCK_D": 256, "num_warps": 16})  # fmt: skip
    with pytest.raises(RuntimeError, match=r"group_prefill_bwd_dkdv.*torch.float32.*BLOCK_M.*bfloat16"):  # fmt: skip
        launch.start(SimpleNamespace(group_prefill_bwd_dkdv=Kernel()))
    other = KernelLaunch("decode_merge", (1,), (), {})
    with pytest.raises(ZeroDivisionError):
        other.start(SimpleNamespace(decode_merge={(1,): lambda: 1 / 0}))


def test_wide_fp32_tiles_run_more_warps():
    """float32 tiles of 64 query rows at D = 256 run 16 warps; narrower ones and half
    precision keep the table's."""
    wide = prefill_blocks(256, 64, torch.float32, interpret=False)
    assert {t.num_warps for t in (wide.forward, wide.dq, wide.dkdv)} == {16}
    for blocks in (prefill_blocks(256, 3, torch.float32, interpret=False),
                   prefill_blocks(128, 64, torch.float32, interpret=False),
                   prefill_blocks(256, 64, torch.bfloat16, interpret=False)):  # fmt: skip
        assert {t.num_warps for t in (blocks.forward, blocks.dq, blocks.dkdv)} == {8}


# --------------------------------------------------------------------------------------
# 64-bit offsets
# --------------------------------------------------------------------------------------

_RESULT = re.compile(r"^\s*(%[\w.#]+) = (\S+) (.*)$")
_SHAPE_OPS = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape")


def stride_products_in_32_bits(ttir: str) -> list[str]:
    """The TTIR lines that multiply a stride argument (or a splat or broadcast of one) in
    32 bits: offsets that overflow once a tensor holds 2**31 elements."""
    header = next(line for line in ttir.splitlines() if "tt.func public" in line)
    tainted = set(re.findall(r"(%stride_\w+): i32", header))
    found = []
    for line in ttir.splitlines():
        match = _RESULT.match(line)
        if match is None:
            continue
        result, op, rest = match.groups()
        operands, _, types = rest.partition(" : ")
        if not tainted & set(re.findall(r"%[\w.#]+", operands)):
            continue
        if op in _SHAPE_OPS:
            tainted.add(result)
        elif op == "arith.muli" and re.search(r"(?<![\w])i32\b|xi32>", types):
            found.append(line.strip())
    return found


def test_the_stride_check_finds_a_32_bit_product():
    ttir = (
        "  tt.func public @k(%Q: !tt.ptr<f16>, %stride_qn: i32 loc(#loc)) {\n"
        "    %r = tt.get_program_id x : i32 loc(#loc1)\n"
        "    %s = tt.splat %stride_qn : i32 -> tensor<16xi32> loc(#loc2)\n"
        "    %a = arith.muli %r, %stride_qn : i32 loc(#loc3)\n"
        "    %b = arith.muli %t, %s : tensor<16xi32> loc(#loc4)\n"
        "    %c = arith.extsi %stride_qn : i32 to i64 loc(#loc5)\n"
        "    %d = arith.muli %u, %c : i64 loc(#loc6)\n"
    )
    assert [line.split(" =")[0] for line in stride_products_in_32_bits(ttir)] == ["%a", "%b"]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_stride_product_is_64_bit(representative, kernel):
    """No kernel multiplies a stride in 32 bits (the compiled TTIR of the representative
    launch: strides equal to 1 are constants there, as at a launch)."""
    ttir = representative["ttir"][kernel]
    assert "tt.func public" in ttir
    assert stride_products_in_32_bits(ttir) == []


def _largest_offsets(launches) -> dict[str, int]:
    """Per kernel, the largest element offset of any of its tensor arguments."""
    out = {}
    for launch in launches:
        offsets = [sum((n - 1) * s for n, s in zip(a.shape, a.stride(), strict=True))
                   for a in launch.args if isinstance(a, torch.Tensor) and a.numel()]  # fmt: skip
        out[launch.kernel] = max(offsets)
    return out


def _supported_launches():
    """The launches of a prefill and of a decoding step at the supported sizes, built on
    the meta device (shapes and strides only)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(PREFILL_BATCH, HEADS, TOKENS, HEAD_DIM, **meta)
    kv = torch.empty(PREFILL_BATCH, KV_HEADS, TOKENS, HEAD_DIM, **meta)
    groups = torch.empty(PREFILL_BATCH, 1, TOKENS, MAX_KERNEL_GROUPS, device="meta", dtype=torch.bool)  # fmt: skip
    prefill = prefill_launches(q, kv, kv, groups, groups, 512)
    b = DECODE_BATCH
    cache = torch.empty(b, KV_HEADS, TOKENS, HEAD_DIM, **meta)
    buckets = GroupBuckets.empty(b, 1, 8, TOKENS, device="meta")
    routing = torch.empty(b, 1, 1, 8, device="meta", dtype=torch.bool)
    lengths = torch.empty(b, device="meta", dtype=torch.int32)
    call = check_decode(torch.empty(b, HEADS, 1, HEAD_DIM, **meta), cache, cache, routing,
                        buckets, lengths, 512, None, None, None)  # fmt: skip
    out = torch.empty(b, 1, HEADS, HEAD_DIM, **meta)
    lse = torch.empty(b, 1, HEADS, device="meta")
    return prefill + decode_launches(call, out, lse, 128, interpret=False)


def test_offsets_at_the_supported_sizes_exceed_32_bits():
    """At 128K tokens x 32 heads x head size 128 and a batch of 16 (a decoding step: 256
    rows), every kernel but the merge reads a tensor with more than 2**31 elements, so its
    offsets must be 64-bit (what the TTIR test checks); the sizes the kernels still multiply
    in 32 bits (the group layouts' ``N * K + 1`` rows) stay far below."""
    largest = _largest_offsets(_supported_launches())
    assert set(largest) == KERNELS
    assert all(offset >= 2**31 for name, offset in largest.items() if name != "decode_merge")
    assert TOKENS * MAX_KERNEL_GROUPS + 1 < 2**31 // 64


def test_grids_stay_within_the_device_limits_at_the_largest_shapes():
    """Every launch at the supported sizes, and the prefill grids of the largest batch a
    grid takes (65,535, any number of tokens and heads), fit CUDA's grid; one more batch
    element is refused with a clear error instead of a failed launch."""
    for launch in _supported_launches():
        assert all(n <= limit for n, limit in zip(launch.grid, MAX_GRID, strict=False)), launch.kernel  # fmt: skip
    for dim in (16, 64, 128, MAX_HEAD_DIM):
        for heads, kv_heads in ((HEADS, KV_HEADS), (64, 1), (128, 128)):
            blocks = prefill_blocks(dim, heads // kv_heads, torch.bfloat16, interpret=False)
            grids = prefill_grids(MAX_GRID[2], heads, kv_heads, TOKENS, TOKENS, blocks)
            for grid in grids.values():
                assert all(n <= limit for n, limit in zip(grid, MAX_GRID, strict=False))
    with pytest.raises(ValueError, match="batch B = 65,536"):
        prefill_grids(MAX_GRID[2] + 1, HEADS, KV_HEADS, TOKENS, TOKENS, blocks)
