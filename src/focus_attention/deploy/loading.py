"""Loading an exported Focus model (docs/deploy.md): the base model from the exported
directory's weights, with the directory's Focus adapter attached, returned as the base
model's own transformers class so that every tool that takes a transformers model
(``pipeline``, lm-eval's ``HFLM``, ``generate``) runs it with Focus."""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, PreTrainedModel
from transformers.utils import cached_file

from ..hf.card import remember_base_name
from ..hf.config import FocusConfig
from ..hf.files import ATTACHED_ROUTERS, CONFIG_NAME, WEIGHTS_NAME
from ..hf.model import FocusModel
from .config import FocusExportConfig, base_config_of
from .export import save_loaded_export
from .settings import (
    BASE_NAME_KEY,
    FORMAT_KEY,
    READABLE_FORMATS,
    SETTING_FIELDS,
    SETTINGS_KEY,
    exported_settings,
)

__all__ = [
    "FOCUS_MODEL_ATTR",
    "ROUTERS_MODULE",
    "TRAINED_FIELDS",
    "attach_routers",
    "check_setting_names",
    "check_trained_settings",
    "load_exported",
    "setting_keywords",
]

#: attribute of a loaded exported model holding its FocusModel
FOCUS_MODEL_ATTR = "focus_model"
#: name of the routers' module inside a loaded exported model (so that ``.to(device)`` moves
#: them with the model)
ROUTERS_MODULE = ATTACHED_ROUTERS
#: the ``from_pretrained`` keywords that say where and how files are fetched
HUB_KEYS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
)

#: the Focus settings fixed by training (the routers' shapes, the layers they route, how they
#: were trained): an exported model loads with its adapter's own values
TRAINED_FIELDS = tuple(f.name for f in fields(FocusConfig) if f.name not in SETTING_FIELDS)


def check_trained_settings(path: str, settings: dict[str, Any]) -> None:
    """Refuse a setting of :data:`TRAINED_FIELDS` among ``settings`` (given to
    ``from_pretrained``, or in the export's config: its settings table, or its top level
    in the first layout).

    Raises:
        ValueError: naming the setting and the settings that can change at load time.
    """
    given = {k: v for k, v in settings.items() if k in TRAINED_FIELDS}
    if given:
        names = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"{path}: {names} cannot change at load time: {', '.join(given)} is fixed by "
            "training (the routers were trained with the adapter's values: their shapes "
            "num_groups x group_dim, the layers they route, their temperature and how they "
            f"were trained); only the inference settings {', '.join(SETTING_FIELDS)} change "
            "at load time (train another adapter for other values)"
        )


def _close_setting(name: str) -> str | None:
    """The Focus setting whose name ``name`` is close to (a misspelling), or None."""
    known = [*SETTING_FIELDS, *TRAINED_FIELDS]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return close[0] if close and close[0] != name else None


def _no_setting(path: str, where: str, name: str, meant: str) -> ValueError:
    return ValueError(
        f"{path}: {where} {name!r}, which is no Focus setting: did you mean {meant!r}? (the "
        f"settings that change at load time: {', '.join(SETTING_FIELDS)})"
    )


def check_setting_names(path: str, config: Any) -> None:
    """Refuse, in the export's config (``config.json`` or the ``config`` object), a key of
    its settings table that is no inference setting (naming the setting it is close to), a
    top-level key named as a setting in a layout that keeps them in the table, and a
    top-level key close to a setting's name in the first layout (a misspelt setting that
    would otherwise be ignored; other unknown top-level keys are kept, as transformers
    keeps them).

    Raises:
        ValueError: naming the key and the setting it is, or is close to.
    """
    if getattr(config, FORMAT_KEY, None) != 1:
        table = getattr(config, SETTINGS_KEY, None) or {}
        for key in table:
            if key not in SETTING_FIELDS and key not in TRAINED_FIELDS:
                meant = _close_setting(key)
                if meant is None:
                    raise ValueError(f"{path}: config.json {SETTINGS_KEY}.{key}: no such Focus "
                                     f"setting; the settings are {', '.join(SETTING_FIELDS)}")  # fmt: skip
                raise _no_setting(path, f"config.json {SETTINGS_KEY!r} has", key, meant)
    plain = set(vars(type(config)())) | {f.name for f in fields(FocusConfig)}
    for key in vars(config):
        if key.startswith("_"):
            continue
        if key in SETTING_FIELDS and getattr(config, FORMAT_KEY, None) != 1:
            raise ValueError(
                f"{path}: the config has {key!r} at its top level, where readers of a model "
                f"config take it for their own; the Focus settings are in its {SETTINGS_KEY!r} "
                f"table (config.{SETTINGS_KEY}[{key!r}]), or a keyword of from_pretrained"
            )
        meant = None if key in plain else _close_setting(key)
        if meant is not None:
            raise _no_setting(path, "the config has", key, meant)


def setting_keywords(path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the Focus inference settings out of the ``from_pretrained`` keywords ``kwargs``
    (in place) and return them; refuse a keyword that is close to a setting's name (a
    misspelt setting, which the base model's constructor would refuse with a bare
    ``TypeError``) unless ``from_pretrained`` takes it.

    Raises:
        ValueError: a trained setting (:func:`check_trained_settings`) or a misspelt one,
            naming it and the setting it is close to.
    """
    given = {k: kwargs.pop(k) for k in SETTING_FIELDS if k in kwargs}
    check_trained_settings(path, kwargs)
    loading = set(inspect.signature(PreTrainedModel.from_pretrained).parameters)
    for key in kwargs:
        meant = None if key in loading else _close_setting(key)
        if meant is not None:
            raise _no_setting(path, "from_pretrained received the keyword", key, meant)
    return given


def _saved_settings(path: str, config: Any, hub: dict[str, Any]) -> dict[str, Any]:
    """The inference settings the export's config holds: its settings table, or, in the
    first layout, its top-level keys as ``config.json`` has them with those of the
    ``config`` object over them (transformers' config drops a top-level key named as a
    sampling setting, such as ``top_k``, on loading)."""
    if getattr(config, FORMAT_KEY, None) != 1:
        return dict(getattr(config, SETTINGS_KEY, None) or {})
    document = cached_file(path, "config.json", **hub)
    saved = exported_settings(json.loads(Path(document).read_text(encoding="utf-8")))
    saved.update({k: v for k, v in vars(config).items() if k in SETTING_FIELDS})
    return saved


def attach_routers(base: nn.Module, focus_model: nn.Module) -> nn.Module:
    """Make the base model of ``focus_model`` carry it: the routers become the submodule
    :data:`ROUTERS_MODULE` of ``base`` (``.to()``, ``.eval()`` and ``.parameters()`` of the
    base model reach them), ``base.focus_model`` is ``focus_model`` and
    ``base.save_pretrained`` writes a complete export that loads with Focus again
    (:func:`~focus_attention.deploy.export.save_loaded_export`). Returns ``base``."""
    base.add_module(ROUTERS_MODULE, focus_model.routers)
    base.__dict__[FOCUS_MODEL_ATTR] = focus_model
    base.__dict__["save_pretrained"] = functools.partial(save_loaded_export, base)
    # generate_batch / continuous batching build the FocusModel's manager (hf/paged.py)
    base.__dict__["init_continuous_batching"] = focus_model.init_continuous_batching
    return base


def _adapter_directory(path: str, hub: dict[str, Any]) -> Path:
    """The local folder holding the exported directory's adapter files (downloaded into
    the Hugging Face cache when ``path`` is a hub repo id)."""
    found = [cached_file(path, name, **hub) for name in (CONFIG_NAME, WEIGHTS_NAME)]
    if any(f is None for f in found):
        raise FileNotFoundError(
            f"{path}: no Focus adapter ({CONFIG_NAME} and {WEIGHTS_NAME}); expected a directory "
            "written by focus export"
        )
    return Path(found[0]).parent


def _export_config(path: str, config: Any, hub: dict[str, Any]) -> FocusExportConfig:
    """``config`` (read from ``path`` when None), checked to be an exported model's."""
    if config is None:
        config = FocusExportConfig.from_pretrained(path, **hub)
    if not hasattr(config, "base_config"):
        raise ValueError(
            f"load_exported({path!r}): config is a {type(config).__name__}, expected the "
            "config of an exported Focus model (FocusExportConfig)"
        )
    version = getattr(config, FORMAT_KEY, None)
    if version not in READABLE_FORMATS:
        raise ValueError(
            f"{path}: config.json {FORMAT_KEY}={version!r}; this version of focus-attention "
            f"reads exported models of versions {', '.join(map(str, READABLE_FORMATS))} "
            "(export it again with focus export)"
        )
    return config


def load_exported(
    pretrained_model_name_or_path: str | os.PathLike,
    *model_args: Any,
    config: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """Load a directory written by :func:`~focus_attention.deploy.export.export_model`
    (what ``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`` runs;
    docs/deploy.md).

    Args:
        pretrained_model_name_or_path: the exported directory, or a hub repo id holding one.
        model_args: passed to the base model's ``from_pretrained``.
        config: its :class:`FocusExportConfig` (read from the directory when None).
        kwargs: the inference settings (:data:`SETTING_FIELDS
            <focus_attention.deploy.settings.SETTING_FIELDS>`: ``window``, ``top_k``,
            ``dense_layers``...) override those of ``config.json``; every other keyword
            (``dtype``, ``device_map``, ``revision``, ``token``...) goes to the base model's
            ``from_pretrained``.

    Returns:
        the base model's own class (for example ``LlamaForCausalLM``) in eval mode, with
        Focus attached (top-k routing, the routers frozen and float32); its
        ``focus_model`` attribute is the :class:`~focus_attention.hf.FocusModel`.

    Raises:
        FileNotFoundError: the directory or its adapter files are missing.
        ValueError: a config that is not an exported model's, or of another layout version;
            a setting fixed by training (:data:`TRAINED_FIELDS`, such as ``num_groups``)
            given as a keyword or in the config; a misspelt setting in the config
            (:func:`check_setting_names`) or as a keyword (:func:`setting_keywords`: "did
            you mean 'top_k'"); invalid settings (as
            :class:`~focus_attention.hf.FocusConfig` raises them).
    """
    path = os.fspath(pretrained_model_name_or_path)
    hub = {k: kwargs[k] for k in HUB_KEYS if kwargs.get(k) is not None}
    given = setting_keywords(path, kwargs)
    config = _export_config(path, config, hub)
    check_setting_names(path, config)
    settings = _saved_settings(path, config, hub)
    check_trained_settings(path, {**settings, **vars(config)})
    base_config = base_config_of(config)
    base_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)]
    base = base_class.from_pretrained(path, *model_args, config=base_config, **kwargs)
    focus = FocusModel.from_pretrained(base, _adapter_directory(path, hub))
    remember_base_name(focus, getattr(config, BASE_NAME_KEY, None))
    settings = {name: settings.get(name) for name in SETTING_FIELDS}
    settings.update(given)
    try:
        focus.focus_config = focus.focus_config.override(**settings)
    except ValueError as err:
        raise ValueError(f"{path}: the Focus settings of its config.json and the keywords "
                         f"given ({', '.join(SETTING_FIELDS)}): {err}") from err  # fmt: skip
    return attach_routers(base, focus)
