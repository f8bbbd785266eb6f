"""Loading an exported Focus model (docs/deploy.md): the base model from the exported
directory's weights, with the directory's Focus adapter attached, returned as the base
model's own transformers class so that every tool that takes a transformers model
(``pipeline``, lm-eval's ``HFLM``, ``generate``) runs it with Focus."""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import cached_file

from ..hf.config import FocusConfig
from ..hf.files import ATTACHED_ROUTERS, CONFIG_NAME, WEIGHTS_NAME
from ..hf.model import FocusModel
from .config import FocusExportConfig, base_config_of
from .export import save_loaded_export
from .settings import EXPORT_FORMAT_VERSION, FORMAT_KEY, SETTING_FIELDS

__all__ = [
    "FOCUS_MODEL_ATTR",
    "ROUTERS_MODULE",
    "TRAINED_FIELDS",
    "attach_routers",
    "check_trained_settings",
    "load_exported",
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


def check_trained_settings(path: str, config: Any, kwargs: dict[str, Any]) -> None:
    """Refuse a setting of :data:`TRAINED_FIELDS` given to ``from_pretrained`` (``kwargs``)
    or set on the export's config (``config.json`` or the ``config`` object).

    Raises:
        ValueError: naming the setting and the settings that can change at load time.
    """
    given = {k: kwargs[k] for k in TRAINED_FIELDS if k in kwargs}
    given.update({k: v for k, v in vars(config).items() if k in TRAINED_FIELDS})
    if given:
        names = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"{path}: {names} cannot change at load time: {', '.join(given)} is fixed by "
            "training (the routers were trained with the adapter's values: their shapes "
            "num_groups x group_dim, the layers they route, their temperature and how they "
            f"were trained); only the inference settings {', '.join(SETTING_FIELDS)} change "
            "at load time (train another adapter for other values)"
        )


def check_setting_names(path: str, config: Any) -> None:
    """Refuse a key of the export's config (``config.json`` or the ``config`` object) that is
    no setting but close to a Focus setting's name, a misspelt setting that would otherwise
    be ignored (other unknown keys are kept, as transformers keeps them).

    Raises:
        ValueError: naming the key and the setting it is close to.
    """
    known = {f.name for f in fields(FocusConfig)}
    plain = set(vars(type(config)())) | known
    for key in vars(config):
        if key.startswith("_") or key in plain:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            raise ValueError(
                f"{path}: the config has {key!r}, which is no Focus setting: did you mean "
                f"{close[0]!r}? (the settings that change at load time: "
                f"{', '.join(SETTING_FIELDS)})"
            )


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
    if version != EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"{path}: config.json {FORMAT_KEY}={version!r}; this version of focus-attention "
            f"reads exported models of version {EXPORT_FORMAT_VERSION} (export it again with "
            "focus export)"
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
            (:func:`check_setting_names`); invalid settings (as :class:`~focus_attention.hf.FocusConfig` raises them).
    """
    path = os.fspath(pretrained_model_name_or_path)
    hub = {k: kwargs[k] for k in HUB_KEYS if kwargs.get(k) is not None}
    given = {k: kwargs.pop(k) for k in SETTING_FIELDS if k in kwargs}
    config = _export_config(path, config, hub)
    check_trained_settings(path, config, kwargs)
    check_setting_names(path, config)
    base_config = base_config_of(config)
    base_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)]
    base = base_class.from_pretrained(path, *model_args, config=base_config, **kwargs)
    focus = FocusModel.from_pretrained(base, _adapter_directory(path, hub))
    settings = {name: getattr(config, name, None) for name in SETTING_FIELDS}
    settings.update(given)
    try:
        focus.focus_config = focus.focus_config.override(**settings)
    except ValueError as err:
        raise ValueError(f"{path}: the Focus settings of its config.json and the keywords "
                         f"given ({', '.join(SETTING_FIELDS)}): {err}") from err  # fmt: skip
    return attach_routers(base, focus)
