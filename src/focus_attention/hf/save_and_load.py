"""Persistence of a :class:`~focus_attention.hf.model.FocusModel` (as PEFT keeps its own in
``peft/utils/save_and_load.py``): its state dict (the routers and the config), the adapter
folder (:data:`~focus_attention.hf.files.CONFIG_NAME`, :data:`~focus_attention.hf.files.
WEIGHTS_NAME`, the model card) written and read back, a ``transformers.Trainer`` output
folder read, the routers loaded into a built model, and the Hugging Face hub. Each function
takes the model (or, to build one, its class); ``FocusModel``'s methods of the same names
call them and document the arguments and errors (docs/method.md §8, docs/deploy.md)."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .card import adapter_card_of, remember_source
from .files import (
    CONFIG_NAME,
    STATE_CONFIG_KEY,
    TRAINER_WEIGHTS_NAME,
    WEIGHTS_NAME,
    adapter_layout,
    base_model_fingerprint,
    compare_fingerprints,
    config_document,
    document_to_tensor,
    read_adapter,
    read_trainer_state,
    tensor_layers,
    tensor_to_document,
    to_file_tensors,
    write_adapter,
)
from .hub import push_adapter, resolve_adapter
from .router import check_router_values

__all__ = [
    "base_keys_not_expected",
    "focus_state_dict",
    "from_pretrained",
    "load_focus_state_dict",
    "load_from_state_dict",
    "load_routers",
    "load_state_dict",
    "push_to_hub",
    "save_pretrained",
    "state_dict",
]

#: the attribute (in a FocusModel's ``__dict__``) holding the prefix of the state being loaded
#: into it inside a parent module, between :func:`load_from_state_dict` and
#: :func:`base_keys_not_expected`
LOAD_PREFIX_ATTR = "_load_prefix"


def state_dict(
    model: Any, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
) -> dict[str, Any]:
    """:meth:`FocusModel.state_dict <focus_attention.hf.model.FocusModel.state_dict>`: the
    routers' tensors and ``focus_config``, the config document as a 1-D uint8 tensor.

    Raises:
        TypeError: positional arguments (``nn.Module.state_dict``'s deprecated form).
    """
    if args:
        raise TypeError("FocusModel.state_dict takes keyword arguments only")
    if destination is None:
        destination = OrderedDict()
    model.routers.state_dict(
        destination=destination, prefix=prefix + "routers.", keep_vars=keep_vars
    )
    text = config_document(model.focus_config, base_model_fingerprint(model.base_model))
    destination[prefix + STATE_CONFIG_KEY] = document_to_tensor(text)
    return destination


def load_from_state_dict(
    model: Any, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
) -> None:
    """``FocusModel._load_from_state_dict``: how a FocusModel inside another module loads
    its state (the config entry takes effect, never reported unexpected; the base model's
    weights not reported missing, :func:`base_keys_not_expected`)."""
    key = prefix + STATE_CONFIG_KEY
    if key in state_dict:
        config, _ = tensor_to_document(state_dict[key], key)
        model.focus_config = config.replace(seed=model.focus_config.seed)
    model.__dict__[LOAD_PREFIX_ATTR] = prefix
    nn.Module._load_from_state_dict(
        model, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    )
    if key in unexpected_keys:
        unexpected_keys.remove(key)


def base_keys_not_expected(model: Any, incompatible_keys: Any) -> None:
    """Load-state-dict post-hook of a FocusModel: the base model's weights are not part of
    its state, so their absence is not a missing key (see :func:`load_from_state_dict`)."""
    prefix = model.__dict__.pop(LOAD_PREFIX_ATTR, "") + "base_model."
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if not k.startswith(prefix)]


def load_state_dict(model: Any, state_dict, strict: bool = True, assign: bool = False):
    """:meth:`FocusModel.load_state_dict
    <focus_attention.hf.model.FocusModel.load_state_dict>`, which documents it."""
    model._check_live()
    routers = {k[8:]: v for k, v in state_dict.items() if k.startswith("routers.")}
    unexpected = [k for k in state_dict if not k.startswith("routers.")]
    unexpected = [k for k in unexpected if k != STATE_CONFIG_KEY]
    config = None
    if STATE_CONFIG_KEY in state_dict:
        config, _ = tensor_to_document(state_dict[STATE_CONFIG_KEY], STATE_CONFIG_KEY)
        config = config.replace(seed=model.focus_config.seed)
    expected = set(model.routers.state_dict())
    missing = sorted("routers." + k for k in expected - set(routers))
    unexpected += sorted("routers." + k for k in set(routers) - expected)
    if strict and (missing or unexpected):
        raise ValueError(
            f"Error(s) in loading the Focus state dict: missing keys {missing}, unexpected "
            f"keys {unexpected}"
        )
    for key, tensor in routers.items():
        check_router_values(f"routers.{key}", tensor)
    if config is not None:
        model.focus_config = config
    result = model.routers.load_state_dict(routers, strict=False, assign=assign)
    return type(result)(missing, unexpected)


def focus_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """:meth:`FocusModel.focus_state_dict
    <focus_attention.hf.model.FocusModel.focus_state_dict>`: the router tensors in the
    adapter file's layout (detached, CPU, contiguous)."""
    return to_file_tensors(model.routers.state_dict(prefix="routers."))


def router_value(name: str, src: torch.Tensor, dst: torch.Tensor, layer: int) -> torch.Tensor:
    """``src``, the file tensor ``name``, as router tensor ``dst`` holds it (shape, dtype,
    device), checked: its shape, a materialised ``dst``, finite values.

    Raises:
        ValueError: a shape mismatch, ``dst`` on the meta device, NaN or infinities.
    """
    if src.numel() != dst.numel() or (dst.ndim and tuple(src.shape) != tuple(dst.shape)):
        raise ValueError(
            f"Focus weights: {name} has shape {tuple(src.shape)}, this adapter expects "
            f"{tuple(dst.shape)}"
        )
    if dst.device.type == "meta":
        raise ValueError(
            f"the Focus router of layer {layer} is on the meta device: materialise the model "
            "first (to_empty(device=...)) or load with load_state_dict(..., assign=True)"
        )
    value = src.reshape(dst.shape).to(dtype=dst.dtype, device=dst.device)
    check_router_values(name, value)
    return value


@torch.no_grad()
def load_focus_state_dict(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """:meth:`FocusModel.load_focus_state_dict
    <focus_attention.hf.model.FocusModel.load_focus_state_dict>`: every tensor checked
    (keys, shapes, values) before any is loaded.

    Raises:
        ValueError: missing or unexpected keys, a shape mismatch, or NaN or infinite values
            (names them).
    """
    expected = {f"layer.{i}.{n}" for i, r in model.routers.items() for n in r.TENSORS}
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise ValueError(
            f"Focus weights do not match this adapter: missing keys {missing}, "
            f"unexpected keys {extra}"
        )
    values = {(i, name): router_value(f"layer.{i}.{name}", tensors[f"layer.{i}.{name}"],
                                      getattr(router, name), i)
              for i, router in model.routers.items() for name in router.TENSORS}  # fmt: skip
    for i, router in model.routers.items():  # every tensor checked: now load them all
        for name in router.TENSORS:
            getattr(router, name).copy_(values[i, name])
        router.mark_loaded()


def load_routers(model: Any, directory: str | os.PathLike) -> Any:
    """:meth:`FocusModel.load_routers <focus_attention.hf.model.FocusModel.load_routers>`,
    which documents it; returns ``model``."""
    directory = Path(directory)
    if adapter_layout(directory) != "adapter":
        raise FileNotFoundError(
            f"{directory / CONFIG_NAME} not found: load_routers reads an adapter folder "
            f"({CONFIG_NAME} and {WEIGHTS_NAME}); load a Trainer output folder with "
            "FocusModel.from_pretrained"
        )
    config, extra, tensors = read_adapter(directory)
    current = model.focus_config
    fields = [
        (n, getattr(config, n), getattr(current, n))
        for n in ("num_groups", "group_dim", "router_input")
    ]
    fields.append(("layers", tensor_layers(tensors), model.focus_layers))
    for name, saved, here in fields:
        if saved != here:
            raise ValueError(
                f"FocusModel.load_routers: the adapter in {directory} has {name}={saved!r}, "
                f"this model {here!r}; build the model with the adapter's {name}"
            )
    saved_fp = extra.get("base_model_fingerprint") or {}
    compare_fingerprints(saved_fp, base_model_fingerprint(model.base_model), "FocusModel.load_routers")  # fmt: skip
    model.load_focus_state_dict(tensors)
    return model


def save_pretrained(
    model: Any,
    save_directory: str | os.PathLike,
    state_dict: dict[str, torch.Tensor] | None = None,
    safe_serialization: bool = True,
    is_main_process: bool = True,
    model_card: bool = True,
) -> None:
    """:meth:`FocusModel.save_pretrained
    <focus_attention.hf.model.FocusModel.save_pretrained>`, which documents it."""
    model._check_live()
    if not safe_serialization:
        raise ValueError(
            "FocusModel.save_pretrained: safe_serialization=False is not supported; Focus "
            "adapters are saved as safetensors"
        )
    if not is_main_process:
        return
    if state_dict is None:
        state_dict = model.state_dict()
    if STATE_CONFIG_KEY not in state_dict:
        raise ValueError(
            f"FocusModel.save_pretrained: the state_dict has no {STATE_CONFIG_KEY!r} entry "
            "(pass the output of FocusModel.state_dict())"
        )
    config, extra = tensor_to_document(state_dict[STATE_CONFIG_KEY], STATE_CONFIG_KEY)
    tensors = to_file_tensors(state_dict)
    fingerprint = extra.get("base_model_fingerprint") or {}
    text = config_document(config, fingerprint)
    card = None
    if model_card:
        card = adapter_card_of(model, save_directory, config.to_dict(), fingerprint)
    write_adapter(Path(save_directory), tensors, text, card)


def from_pretrained(
    cls: type,
    base_model: nn.Module,
    directory: str | os.PathLike,
    is_trainable: bool = False,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Any:
    """:meth:`FocusModel.from_pretrained
    <focus_attention.hf.model.FocusModel.from_pretrained>`, which documents it: a ``cls``
    (FocusModel) built on ``base_model`` with the saved routers."""
    directory = resolve_adapter(directory, revision=revision, token=token, cache_dir=cache_dir)
    adapter = adapter_layout(directory) == "adapter"
    if adapter:
        config, extra, tensors = read_adapter(directory)
    else:
        config, extra, tensors = read_trainer_state(directory / TRAINER_WEIGHTS_NAME)
    saved_fp = extra.get("base_model_fingerprint") or {}
    compare_fingerprints(saved_fp, base_model_fingerprint(base_model), "FocusModel.from_pretrained")
    model = cls(base_model, config)
    try:
        if adapter:
            model.load_focus_state_dict(tensors)
        else:
            model.load_state_dict(tensors)
    except Exception:
        model.unload()
        raise
    if not is_trainable:
        model.requires_grad_(False)
        model.eval()
    if adapter:
        remember_source(model, directory)
    return model


def push_to_hub(model: Any, repo_id: str, **options: Any) -> Any:
    """:meth:`FocusModel.push_to_hub <focus_attention.hf.model.FocusModel.push_to_hub>`
    (``options``: its keywords), which documents it."""
    model._check_live()
    return push_adapter(model, repo_id, **options)
