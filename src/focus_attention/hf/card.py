"""Model cards (``README.md``) of a Focus adapter folder and of an exported model
(docs/deploy.md): the base model, the Focus settings, the training data and the numbers the
adapter's records hold (``train_config.json``, ``train_result.json`` of ``focus train``, the
JSON of ``focus eval``); only numbers that a record holds are reported.

A card this package wrote starts with YAML metadata (``library_name: focus-attention``) and
carries :data:`CARD_MARKER`; a ``README.md`` without the marker is someone's own and is never
replaced (:func:`card_replaceable`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData

from ..utils.io import TRAIN_CONFIG_NAME, atomic_write_text
from .config import INFERENCE_SETTINGS, FocusConfig, read_config_file
from .files import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, read_adapter, weights_file_sha256

__all__ = [
    "CARD_MARKER",
    "adapter_digest",
    "is_record_of",
    "CARD_NAME",
    "adapter_card",
    "adapter_card_of",
    "base_model_name",
    "card_settings",
    "card_replaceable",
    "export_card",
    "model_records",
    "read_records",
    "refresh_card",
    "remember_base_name",
    "remember_source",
    "routers_digest",
    "setting_keywords_line",
]

#: the line that marks a card as written by this package (rewritten on every save)
CARD_MARKER = "<!-- focus-attention model card: rewritten by every save; delete this line to keep your own edits -->"  # fmt: skip
#: attribute (in a FocusModel's ``__dict__``) holding ``(folder, routers_digest)`` of the
#: adapter folder it was loaded from (:func:`remember_source`)
SOURCE_ATTR = "_focus_adapter_source"
#: the manifest of a model prepared by ``focus models prepare`` (it holds the model's name)
MANIFEST_NAME = "focus-manifest.json"
#: the record ``focus train`` writes at the end of a run
TRAIN_RESULT_NAME = "train_result.json"
#: a hub repo id (``org/name``), the only form the card's ``base_model`` metadata takes
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
#: attribute (in a FocusModel's ``__dict__``) holding the name of its base model as a record
#: it was loaded from gives it (an exported model's ``config.json``): :func:`remember_base_name`
BASE_NAME_ATTR = "_focus_base_model_name"
#: the trained shapes the card's settings table lists before the inference settings (the
#: FocusConfig fields whose declaration marks them ``"card"``)
TRAINED_SETTINGS = tuple(f.name for f in fields(FocusConfig) if f.metadata.get("card"))


def card_settings() -> tuple[str, ...]:
    """The Focus settings the card's table lists, in order: the trained shapes
    (:data:`TRAINED_SETTINGS`), then every inference setting
    (:data:`~focus_attention.hf.config.INFERENCE_SETTINGS`, in its order)."""
    return (*TRAINED_SETTINGS, *INFERENCE_SETTINGS)


def card_replaceable(directory: str | os.PathLike) -> bool:
    """Whether a card may be written into ``directory``: it holds no ``README.md``, or one
    this package wrote (it carries :data:`CARD_MARKER`)."""
    path = Path(directory) / CARD_NAME
    if not path.exists():
        return True
    try:
        return CARD_MARKER in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def routers_digest(tensors: dict[str, Any]) -> str:
    """SHA-256 (hex) of adapter-file router tensors (``FocusModel.focus_state_dict()``):
    whether the routers changed since an adapter was loaded."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def adapter_digest(directory: str | os.PathLike) -> str | None:
    """SHA-256 (hex) of what the adapter in ``directory`` is: its router tensors
    (:func:`routers_digest`) and its settings (``focus_config.json`` without the base
    model's fingerprint); None where the folder holds no readable adapter. Not the digest
    of its files' bytes: a save writes the same adapter with other bytes (the order of the
    weights file's metadata varies), and a record of it must stay its record."""
    try:
        config, _, tensors = read_adapter(Path(directory))
    except (OSError, ValueError):
        return None
    digest = hashlib.sha256(routers_digest(tensors).encode())
    digest.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    return digest.hexdigest()


def _json(path: Path) -> Any:
    """The JSON document of ``path``, or None when it is missing or not readable JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_record_of(doc: Any, digest: str | None, weights: str | None) -> bool:
    """Whether ``doc`` is a ``focus eval`` record of the adapter whose
    :func:`adapter_digest` is ``digest`` (its ``config.adapter_sha256``) or, for a record
    that has none, whose weights file's SHA-256 is ``weights`` (its
    ``config.adapter_weights_sha256``: a byte copy of the folder)."""
    if not (isinstance(doc, dict) and isinstance(doc.get("ppl"), dict) and isinstance(doc.get("config"), dict)):  # fmt: skip
        return False
    config = doc["config"]
    if config.get("adapter_sha256") is not None:
        return digest is not None and config["adapter_sha256"] == digest
    return weights is not None and config.get("adapter_weights_sha256") == weights


def read_records(directory: str | os.PathLike) -> dict[str, Any]:
    """The records of the adapter in ``directory`` that a card reports: ``train_config``
    and ``train_result`` (dicts or None) and ``evals``, the ``focus eval`` documents among
    its ``*.json`` files that are records of the adapter there now (:func:`is_record_of`:
    by its digest), sorted by file name. A record is the adapter's whatever path it was
    evaluated under: it travels with a copy of the folder, while an evaluation of an
    earlier adapter in the same folder is not reported. An older record, matched by the
    weights file's SHA-256 alone, is returned with the adapter's digest (so that it stays the
    adapter's in a copy an export writes). Unreadable files are skipped."""
    directory = Path(directory)
    out: dict[str, Any] = {"train_config": None, "train_result": None, "evals": []}
    for key, name in (("train_config", TRAIN_CONFIG_NAME), ("train_result", TRAIN_RESULT_NAME)):
        doc = _json(directory / name)
        out[key] = doc if isinstance(doc, dict) else None
    paths = sorted(p for p in directory.glob("*.json") if p.name not in (CONFIG_NAME, TRAIN_CONFIG_NAME, TRAIN_RESULT_NAME))  # fmt: skip
    if not paths:
        return out
    digest, weights = adapter_digest(directory), weights_file_sha256(directory)
    for path in paths:
        doc = _json(path)
        if is_record_of(doc, digest, weights):
            if doc["config"].get("adapter_sha256") is None:  # an older record: now known
                doc = {**doc, "config": {**doc["config"], "adapter_sha256": digest}}
            out["evals"].append((path.name, doc))
    return out


def remember_source(model: Any, directory: str | os.PathLike) -> None:
    """Note on ``model`` (a FocusModel just loaded from the adapter folder ``directory``)
    where it came from and the digest of its routers, so that its cards can report the
    folder's records while the routers stay as loaded (:func:`model_records`)."""
    model.__dict__[SOURCE_ATTR] = (Path(directory), routers_digest(model.focus_state_dict()))


def model_records(model: Any, directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """:func:`read_records` of ``directory`` (where ``model`` is being saved) and, for what
    it lacks, of the folder ``model`` was loaded from when its routers are unchanged since
    (:func:`remember_source`): records of other router weights are not reported."""
    folders = [Path(directory)] if directory is not None else []
    source = model.__dict__.get(SOURCE_ATTR)
    if source is not None and routers_digest(model.focus_state_dict()) == source[1]:
        folders.append(source[0])
    merged: dict[str, Any] = {"train_config": None, "train_result": None, "evals": []}
    for folder in folders:
        found = read_records(folder)
        for key in ("train_config", "train_result"):
            merged[key] = merged[key] or found[key]
        merged["evals"] = merged["evals"] or found["evals"]
    return merged


def remember_base_name(model: Any, name: Any) -> None:
    """Note on ``model`` (a FocusModel) the name of its base model that a record gives (an
    exported model's ``config.json``, whose base model was loaded from the export's own
    folder), for :func:`base_model_name`; a name that is not a non-empty string is
    ignored."""
    if isinstance(name, str) and name:
        model.__dict__[BASE_NAME_ATTR] = name


def base_model_name(model: Any, records: dict[str, Any]) -> str | None:
    """How a card names the base model of ``model``: the ``model`` of its training record,
    else the name a record it was loaded from gives (:func:`remember_base_name`), else the
    name in the manifest of a prepared model's folder, else the base config's
    ``name_or_path``; None when none is known."""
    trained = (records.get("train_config") or {}).get("model")
    if isinstance(trained, str) and trained:
        return trained
    if model.__dict__.get(BASE_NAME_ATTR):
        return model.__dict__[BASE_NAME_ATTR]
    path = getattr(model.base_model.config, "name_or_path", "") or ""
    manifest = _json(Path(path) / MANIFEST_NAME) if path else None
    if isinstance(manifest, dict) and isinstance(manifest.get("name"), str):
        return manifest["name"]
    return path or None


def adapter_card_of(
    model: Any, directory: str | os.PathLike, settings: dict[str, Any], fingerprint: dict[str, Any]
) -> str | None:
    """The card ``model.save_pretrained(directory)`` writes (:func:`adapter_card` with
    :func:`model_records` and :func:`base_model_name`), or None when ``directory`` holds
    a ``README.md`` of someone else's (:func:`card_replaceable`)."""
    if not card_replaceable(directory):
        return None
    records = model_records(model, directory)
    return adapter_card(settings, fingerprint, base_name=base_model_name(model, records),
                        records=records)  # fmt: skip


#: the title line of an adapter's card (:func:`adapter_card`), which names its base model
_TITLE = re.compile(r"^# Focus adapter for (.+)$", re.MULTILINE)


def refresh_card(directory: str | os.PathLike) -> bool:
    """Rewrite the card of the adapter folder ``directory`` from its files, so that it
    reports the records beside the adapter now (a ``focus eval`` record written after the
    adapter was saved): the settings and fingerprint of its :data:`CONFIG_NAME`, the
    records of :func:`read_records`, the base model named by the training record or by the
    card it replaces. Nothing is written where the folder holds no readable adapter or a
    ``README.md`` this package did not write. Returns whether the card was written."""
    directory = Path(directory)
    if not (directory / WEIGHTS_NAME).is_file() or not card_replaceable(directory):
        return False
    try:
        config, extra = read_config_file(directory / CONFIG_NAME)
        old = (directory / CARD_NAME).read_text(encoding="utf-8") if (directory / CARD_NAME).exists() else ""  # fmt: skip
    except (OSError, ValueError):
        return False
    records = read_records(directory)
    name = (records["train_config"] or {}).get("model")
    if not isinstance(name, str) or not name:
        title = _TITLE.search(old)
        name = title.group(1).strip() if title and title.group(1) != "its base model" else None
    card = adapter_card(config.to_dict(), extra.get("base_model_fingerprint") or {},
                        base_name=name, records=records)  # fmt: skip
    atomic_write_text(directory / CARD_NAME, card)
    return True


def _number(value: Any, digits: int = 3) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else "-"


def _training_lines(records: dict[str, Any]) -> list[str]:
    """The card's training section: data and run settings, and the run's result."""
    cfg, result = records["train_config"], records["train_result"]
    if cfg is None and result is None:
        return ["No training record (`train_config.json`) was found beside this adapter."]
    lines = []
    if cfg is not None:
        keys = ("model", "corpus", "method", "steps", "seq_len", "batch_size", "lr", "objective")
        lines.append("| setting | value |\n|---|---|")
        lines += [f"| {k} | `{cfg[k]}` |" for k in keys if cfg.get(k) is not None]
    if result is not None:
        lines.append("")
        done = [f"steps run: {result['steps']}"] if isinstance(result.get("steps"), int) else []
        if isinstance(result.get("final_loss"), (int, float)):
            done.append(f"final training loss: {_number(result['final_loss'], 4)}")
        validation = [v for v in result.get("validation") or [] if isinstance(v, dict)]
        if validation:
            last = validation[-1]
            for key in ("val_ppl_base", "val_ppl_soft", "val_ppl_topk"):
                if isinstance(last.get(key), (int, float)):
                    done.append(f"{key} at step {last.get('step')}: {_number(last[key])}")
        lines.append("; ".join(done) + "." if done else "")
    return lines


def _eval_lines(records: dict[str, Any]) -> list[str]:
    """The card's evaluation section: one table row per setting of each ``focus eval``
    record (perplexity and, for top-k, the share of attention pairs kept)."""
    if not records["evals"]:
        return ["No `focus eval` record of this adapter was found beside it."]
    lines = ["| record | text | tokens per window | tokens | routing | perplexity | pairs kept |",
             "|---|---|---:|---:|---|---:|---:|"]  # fmt: skip
    for name, doc in records["evals"]:
        cfg, ppl = doc["config"], doc["ppl"]
        changed = [f"{k} {v}" for k, v in (cfg.get("overrides") or {}).items() if v is not None]
        text = f"{cfg.get('corpus', '?')} ({cfg.get('split', '?')})"
        text += f", with {', '.join(changed)}" if changed else ""
        head = f"| `{name}` | {text} | {cfg.get('seq_len', '-')} | {doc.get('tokens', '-')} |"
        rows = [("base (dense)", ppl.get("base"), None), ("Focus soft", ppl.get("focus_soft"), None)]  # fmt: skip
        pairs = doc.get("pairs_retained") or {}
        for k, value in (ppl.get("focus_topk") or {}).items():
            rows.append((f"Focus top-{k}", value, pairs.get(k)))
        lines += [f"{head} {label} | {_number(v)} | {_number(p, 3) if p is not None else '-'} |"
                  for label, v, p in rows if v is not None]  # fmt: skip
    return lines


def _metadata(base_name: str | None, tags: list[str]) -> str:
    """The YAML front matter (huggingface_hub's ``ModelCardData``)."""
    base = base_name if base_name and HUB_ID.match(base_name) and not Path(base_name).exists() else None  # fmt: skip
    data = ModelCardData(library_name="focus-attention", base_model=base, tags=tags)
    return f"---\n{data.to_yaml()}\n---\n{CARD_MARKER}\n"


def _settings_lines(settings: dict[str, Any], fingerprint: dict[str, Any]) -> list[str]:
    layers = settings.get("layers") or []
    rows = [f"| {k} | `{settings.get(k)}` |" for k in card_settings()]
    rows.append(f"| Focus layers | {len(layers)} of {fingerprint.get('num_hidden_layers', '?')} |")
    return ["| setting | value |", "|---|---|", *rows]


def _base_lines(base_name: str | None, fingerprint: dict[str, Any]) -> list[str]:
    params = fingerprint.get("num_parameters")
    return [
        f"Base model: `{base_name or 'unnamed'}` ({fingerprint.get('model_type', '?')}, "
        f"{fingerprint.get('num_hidden_layers', '?')} layers, hidden size "
        f"{fingerprint.get('hidden_size', '?')}, {params:,} parameters). The adapter "
        "records a fingerprint of its weights and warns when loaded onto other weights."
        if isinstance(params, int)
        else f"Base model: `{base_name or 'unnamed'}`."
    ]


def adapter_card(
    settings: dict[str, Any],
    fingerprint: dict[str, Any],
    *,
    base_name: str | None = None,
    records: dict[str, Any] | None = None,
) -> str:
    """The ``README.md`` of a Focus adapter folder.

    Args:
        settings: ``FocusConfig.to_dict()`` of the adapter.
        fingerprint: ``base_model_fingerprint`` of its base model.
        base_name: the base model's name (a hub id also goes into the metadata).
        records: :func:`read_records` output (default: none).
    """
    records = records or {"train_config": None, "train_result": None, "evals": []}
    name = base_name or "its base model"
    return "\n".join([
        _metadata(base_name, ["focus-attention", "sparse-attention"]),
        f"# Focus adapter for {name}",
        "",
        "Routers of [Focus](https://arxiv.org/abs/2604.03260) (learned-grouping sparse "
        f"attention) for {name}: `{CONFIG_NAME}` holds the settings, `{WEIGHTS_NAME}` the "
        "router weights (float32). The base model's weights are not included.",
        "",
        "```python",
        *_base_loading_lines(base_name),
        'model = FocusModel.from_pretrained(base, "THIS_FOLDER_OR_REPO_ID")',
        "```",
        "",
        "## Settings",
        "",
        *_settings_lines(settings, fingerprint),
        "",
        "## Base model",
        "",
        *_base_lines(base_name, fingerprint),
        "",
        "## Training",
        "",
        *_training_lines(records),
        "",
        "## Evaluation",
        "",
        *_eval_lines(records),
        "",
    ])  # fmt: skip


def _base_loading_lines(base_name: str | None) -> list[str]:
    """The card's lines that load the base model: ``from_pretrained`` of a hub id or a
    folder, else focus-attention's ``load_model`` (which also prepares a model registered
    by name, such as ``smollm2-135m``, that transformers cannot load by that name)."""
    head = ["from focus_attention import FocusModel"]
    if base_name and (HUB_ID.match(base_name) or Path(base_name).exists()):
        return ["from transformers import AutoModelForCausalLM", "", *head, "",
                f'base = AutoModelForCausalLM.from_pretrained("{base_name}")']  # fmt: skip
    return [*head, "from focus_attention.assets.models import load_model", "",
            f'base, tokenizer = load_model("{base_name or "BASE_MODEL"}")']  # fmt: skip


def setting_keywords_line(table: str = "focus") -> str:
    """The exported card's line on the inference settings a load can change: each of
    :data:`~focus_attention.hf.config.INFERENCE_SETTINGS` as a ``from_pretrained`` keyword
    and a key of the ``table`` table of ``config.json`` (the export's
    :data:`~focus_attention.deploy.settings.SETTINGS_KEY`)."""
    others = ", ".join(f"`{name}=`" for name in INFERENCE_SETTINGS if name != "top_k")
    return (
        f"`from_pretrained(..., top_k=1)` (or {others}), or an edit of these keys in the "
        f"`{table}` table of `config.json`, changes the inference settings."
    )


def export_card(
    settings: dict[str, Any],
    fingerprint: dict[str, Any],
    *,
    base_name: str | None = None,
    records: dict[str, Any] | None = None,
    location: str | None = None,
    settings_table: str = "focus",
) -> str:
    """The ``README.md`` of an exported model directory (arguments as :func:`adapter_card`):
    how to load it, then the adapter's settings, base model, training and evaluation.
    ``location`` (the exported directory's path) is what its example loads; the export
    loads by that path, or by the hub repo id it is pushed to, never by ``base_name``.
    ``settings_table``: the key of ``config.json`` holding the settings."""
    adapter = adapter_card(settings, fingerprint, base_name=base_name, records=records)
    details = adapter[adapter.index("## Settings") :]
    name = base_name or "a base model"
    where = location or "THIS_FOLDER_OR_REPO_ID"
    return "\n".join([
        _metadata(base_name, ["focus-attention", "sparse-attention", "custom_code"]),
        f"# {name} with Focus sparse attention",
        "",
        f"{name} with the routers of [Focus](https://arxiv.org/abs/2604.03260) "
        "(learned-grouping sparse attention), exported by `focus export`. Loading it runs "
        "custom code, which needs the focus-attention package, installed from a clone of its "
        "repository (`pip install ./focus-attention`).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, pipeline",
        "",
        "# this folder, or the hub repo id it is pushed to",
        f'model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)',
        f'generate = pipeline("text-generation", "{where}", trust_remote_code=True)',
        "```",
        "",
        setting_keywords_line(settings_table),
        "",
        "Serve it over HTTP (an OpenAI-compatible API; `pip install './focus-attention[serve]'`): "
        f"`transformers serve {where} --trust-remote-code`.",
        "",
        details,
    ])  # fmt: skip
