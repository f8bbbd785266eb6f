"""``focus export``: a Focus model as a self-contained Hugging Face model directory that
``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)``, ``pipeline`` and
lm-eval's ``hf`` model load with Focus active (docs/deploy.md). The directory is built under
a temporary name beside ``out`` and renamed into place: a failed export leaves ``out`` as it
was."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from ..assets.models import load_model
from ..hf.card import (
    TRAIN_RESULT_NAME,
    adapter_digest,
    base_model_name,
    export_card,
    is_record_of,
    model_records,
)
from ..hf.files import ATTACHED_ROUTERS, CARD_NAME, base_model_fingerprint, weights_file_sha256
from ..hf.model import FocusModel
from ..hf.run_folder import LORA_DIR, MODEL_DIR, run_parts
from ..utils.io import TRAIN_CONFIG_NAME, replace_entries, staged_directory
from .settings import (
    AUTO_MAP,
    BASE_CONFIG_KEY,
    BASE_NAME_KEY,
    EXPORT_FORMAT_VERSION,
    EXPORT_MODEL_TYPE,
    FORMAT_KEY,
    REMOTE_CODE_NAME,
    SETTING_FIELDS,
    SETTINGS_KEY,
    ExportConfig,
)

__all__ = ["export_adapter", "export_model", "plain_modes", "save_loaded_export", "write_records"]

#: the keys of the base model's ``config.json`` that describe the saved checkpoint rather
#: than the model, kept at the top level of the export's ``config.json`` too
SHARED_KEYS = ("dtype", "transformers_version")


def check_out(out: Path, overwrite: bool, sources: tuple[Any, ...] = ()) -> None:
    """Refuse an ``out`` that is a file, one of ``sources`` (the adapter or model being
    exported), or a non-empty directory without ``overwrite``.

    Raises:
        FileExistsError: a non-empty directory and ``overwrite`` is False; a file.
        ValueError: ``out`` is one of ``sources``.
    """
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: give a directory")
    for source in sources:
        if source is not None and Path(source).exists() and out.resolve() == Path(source).resolve():  # fmt: skip
            raise ValueError(f"--out {out} is the source {source}: export elsewhere")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"--out {out} is not empty: pass overwrite=True (--overwrite on the command line) "
            "to replace it"
        )


def check_focus_model(model: Any) -> None:
    """Refuse, before anything is written, a ``model`` that is not a FocusModel.

    Raises:
        TypeError: naming what was received and what to pass instead.
    """
    if isinstance(model, FocusModel):
        return
    if isinstance(getattr(model, "focus_model", None), FocusModel):
        raise TypeError(
            f"export_model: received a {type(model).__name__} loaded from an exported "
            "directory; pass its FocusModel, model.focus_model"
        )
    raise TypeError(
        f"export_model: received a {type(model).__name__}, expected a FocusModel "
        "(get_focus_model(base, config) or FocusModel.from_pretrained(base, adapter))"
    )


def export_document(base_document: dict[str, Any], focus_config: Any, base_name: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The export's ``config.json``: model type :data:`EXPORT_MODEL_TYPE`, the ``auto_map``,
    the layout version, the inference settings of ``focus_config`` (:data:`SETTING_FIELDS`)
    in the table :data:`SETTINGS_KEY`, the base model's name ``base_name`` (when known)
    and the base model's config (``base_document``, its ``config.json``). It names no
    ``architectures``: tools that find the class there look it up among transformers' own
    (``transformers serve`` does), while without it they go through
    ``AutoModelForCausalLM`` and the ``auto_map``."""
    settings = focus_config.to_dict()
    return {
        "model_type": EXPORT_MODEL_TYPE,
        "auto_map": dict(AUTO_MAP),
        FORMAT_KEY: EXPORT_FORMAT_VERSION,
        SETTINGS_KEY: {name: settings[name] for name in SETTING_FIELDS},
        **({BASE_NAME_KEY: base_name} if base_name else {}),
        **{key: base_document[key] for key in SHARED_KEYS if key in base_document},
        BASE_CONFIG_KEY: base_document,
    }


def write_records(directory: Path, records: dict[str, Any]) -> None:
    """Write into ``directory`` (an export being built) the records of its adapter, so that
    they travel with it: the training record and result, and the ``focus eval`` documents
    of the adapter written there (:func:`~focus_attention.hf.card.is_record_of`: by its
    digest; an evaluation of other settings is not its), each under its own file name,
    none over a file already there."""
    digest, weights = adapter_digest(directory), weights_file_sha256(directory)
    files = [(TRAIN_CONFIG_NAME, records.get("train_config")),
             (TRAIN_RESULT_NAME, records.get("train_result"))]  # fmt: skip
    files += [(name, doc) for name, doc in records.get("evals") or []
              if is_record_of(doc, digest, weights)]  # fmt: skip
    for name, doc in files:
        if doc is not None and not (directory / name).exists():
            (directory / name).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def export_model(
    model: Any,
    out: str | os.PathLike,
    tokenizer: Any = None,
    *,
    overwrite: bool = False,
    base_name: str | None = None,
) -> Path:
    """Write ``model`` (a :class:`~focus_attention.hf.FocusModel`) as a model directory
    any transformers tool loads with Focus active (docs/deploy.md): the base model's
    weights and generation config (its ``save_pretrained``), the Focus adapter
    (``focus_config.json``, ``focus_model.safetensors``) with its training and evaluation
    records (:func:`write_records`), the tokenizer, ``config.json``
    (:func:`export_document`), ``modeling_focus.py`` and a model card (``README.md``).

    Load it with ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)``
    (keywords ``top_k=``, ``window=``, ``dense_layers=``... change the settings), or
    ``pipeline("text-generation", out, trust_remote_code=True)``.

    Args:
        model: the FocusModel; its current :attr:`~FocusModel.focus_config` is exported.
        out: the directory, created or (with ``overwrite``) replaced as a whole.
        tokenizer: saved beside the model when given.
        overwrite: replace a non-empty ``out``.
        base_name: how the model card names the base model (default: the name in the
            adapter's training record, else its config's ``name_or_path``). The card
            reports the training and ``focus eval`` records of the adapter folder the model
            was loaded from, while its routers are unchanged since.

    Returns:
        ``out`` as a Path.

    Raises:
        TypeError: ``model`` is not a FocusModel (a model loaded from an export: pass its
            ``focus_model``).
        FileExistsError: ``out`` is a file, or a non-empty directory without ``overwrite``.
        OSError: a write failed (``out`` is then as it was).
    """
    check_focus_model(model)
    out = Path(out)
    check_out(out, overwrite)
    records = model_records(model)
    name = base_name or base_model_name(model, records)
    with staged_directory(out, out.parent, f".{out.name}.export-") as stage:
        write_export(model, stage, tokenizer, name=name, records=records, location=str(out))
    return out


def write_export(model: FocusModel, directory: Path, tokenizer: Any = None, *, name: str,
                 records: Any, location: str, state_dict: dict[str, Any] | None = None,
                 save_kwargs: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Fill the empty ``directory`` with the files of an export of ``model``
    (:func:`export_model`): the base model's ``save_pretrained`` (of its class, with
    ``state_dict`` when given and ``save_kwargs``; the routers of a loaded export left out),
    the adapter and its records (:func:`write_records`), the tokenizer when given,
    ``config.json``, ``modeling_focus.py`` and the model card (naming the base model
    ``name`` and the directory ``location``, reporting ``records``)."""
    base = model.base_model
    type(base).save_pretrained(base, directory, state_dict=_base_state(base, state_dict),
                               **(save_kwargs or {}))  # fmt: skip
    model.save_pretrained(directory, model_card=False)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    write_records(directory, records)
    base_doc = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    doc = export_document(base_doc, model.focus_config, name)
    (directory / "config.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    shutil.copyfile(Path(__file__).with_name(REMOTE_CODE_NAME), directory / REMOTE_CODE_NAME)
    card = export_card(model.focus_config.to_dict(), base_model_fingerprint(base),
                       base_name=name, records=records, location=location,
                       settings_table=SETTINGS_KEY)  # fmt: skip
    (directory / CARD_NAME).write_text(card, encoding="utf-8")
    plain_modes(directory)


def save_loaded_export(model: Any, save_directory: str | os.PathLike, *, is_main_process: bool = True,
                       state_dict: dict[str, Any] | None = None, push_to_hub: bool = False,
                       **kwargs: Any) -> None:  # fmt: skip
    """``save_pretrained`` of a model loaded from an exported directory (the base model's
    class with Focus attached, :func:`~focus_attention.deploy.loading.load_exported`): a
    complete export of it (:func:`write_export`: the base weights without the routers, the
    adapter, the inference settings it runs with, the custom code, a model card) that loads
    with Focus again. The files are staged in ``save_directory`` and moved into place all
    together, replacing those of the same names (a tokenizer saved there stays; weight
    files of another sharding are removed).

    Args:
        model: the loaded model (its ``focus_model`` is the FocusModel).
        save_directory: the folder (created when missing).
        is_main_process: False writes nothing (transformers' distributed convention).
        state_dict: the model's state dict to save (what ``transformers.Trainer`` passes);
            the routers in it are left out of the base weights.
        push_to_hub: refused (see Raises).
        kwargs: passed to the base class's ``save_pretrained`` (``max_shard_size``,
            ``safe_serialization``...).

    Raises:
        ValueError: ``push_to_hub=True``: save, then upload the folder
            (``model.push_to_hub(repo_id)`` uploads such an export).
        FileExistsError: ``save_directory`` is a file.
        OSError: a write failed (``save_directory`` is then as it was).
    """
    if push_to_hub:
        raise ValueError(
            "save_pretrained(push_to_hub=True) of an exported Focus model: save it first, then "
            "upload the folder (model.push_to_hub(repo_id) uploads the complete export, or hf "
            "upload REPO FOLDER)"
        )
    out = Path(save_directory)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"save_pretrained: {out} is a file; expected a folder")
    if not is_main_process:
        return
    out.mkdir(parents=True, exist_ok=True)
    focus = model.focus_model
    records = model_records(focus)
    with tempfile.TemporaryDirectory(prefix=".save-", dir=out) as tmp:
        write_export(focus, Path(tmp), name=base_model_name(focus, records), records=records,
                     location=str(out), state_dict=state_dict, save_kwargs=kwargs)  # fmt: skip
        new = {p.name for p in Path(tmp).iterdir()}
        replace_entries(tmp, out)
    _remove_other_weights(out, new)


def _remove_other_weights(directory: Path, kept: set[str]) -> None:
    """Remove the weight files of ``directory`` not in ``kept`` (an earlier save's other
    sharding, which a loader could take for the new weights)."""
    for path in directory.iterdir():
        weights = path.name.startswith(("model", "pytorch_model")) and (
            ".safetensors" in path.name or ".bin" in path.name
        )
        if weights and path.is_file() and path.name not in kept:
            path.unlink()


def plain_modes(directory: Path) -> None:
    """Give every file of ``directory`` the mode ``open()`` gives a new file there (``0o666``
    less the umask, typically ``0o644``): transformers writes ``model.safetensors`` through
    a private temporary file (``0o600``), which other users of a shared export could not
    read."""
    probe = directory / ".mode-probe"
    probe.open("x").close()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def _base_state(base: Any, state_dict: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The state dict to save for ``base`` (``state_dict`` when given, else None: its own)
    without the routers a loaded export carries (:data:`~focus_attention.hf.files.
    ATTACHED_ROUTERS`), which go to the adapter file."""
    if state_dict is None and ATTACHED_ROUTERS not in dict(base.named_children()):
        return None
    prefix = ATTACHED_ROUTERS + "."
    state = base.state_dict() if state_dict is None else state_dict
    return {k: v for k, v in state.items() if not k.startswith(prefix)}


def export_adapter(config: ExportConfig) -> Path:
    """``focus export``: load ``config.model`` and the adapter ``config.adapter`` (a folder
    or a hub repo id), apply the settings ``config`` overrides, and :func:`export_model`
    them with the model's tokenizer into ``config.out``.

    Raises:
        ValueError: a ``focus train`` run that trained LoRA or base weights (an export
            holds the base model and the Focus routers only).
        FileExistsError, FileNotFoundError: as :func:`export_model` and
            :meth:`FocusModel.from_pretrained` raise them.
    """
    out = Path(config.out)
    check_out(out, config.overwrite, (config.adapter, config.model))
    _check_focus_only(config.adapter)
    base, tokenizer = load_model(config.model, quiet=True)
    focus = FocusModel.from_pretrained(base, config.adapter)
    focus.focus_config = focus.focus_config.override(**config.overrides())
    return export_model(focus, out, tokenizer, overwrite=config.overwrite, base_name=config.model)


def _check_focus_only(adapter: str) -> None:
    """Refuse a run folder that holds more than a Focus adapter (LoRA in ``lora/``, trained
    base weights in ``model/``): the export would silently leave it out."""
    parts = run_parts(adapter) if Path(adapter).is_dir() else {}
    extra = [f"{LORA_DIR}/ (LoRA)" if n == "lora" else f"{MODEL_DIR}/ (trained base weights)"
             for n in ("lora", "model") if parts.get(n)]  # fmt: skip
    if extra:
        raise ValueError(
            f"--adapter {adapter} holds {' and '.join(extra)} besides the Focus routers: focus "
            "export writes a base model with a Focus adapter only (export a run of focus train "
            "--method focus)"
        )
