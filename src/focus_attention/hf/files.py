"""On-disk layouts of a Focus adapter and the base-model fingerprint (docs/method.md §8).

Two layouts hold the same adapter:

- the adapter folder written by ``FocusModel.save_pretrained``: :data:`CONFIG_NAME` (the
  :class:`FocusConfig`, a fingerprint of the base model, the library name) and
  :data:`WEIGHTS_NAME` (the router tensors as ``layer.{i}.{name}``, and a copy of the config
  document in the safetensors metadata under :data:`WEIGHTS_CONFIG_METADATA`), written
  together (:func:`write_adapter`) and read back only when they belong together
  (:func:`read_adapter`);
- a ``transformers.Trainer`` output or checkpoint folder, :data:`TRAINER_WEIGHTS_NAME`:
  ``FocusModel.state_dict()`` as the Trainer writes it for a model that is not a
  ``PreTrainedModel`` (``routers.{i}.{name}`` plus :data:`STATE_CONFIG_KEY`, the same JSON
  document as :data:`CONFIG_NAME`, as a uint8 tensor).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ..utils.io import UnreadableFileError, atomic_write_files, read_file_bytes, unreadable
from .architectures import hidden_size
from .config import FocusConfig, parse_config_document

CONFIG_NAME = "focus_config.json"
WEIGHTS_NAME = "focus_model.safetensors"
#: the model card ``FocusModel.save_pretrained`` writes beside the adapter (docs/deploy.md)
CARD_NAME = "README.md"
#: the submodule of a loaded exported model's base that holds its routers (docs/deploy.md)
ATTACHED_ROUTERS = "focus_routers"
#: the weights file ``transformers.Trainer`` writes (``model.state_dict()``)
TRAINER_WEIGHTS_NAME = "model.safetensors"
#: key of the config document in ``FocusModel.state_dict()``
STATE_CONFIG_KEY = "focus_config"
#: key of the safetensors metadata of :data:`WEIGHTS_NAME` that holds a copy of the config
#: document of :data:`CONFIG_NAME` (older adapters: the config without the fingerprint)
WEIGHTS_CONFIG_METADATA = "focus_config"
#: what each file of an adapter holds, for error messages
CONFIG_EXPECTED = "the JSON config of a Focus adapter (written by FocusModel.save_pretrained)"
WEIGHTS_EXPECTED = (
    "the router weights of a Focus adapter (a safetensors file written by "
    "FocusModel.save_pretrained)"
)
TRAINER_EXPECTED = (
    "the state of a FocusModel in a safetensors file (written by transformers.Trainer)"
)
#: elements sampled from each of a few base tensors for the weight fingerprint.
FINGERPRINT_SAMPLE = 4096
#: values of each sampled tensor kept in the fingerprint, compared with a tolerance that
#: admits any float16 / bfloat16 copy of the same weights (relative 2e-2 + absolute 1e-4)
FINGERPRINT_VALUES = 16


class FocusBaseMismatchWarning(UserWarning):
    """The base model differs from the one a Focus adapter was saved with (same structure)."""


def base_model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Identity of a base model, recorded next to saved Focus parameters (docs/method.md §8).

    Returns:
        JSON-able dict: ``model_type``, ``num_hidden_layers``, ``hidden_size``,
        ``num_parameters``, ``parameter_shapes_sha256`` (names and shapes of every
        parameter), ``weights_sha256`` (the first 4096 values of four parameters spread over
        the model, rounded to bfloat16 so a bf16 copy of the same weights matches; None on the
        meta device), ``weights_sample`` (:data:`FINGERPRINT_VALUES` values of each, spread
        over the first 4096, for a comparison that tolerates casts to float16 or bfloat16;
        None on the meta device) and ``sampled_parameters`` (their names). The routers of
        an exported model, which its base model carries as :data:`ATTACHED_ROUTERS`
        (docs/deploy.md), are not part of it.
    """
    cfg = model.config
    attached = ATTACHED_ROUTERS + "."
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith(attached)]
    shapes = hashlib.sha256()
    for name, p in named:
        shapes.update(f"{name}:{tuple(p.shape)}\n".encode())
    picks = sorted({0, len(named) // 3, (2 * len(named)) // 3, len(named) - 1}) if named else []
    sampled = [named[i][0] for i in picks]
    weights: str | None = None
    sample: list[list[float]] | None = None
    if all(named[i][1].device.type != "meta" for i in picks):
        digest, sample = hashlib.sha256(), []
        for i in picks:
            name, p = named[i]
            vals = p.detach().reshape(-1)[:FINGERPRINT_SAMPLE].to(torch.bfloat16).float().cpu()
            digest.update(name.encode())
            digest.update(vals.numpy().tobytes())
            step = max(1, vals.numel() // FINGERPRINT_VALUES)
            sample.append([float(f"{v:.4g}") for v in vals[::step][:FINGERPRINT_VALUES].tolist()])
        weights = digest.hexdigest()
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "hidden_size": hidden_size(cfg),
        "num_parameters": int(sum(p.numel() for _, p in named)),
        "parameter_shapes_sha256": shapes.hexdigest(),
        "weights_sha256": weights,
        "weights_sample": sample,
        "sampled_parameters": sampled,
    }


def _same_weights(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two fingerprints' sampled weights agree: by ``weights_sample`` with the
    tolerance of :data:`FINGERPRINT_VALUES` when both have one, else by ``weights_sha256``;
    True when either side has none (meta device)."""
    a, b = saved.get("weights_sample"), current.get("weights_sample")
    if a is not None and b is not None:
        if [len(r) for r in a] != [len(r) for r in b]:
            return False
        x, y = torch.tensor(sum(a, []), dtype=torch.float64), torch.tensor(sum(b, []))
        return bool(torch.isclose(x, y.double(), rtol=2e-2, atol=1e-4).all())
    a, b = saved.get("weights_sha256"), current.get("weights_sha256")
    return a is None or b is None or a == b


def compare_fingerprints(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Raise on a structural mismatch, warn on same-structure differences.

    Raises:
        ValueError: another ``model_type``, layer count or hidden size.

    Warns:
        FocusBaseMismatchWarning: other parameter names/shapes, or other sampled weights.
    """
    for key in ("model_type", "num_hidden_layers", "hidden_size"):
        if saved.get(key) != current.get(key):
            raise ValueError(
                f"{where}: the Focus adapter was saved for a base model with {key}="
                f"{saved.get(key)!r}, this base model has {key}={current.get(key)!r}"
            )
    if saved.get("parameter_shapes_sha256") != current.get("parameter_shapes_sha256"):
        warnings.warn(
            f"{where}: the base model's parameter names/shapes differ from those the adapter was "
            f"saved with (parameter_shapes_sha256 {saved.get('parameter_shapes_sha256')} vs "
            f"{current.get('parameter_shapes_sha256')}; num_parameters "
            f"{saved.get('num_parameters')} vs {current.get('num_parameters')})",
            FocusBaseMismatchWarning,
            stacklevel=4,
        )
    elif not _same_weights(saved, current):
        warnings.warn(
            f"{where}: the base model has the same shapes but different weights than the one the "
            f"adapter was saved with (weights_sha256 of sampled parameters "
            f"{saved.get('sampled_parameters')}: saved {saved['weights_sha256']}, this base "
            f"{current['weights_sha256']})",
            FocusBaseMismatchWarning,
            stacklevel=4,
        )


def config_document(config: FocusConfig, fingerprint: dict[str, Any]) -> str:
    """The JSON text of :data:`CONFIG_NAME`: the config, the fingerprint, the library."""
    doc = config.to_dict()
    doc["base_model_fingerprint"] = fingerprint
    doc["library"] = "focus_attention"
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def document_to_tensor(text: str) -> torch.Tensor:
    """A JSON document as a uint8 tensor (how it travels inside a state dict)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def tensor_to_document(tensor: torch.Tensor, where: str) -> tuple[FocusConfig, dict[str, Any]]:
    """Inverse of :func:`document_to_tensor` followed by parsing: ``(config, extra)``.

    Raises:
        ValueError: not a uint8 tensor of a valid config document (the message names ``where``).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.ndim != 1:
        raise ValueError(
            f"{where}: {STATE_CONFIG_KEY!r} must be a 1-D uint8 tensor (the config document), "
            f"received {type(tensor).__name__}"
        )
    try:
        text = bytes(tensor.cpu().tolist()).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not a valid Focus config (invalid UTF-8: {err})") from err
    return parse_config_document(text, where)


#: where ``focus sweep`` trains its cells, inside its output folder
SWEEP_CELLS = "cells"


def check_adapter_folder(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a :class:`~pathlib.Path`, refused when it is a file: an adapter is a
    folder (checked before a model loads).

    Raises:
        FileNotFoundError: ``directory`` is a file (the message says a folder is expected
            and, for a file of an adapter, names the folder that holds it).
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        hint = ""
        if directory.name in (CONFIG_NAME, WEIGHTS_NAME, TRAINER_WEIGHTS_NAME):
            hint = f": pass {os.fspath(directory.parent)}, the folder that holds it"
        raise FileNotFoundError(
            f"{directory} is a file, not a folder; expected an adapter folder ({CONFIG_NAME} "
            f"and {WEIGHTS_NAME}) or the folder of a focus train run{hint}"
        )
    return directory


def sweep_hint(directory: str | os.PathLike[str]) -> str:
    """``"; <directory> is the output folder of focus sweep: ..."`` naming one of its cells
    when ``directory`` holds :data:`SWEEP_CELLS` folders, else ``""``: a suffix for the
    error of a folder that holds no adapter."""
    cells = Path(directory) / SWEEP_CELLS
    try:
        found = sorted(p.name for p in cells.iterdir() if p.is_dir())
    except OSError:  # no such folder, or unreadable
        found = []
    if not found:
        return ""
    return (f"; {os.fspath(directory)} is the output folder of focus sweep: pass one of its "
            f"{len(found)} cells, such as {os.fspath(cells / found[0])}")  # fmt: skip


def adapter_layout(directory: Path) -> str:
    """``"adapter"`` or ``"trainer"``: which layout ``directory`` holds.

    Raises:
        FileNotFoundError: ``directory`` is a file (:func:`check_adapter_folder`); neither
            the adapter files nor a Trainer weights file holding a Focus state dict (the
            message names the cells of a ``focus sweep`` output folder).
        UnreadableFileError: a damaged or unreadable Trainer weights file.
    """
    directory = check_adapter_folder(directory)
    if (directory / CONFIG_NAME).exists() or (directory / WEIGHTS_NAME).exists():
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).exists():
                raise FileNotFoundError(f"{directory / name} not found")
        return "adapter"
    trainer = directory / TRAINER_WEIGHTS_NAME
    if trainer.exists():
        if STATE_CONFIG_KEY in safetensors_keys(trainer, TRAINER_EXPECTED):
            return "trainer"
        raise FileNotFoundError(
            f"{trainer} holds no Focus state ({STATE_CONFIG_KEY!r} is missing): not written by a "
            "Trainer from a FocusModel"
        )
    raise FileNotFoundError(
        f"{directory / CONFIG_NAME} not found (a Focus adapter folder holds {CONFIG_NAME} and "
        f"{WEIGHTS_NAME}; a Trainer output folder holds {TRAINER_WEIGHTS_NAME})"
        + sweep_hint(directory)
    )


def weights_file_sha256(directory: str | Path) -> str | None:
    """SHA-256 (hex) of the weights file of the adapter in ``directory``: :data:`WEIGHTS_NAME`,
    else :data:`TRAINER_WEIGHTS_NAME`; None when it holds neither. The file is read whole
    (a Focus adapter is a few MiB)."""
    for name in (WEIGHTS_NAME, TRAINER_WEIGHTS_NAME):
        path = Path(directory) / name
        if path.is_file():
            return hashlib.sha256(path.read_bytes()).hexdigest()
    return None


def to_file_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``routers.{i}.{name}`` state-dict tensors as the adapter file's ``layer.{i}.{name}``
    (detached, CPU, contiguous, 0-d tensors as shape ``[1]``)."""
    out = {}
    for key, t in state.items():
        if not key.startswith("routers."):
            continue
        t = t.detach().cpu().contiguous()
        out["layer." + key[len("routers.") :]] = t.reshape(1) if t.ndim == 0 else t
    return out


def tensor_layers(tensors: dict[str, torch.Tensor]) -> list[int]:
    """The sorted layer indices of adapter-file tensors (``layer.{i}.{name}`` keys)."""
    found = set()
    for key in tensors:
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "layer" and parts[1].isdigit():
            found.add(int(parts[1]))
    return sorted(found)


# --------------------------------------------------------------------------------------------
# reading and writing the files
# --------------------------------------------------------------------------------------------


def safetensors_keys(path: Path, expected: str) -> list[str]:
    """The tensor names of the safetensors file ``path`` (its header only).

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: empty, truncated, garbage, a directory or unreadable; the
            message names the file and ``expected``.
    """
    return list(_open_safetensors(Path(path), expected, tensors=False)[0])


def read_safetensors(path: Path, expected: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of the safetensors file ``path`` (tensors on the CPU).

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: empty, truncated, garbage, a directory or unreadable; the
            message names the file and ``expected``.
    """
    return _open_safetensors(Path(path), expected, tensors=True)


def _open_safetensors(
    path: Path, expected: str, *, tensors: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """``({name: tensor, or None without ``tensors``}, metadata)`` of a safetensors file."""
    if path.is_dir():
        raise unreadable(path, "a directory", expected)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            out = {k: f.get_tensor(k) if tensors else None for k in f.keys()}  # noqa: SIM118
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path} not found; expected {expected}") from err
    except (SafetensorError, OSError, ValueError) as err:
        raise unreadable(path, f"not a readable safetensors file ({err})", expected) from err
    return out, metadata


def read_config(path: Path) -> tuple[FocusConfig, dict[str, Any]]:
    """``(config, extra)`` of the :data:`CONFIG_NAME` file ``path`` (``extra``: the saved
    fingerprint and library name).

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: empty, truncated, not UTF-8 or JSON, invalid settings, another
            ``format_version``, a directory or unreadable (the message names the file).
    """
    raw = read_file_bytes(path, CONFIG_EXPECTED)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise unreadable(path, f"not UTF-8 text ({err.reason})", CONFIG_EXPECTED) from err
    try:
        return parse_config_document(text, str(path))
    except ValueError as err:
        raise UnreadableFileError(f"{err}; expected {CONFIG_EXPECTED}") from err


def read_adapter(directory: Path) -> tuple[FocusConfig, dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, extra, tensors)`` of the adapter folder ``directory``, after checking that
    its two files belong together: the config copy in the weights file's metadata
    (:data:`WEIGHTS_CONFIG_METADATA`) must equal :data:`CONFIG_NAME` (settings and, where the
    copy has one, the base-model fingerprint).

    Raises:
        FileNotFoundError: a file is missing.
        UnreadableFileError: a damaged or unreadable file, or a weights file without the
            config copy (the message names the file).
        ValueError: the two files do not belong together (the message names both and the
            settings that differ).
    """
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    config, extra = read_config(config_path)
    tensors, metadata = read_safetensors(weights_path, WEIGHTS_EXPECTED)
    copy = metadata.get(WEIGHTS_CONFIG_METADATA)
    if copy is None:
        raise unreadable(
            weights_path,
            f"its metadata holds no copy of the adapter's config ({WEIGHTS_CONFIG_METADATA!r})",
            f"{WEIGHTS_EXPECTED}; save the adapter again",
        )
    where = f"{weights_path} (metadata {WEIGHTS_CONFIG_METADATA!r})"
    try:
        saved, saved_extra = parse_config_document(copy, where)
    except ValueError as err:
        raise UnreadableFileError(f"{err}; expected {WEIGHTS_EXPECTED}") from err
    differ = [
        f"{f.name}={getattr(config, f.name)!r} in {CONFIG_NAME}, {getattr(saved, f.name)!r} "
        "in the weights"
        for f in dataclasses.fields(FocusConfig)
        if getattr(config, f.name) != getattr(saved, f.name)
    ]
    fingerprint = saved_extra.get("base_model_fingerprint")
    if fingerprint is not None and fingerprint != extra.get("base_model_fingerprint"):
        differ.append("the base-model fingerprint")
    if differ:
        raise ValueError(
            f"{config_path} and {weights_path} do not belong together: the weights were "
            f"saved with other settings ({'; '.join(differ)}); a save into {directory} was "
            "cut short, or one of the files was copied or edited apart from the other. Save "
            "the adapter again with FocusModel.save_pretrained (to change its settings: load "
            "it, assign focus_config, then save; or focus calibrate --out)"
        )
    return config, extra, tensors


def read_trainer_state(path: Path) -> tuple[FocusConfig, dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, extra, state)`` of a Trainer weights file (:data:`TRAINER_WEIGHTS_NAME`):
    ``state`` is the ``FocusModel.state_dict()`` it holds, config entry included.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: damaged, unreadable, without the config entry, or a config
            entry that is not a valid config (the message names the file).
    """
    state, _ = read_safetensors(path, TRAINER_EXPECTED)
    if STATE_CONFIG_KEY not in state:
        raise unreadable(path, f"no {STATE_CONFIG_KEY!r} entry", TRAINER_EXPECTED)
    try:
        config, extra = tensor_to_document(state[STATE_CONFIG_KEY], f"{path}[{STATE_CONFIG_KEY!r}]")
    except ValueError as err:
        raise UnreadableFileError(f"{err}; expected {TRAINER_EXPECTED}") from err
    return config, extra, state


def write_adapter(
    directory: Path, tensors: dict[str, torch.Tensor], document: str, card: str | None = None
) -> None:
    """Write an adapter folder all-or-nothing (``utils.io.atomic_write_files``):
    :data:`WEIGHTS_NAME` (``tensors``, with ``document`` in its metadata),
    :data:`CONFIG_NAME` (``document``, from :func:`config_document`) and, when ``card`` is
    given, :data:`CARD_NAME` (the model card, docs/deploy.md). ``directory`` is created if
    needed; other files in it are left alone.

    Raises:
        OSError: a write or rename failed (every file is then as it was).
    """
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", WEIGHTS_CONFIG_METADATA: document}
    writes = {
        directory / WEIGHTS_NAME: lambda p: save_file(tensors, str(p), metadata=metadata),
        directory / CONFIG_NAME: lambda p: Path(p).write_text(document, encoding="utf-8"),
    }
    if card is not None:
        writes[directory / CARD_NAME] = lambda p: Path(p).write_text(card, encoding="utf-8")
    atomic_write_files(writes)
