"""This package's Triton kernels compiled ahead of time for CUDA targets, on any machine (no
GPU needed): the *compile table* of every kernel at the configurations its launchers choose,
with the shared memory, registers and spills of each.

**Where the configurations come from.** For each :class:`LaunchShape` (dtype, head size,
query and key-value heads, routing rows, groups, flags, decoding splits) the launchers
themselves build their launches on small CPU tensors of that shape
(:func:`~.triton_prefill.prefill_launches`, :func:`~.triton_decode.decode_launches`: tiles,
warps, stages and compile-time arguments as on CUDA), and Triton's own launch-time
specialisation of those arguments (integers equal to 1, 16-divisible pointers and strides)
gives what a launch of that shape on a device would compile. A tile or flag a launcher adds
is compiled without editing this module; the shapes are :func:`launch_shapes`.

**What is measured.** ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``
(the kernel's TTIR, PTX and cubin), its ``metadata.shared`` bytes against the target's
largest block (:data:`SHARED_MEMORY_LIMITS`), and the wheel's own ``ptxas -v`` on the PTX
(the options Triton assembles with) for registers, stack and spill bytes: a kernel's
``n_regs`` and ``n_spills`` need a driver. A spill is a problem unless
:data:`NAMED_SPILLS` names it with its reason, and shared memory above the target's block
is a problem unless :data:`NAMED_SHARED` names it (a launch Triton then refuses on such a
device, with the error :class:`~.triton_support.KernelLaunch` words).

Command line (compiles with the Triton installed; needs ``TRITON_INTERPRET`` unset):
``python -m focus_attention.ops.sparse.triton_compile [--capability 80 90 ...]
[--set representative|models|full] [--jobs N] [--json FILE]`` prints the table and writes
it as JSON (with versions and hardware); without ``--capability``, the current CUDA
device's, else sm_80 and sm_90. Exit status 1 when a configuration has a problem.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from ...utils.env import environment, library_versions
from ...utils.io import write_json_atomic
from . import triton_decode_kernels, triton_prefill_kernels
from .buckets import GroupBuckets
from .triton_decode import check_decode, decode_launches
from .triton_prefill import prefill_launches
from .triton_support import KernelLaunch, interpreting

__all__ = [
    "NAMED_SHARED",
    "NAMED_SPILLS",
    "SHARED_MEMORY_LIMITS",
    "LaunchShape",
    "NamedSpill",
    "build_parser",
    "compile_launch",
    "compile_table",
    "example_launches",
    "launch_shapes",
    "main",
    "ptxas_usage",
    "record_problems",
    "table_problems",
]

#: the most shared memory one block may use, in bytes, by compute capability (CUDA C++
#: Programming Guide, "Technical Specifications per Compute Capability": 163 KiB on 8.0 and
#: 8.7, 99 KiB on 8.6, 8.9 and 12.x, 227 KiB on 9.0 and 10.x); a device's own figure is
#: ``torch.cuda.get_device_properties(i).shared_memory_per_block_optin``.
SHARED_MEMORY_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
                        90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}  # fmt: skip


@dataclass(frozen=True)
class NamedSpill:
    """A register spill the table accepts, with its reason: the records of ``kernel`` that
    match every other field given (None: any), at most ``max_bytes`` spilled each way (in
    :data:`NAMED_SHARED`: at most ``max_bytes`` of shared memory)."""

    kernel: str
    reason: str
    max_bytes: int
    capabilities: tuple[int, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    block_d: int | None = None
    min_rows: int | None = None  # BLOCK_M (query rows of a tile) at least this

    def applies(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` is of this entry's kernel and every other field given."""
        config = record["config"]
        return (record["kernel"] == self.kernel
                and (self.capabilities is None or record["capability"] in self.capabilities)
                and (self.dtypes is None or record["dtype"] in self.dtypes)
                and (self.block_d is None or config.get("BLOCK_D") == self.block_d)
                and (self.min_rows is None or config.get("BLOCK_M", 0) >= self.min_rows))  # fmt: skip

    def matches(self, record: dict[str, Any]) -> bool:
        """Whether this names ``record``'s spill."""
        spilled = max(record["spill_stores"], record["spill_loads"])
        return self.applies(record) and spilled <= self.max_bytes

    def matches_shared(self, record: dict[str, Any]) -> bool:
        """Whether this names ``record``'s shared memory (an entry of :data:`NAMED_SHARED`)."""
        return self.applies(record) and record["shared"] <= self.max_bytes


_HALF = ("bf16", "fp16")
_PREFILL = ("group_prefill_fwd", "group_prefill_bwd_dq", "group_prefill_bwd_dkdv")
#: the spills the table accepts, with their reasons (any other spill is a problem); every
#: bound is about twice the largest spill the table showed (Triton 3.7, ptxas 12.8 / 13.1)
NAMED_SPILLS: tuple[NamedSpill, ...] = (
    *(NamedSpill(kernel, "sm_80: the prefill tiles are chosen spill-free for sm_90 and sm_100 "
                 "(the H100/H200/B200 this package is measured on); sm_80's mma.sync keeps "
                 "both dot operands in registers beside the 64-bit addresses of the gathered "
                 "rows (at most 3.4 KB at D = 256)", 8192, capabilities=(80,), dtypes=_HALF)
      for kernel in _PREFILL),
    NamedSpill("group_prefill_bwd_dq", "D = 256: the query, output-gradient and dq tiles of "
               "256 columns stay in registers across the key loop; every tile tried spills, "
               "16 rows included (sm_90: 0.65 KB)", 1536, dtypes=_HALF, block_d=256),
    NamedSpill("group_prefill_bwd_dkdv", "64 or more query heads per key-value head (MQA): "
               "a tile needs 64 gathered query rows (sm_90: 44 B at D = 128, 1.2 KB at "
               "D = 256)", 2560, dtypes=_HALF, min_rows=64),
    NamedSpill("group_prefill_bwd_dkdv", "sm_100, D = 64: ptxas 13.1 keeps this 8-warp tile "
               "to 128 registers (44 B); 4 warps spill too", 128, capabilities=(100,),
               dtypes=_HALF, block_d=64),
    *(NamedSpill(kernel, "float32: IEEE fp32 dots run as FMA loops whose operands stay in "
                 "registers (no tensor cores); every tile tried spills, down to 16 x 16 at 8 "
                 "warps (sm_90: up to 0.9 KB at D <= 128, most with 64 query rows; 2.9 KB "
                 "forward and 6.6 KB dq at D = 256, 4.9 and 7.1 KB with 64 query rows at 16 "
                 "warps). A correctness path: half precision is the fast one", 16384,
                 dtypes=("fp32",))
      for kernel in _PREFILL),
    NamedSpill("decode_partials", "float32 on sm_80 and sm_90: up to 24 B (a ptxas choice)",
               64, capabilities=(80, 90), dtypes=("fp32",)),
)  # fmt: skip
#: the shared memory above a target's block the table accepts, with its reasons (any other
#: excess is a problem); such a launch fails on that device with the error
#: :meth:`~.triton_support.KernelLaunch.start` words, naming half precision instead
NAMED_SHARED: tuple[NamedSpill, ...] = (
    NamedSpill("group_prefill_bwd_dkdv", "float32 at D = 256 with 64 or more query heads per "
               "key-value head: a tile holds the 64 gathered query and output-gradient rows "
               "of 256 float32 columns (128 KB) beside its keys and values, 172,032 B in all, "
               "above sm_80's 166,912 B; no smaller tile keeps every head of a query in it. "
               "Half precision fits", 180224, capabilities=(80, 87), dtypes=("fp32",),
               block_d=256, min_rows=64),
)  # fmt: skip
#: the kernels modules, by the ``module`` a shape's launches name
_MODULES = {"prefill": triton_prefill_kernels, "decode": triton_decode_kernels}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class LaunchShape:
    """The shape of one attention call whose kernel launches the table compiles.

    Attributes:
        dtype: the inputs' dtype. head_dim: ``D``. heads, kv_heads: ``H`` and ``H_kv``.
        per_head_routing: one routing row per key-value head (``R = H_kv``), else ``R = 1``.
        num_groups: ``K`` (up to 31 the kernels read int32 codes, above int64).
        softcap, padding: a logit softcap, a key padding mask.
        queries: the decoding call's queries. num_splits: its split count (a merge kernel
            runs when above 1).
    """

    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    per_head_routing: bool = False
    num_groups: int = 8
    softcap: bool = True
    padding: bool = True
    queries: int = 1
    num_splits: int = 16

    def label(self) -> dict[str, Any]:
        """The shape as JSON values."""
        return {**asdict(self), "dtype": _DTYPE_NAMES[self.dtype]}


def launch_shapes(name: str) -> list[LaunchShape]:
    """The shapes of a named set: ``"representative"`` (one: bfloat16, ``D = 128``, 32 query
    and 8 key-value heads, every flag on), ``"models"`` (bfloat16 and float16 at the head
    shapes of SmolLM2-135M, 9/3 heads of 64, and Llama-3-8B, 32/8 heads of 128) or ``"full"``
    (every dtype x head sizes 16, 64, 96, 128 and 256, one of each tile class and one that
    is not a power of two, x one, three and 64 query heads per key-value head, flags on,
    128 decoding splits, and 2 for one head per key-value head; and at the representative
    shape: flags off, one routing per key-value head, 62 groups, 8 decoding queries, 4 to 64
    splits).

    Raises:
        ValueError: another name.
    """
    base = LaunchShape(torch.bfloat16, 128, 32, 8)
    if name == "representative":
        return [base]
    if name == "models":
        heads = ((9, 3, 64), (32, 8, 128))
        return [LaunchShape(dt, d, h, kv) for dt in (torch.bfloat16, torch.float16)
                for h, kv, d in heads]  # fmt: skip
    if name != "full":
        raise ValueError(f"set: received {name!r}, expected 'representative', 'models' or 'full'")
    dims, reps = (16, 64, 96, 128, 256), ((8, 8), (9, 3), (64, 1))
    shapes = [LaunchShape(dt, d, h, kv, num_splits=splits)
              for dt, d, (h, kv), splits in itertools.product(_DTYPE_NAMES, dims, reps, (2, 128))
              if splits == 128 or (h, kv) == (8, 8)]  # fmt: skip
    shapes += [replace(base, softcap=False, padding=False), replace(base, per_head_routing=True),
               replace(base, num_groups=62), replace(base, queries=8)]  # fmt: skip
    shapes += [replace(base, num_splits=s) for s in (4, 8, 32, 64)]
    return shapes


def example_launches(shape: LaunchShape) -> list[tuple[str, KernelLaunch]]:
    """``(module, launch)`` of every kernel launch of ``shape``, as the launchers build them
    for CUDA (tiles and dots of a device; nothing is run): the prefill's forward and
    backward (64 tokens) and a decoding step over a cache of 256 slots."""
    g = torch.Generator().manual_seed(0)
    b, n, capacity, r = 1, 64, 256, shape.kv_heads if shape.per_head_routing else 1

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(shape.dtype)

    def groups(tokens: int) -> torch.Tensor:
        return torch.rand(b, r, tokens, shape.num_groups, generator=g) < 0.3

    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    padding = torch.ones(b, n, dtype=torch.bool) if shape.padding else None
    softcap = 30.0 if shape.softcap else None
    prefill = prefill_launches(randn(b, h, n, d), randn(b, kv, n, d), randn(b, kv, n, d),
                               groups(n), groups(n), 16, softcap=softcap,
                               key_padding_mask=padding)  # fmt: skip
    nq = shape.queries
    cache_padding = torch.ones(b, capacity, dtype=torch.bool) if shape.padding else None
    call = check_decode(randn(b, h, nq, d), randn(b, kv, capacity, d), randn(b, kv, capacity, d),
                        groups(nq), GroupBuckets.from_groups(groups(capacity)),
                        torch.full((b,), capacity, dtype=torch.int32), 16, None, softcap,
                        cache_padding)  # fmt: skip
    out = torch.empty(b, nq, h, d, dtype=shape.dtype)
    lse = torch.empty(b, nq, h, dtype=torch.float32)
    decode = decode_launches(call, out, lse, shape.num_splits, interpret=False)
    return [("prefill", x) for x in prefill] + [("decode", x) for x in decode]


def _specialised(module, launch: KernelLaunch, target: GPUTarget) -> ASTSource:
    """The source Triton's launcher would compile for ``launch`` on ``target``: its binder
    and argument packing (``triton.runtime.jit``) applied to the launch's arguments."""
    fn = getattr(module, launch.kernel)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs, debug=False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constants, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                         options)  # fmt: skip
    return ASTSource(fn, signature, constants, attrs), options


_PTXAS_CACHE: dict[tuple[str, int], dict[str, int]] = {}
_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")
#: tensor-core instructions in PTX: mma (sm_80), wgmma (sm_90), tcgen05 (sm_100)
_TENSOR_CORE = re.compile(r"\b(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\b")


def _ptxas_path(capability: int) -> str:
    """The ptxas that Triton assembles ``sm_<capability>`` with (the wheel's own: Triton 3.4
    and later name it per architecture; earlier versions returned a path and version)."""
    tool = nvidia.get_ptxas(capability)
    return tool.path if hasattr(tool, "path") else tool[0]


def ptxas_usage(ptx: str, capability: int) -> dict[str, int]:
    """Registers per thread, stack frame and spill bytes of a kernel's PTX, from the Triton
    wheel's ``ptxas -v`` with the options Triton assembles with (cached per PTX).

    Raises:
        RuntimeError: ptxas failed (its message).
    """
    key = (hashlib.sha256(ptx.encode()).hexdigest(), capability)
    if key not in _PTXAS_CACHE:
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "kernel.ptx"
            source.write_text(ptx)
            command = [_ptxas_path(capability), "-lineinfo", "-v", "--regAllocOptLevel=2",
                       f"--gpu-name={nvidia.sm_arch_from_capability(capability)}", str(source),
                       "-o", str(source.with_suffix(".cubin"))]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas failed: {done.stderr[-2000:]}")
        spills = _SPILLS.search(done.stderr)
        _PTXAS_CACHE[key] = {
            "registers": int(_USED.search(done.stderr).group(1)),
            "stack": int(_STACK.search(done.stderr).group(1)),
            "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2)),
        }
    return _PTXAS_CACHE[key]


@dataclass
class _Compiled:
    """One compiled launch: its record (JSON values) and its TTIR."""

    record: dict[str, Any]
    ttir: str = field(repr=False, default="")


_COMPILED: dict[tuple, _Compiled] = {}


def compile_launch(module_name: str, launch: KernelLaunch, capability: int) -> _Compiled:
    """Compile one launch for ``sm_<capability>`` (cached per kernel, specialisation and
    options within the process; Triton's own cache keeps the binaries across processes).
    The record holds the kernel, its compile-time arguments and launch options, the target,
    shared bytes, registers, stack and spill bytes, the tensor-core instructions of its PTX,
    and ``error`` (None, or why it did not compile)."""
    target = GPUTarget("cuda", capability, 32)
    source, options = _specialised(_MODULES[module_name], launch, target)
    key = (launch.kernel, str(source.signature), str(source.constants), str(source.attrs),
           str(sorted(options.__dict__.items())), capability)  # fmt: skip
    if key in _COMPILED:
        return _COMPILED[key]
    constants = {k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages")}
    record = {"kernel": launch.kernel, "target": f"sm_{capability}", "capability": capability,
              "config": {**constants, "num_warps": options.num_warps,
                         "num_stages": options.num_stages},
              "shared": None, "registers": None, "stack": None, "spill_stores": None,
              "spill_loads": None, "tensor_core_ops": None, "error": None}  # fmt: skip
    compiled = _Compiled(record)
    try:
        kernel = triton.compile(source, target=target, options=options.__dict__)
        ptx = kernel.asm["ptx"]
        record.update(shared=kernel.metadata.shared, tensor_core_ops=len(_TENSOR_CORE.findall(ptx)),
                      **ptxas_usage(ptx, capability))  # fmt: skip
        compiled.ttir = kernel.asm["ttir"]
    except Exception as err:  # a configuration that does not compile is a row of the table
        record["error"] = f"{type(err).__name__}: {str(err)[-1500:]}"
    _COMPILED[key] = compiled
    return compiled


def _shape_records(shape: LaunchShape, capability: int) -> list[dict[str, Any]]:
    """The records of every launch of ``shape`` for one target (see :func:`compile_table`)."""
    rows = []
    for module_name, launch in example_launches(shape):
        record = dict(compile_launch(module_name, launch, capability).record)
        record.update(dtype=_DTYPE_NAMES[shape.dtype], head_dim=shape.head_dim, shape=shape.label())
        record["problems"] = record_problems(record)
        rows.append(record)
    return rows


def record_problems(record: dict[str, Any]) -> list[str]:
    """What is wrong with one record: no compilation, shared memory above the target's
    limit not named in :data:`NAMED_SHARED`, a spill not named in :data:`NAMED_SPILLS`."""
    if record["error"] is not None:
        return [f"does not compile: {record['error'].splitlines()[0][:300]}"]
    found = []
    limit = SHARED_MEMORY_LIMITS.get(record["capability"])
    record["named_shared"] = None
    if limit is not None and record["shared"] > limit:
        record["named_shared"] = next((n.reason for n in NAMED_SHARED if n.matches_shared(record)), None)  # fmt: skip
        if record["named_shared"] is None:
            found.append(f"shared memory {record['shared']:,} B > the target's {limit:,} B")
    named = None
    if record["spill_stores"] or record["spill_loads"]:
        named = next((n.reason for n in NAMED_SPILLS if n.matches(record)), None)
        if named is None:
            found.append(f"spills {record['spill_stores']} B stored / {record['spill_loads']} "
                         "B loaded, not named in NAMED_SPILLS")  # fmt: skip
    record["named_spill"] = named
    return found


def compile_table(shapes: Iterable[LaunchShape], capabilities: Sequence[int], *,
                  jobs: int = 1) -> list[dict[str, Any]]:  # fmt: skip
    """The compile table: one record per launch of each shape and target, identical
    compilations compiled once (see the module docstring for the record's fields;
    ``problems`` lists what fails, :func:`table_problems` gathers them). ``jobs > 1``
    compiles in that many processes.

    Raises:
        RuntimeError: Triton's interpreter is on (``TRITON_INTERPRET=1``): nothing compiles.
    """
    if interpreting():
        raise RuntimeError("the compile table needs TRITON_INTERPRET unset (kernels defined "
                           "under Triton's interpreter do not compile)")  # fmt: skip
    work = [(shape, cc) for cc in capabilities for shape in shapes]
    if jobs <= 1:
        return [row for shape, cc in work for row in _shape_records(shape, cc)]
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        parts = pool.map(_shape_records, *zip(*work, strict=True))
        return [row for part in parts for row in part]


def table_problems(table: list[dict[str, Any]]) -> list[str]:
    """Every problem of the table, one line each naming the kernel, target and shape."""
    return [f"{row['kernel']} {row['target']} {row['dtype']} D={row['head_dim']} "
            f"H={row['shape']['heads']}/{row['shape']['kv_heads']}: {problem}"
            for row in table for problem in row["problems"]]  # fmt: skip


def _summary_line(row: dict[str, Any]) -> str:
    """One printed row of the table."""
    config = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                      for k, v in row["config"].items())  # fmt: skip
    if row["error"] is not None:
        return f"{row['kernel']:24} {row['target']:7} {row['dtype']:5} {row['head_dim']:4} ERROR"
    spills = f"{row['spill_stores']}/{row['spill_loads']}"
    flag = "  ! " + "; ".join(row["problems"]) if row["problems"] else ""
    return (f"{row['kernel']:24} {row['target']:7} {row['dtype']:5} {row['head_dim']:4} "
            f"{row['shared']:>7} {row['registers']:>4} {spills:>7}  {config}{flag}")  # fmt: skip


def _default_capabilities() -> list[int]:
    """The current CUDA device's compute capability, else sm_80 and sm_90."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return [10 * major + minor]
    return [80, 90]


def build_parser() -> argparse.ArgumentParser:
    """The command line of the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m focus_attention.ops.sparse.triton_compile",
                                     description="Compile this package's Triton kernels for "
                                     "CUDA targets and print the compile table.")  # fmt: skip
    parser.add_argument("--capability", type=int, nargs="+", metavar="CC",
                        help="compute capabilities, e.g. 80 90 100 (default: the CUDA device's, "
                        "else 80 90)")  # fmt: skip
    parser.add_argument("--set", default="representative",
                        choices=("representative", "models", "full"), help="which shapes")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="compiling processes (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of the module docstring; 0 when every configuration compiles within
    the limits, 1 otherwise."""
    args = build_parser().parse_args(argv)
    capabilities = args.capability or _default_capabilities()
    table = compile_table(launch_shapes(args.set), capabilities, jobs=args.jobs)
    print(f"{'kernel':24} {'target':7} {'dtype':5} {'D':>4} {'shared':>7} {'regs':>4} "
          f"{'spills':>7}  config (spills: bytes stored/loaded)")  # fmt: skip
    for row in table:
        print(_summary_line(row))
    problems = table_problems(table)
    print(f"{len(table)} launches, {len(problems)} problems", *problems, sep="\n")
    if args.json:
        record = {"set": args.set, "capabilities": capabilities, "environment": environment(),
                  "versions": library_versions(("torch", "triton")), "table": table,
                  "problems": problems}  # fmt: skip
        write_json_atomic(args.json, record)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
