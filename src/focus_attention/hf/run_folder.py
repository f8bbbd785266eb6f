"""The run-folder format: what a ``focus train --method`` run writes beside the Focus
adapter, and how to load it back onto the untouched base model (docs/method.md §6,
"Methods").

Layout of a run directory (and of each of its checkpoints): the Focus adapter
(``focus_config.json`` + ``focus_model.safetensors``) where the model has Focus routers;
``lora/``, a peft adapter written by ``PeftModel.save_pretrained``, where LoRA trained;
``model/``, a transformers model directory written by ``save_pretrained`` (with the
tokenizer), where base weights themselves trained. A run holds LoRA or trained base weights,
never both.

Also here: per-tensor digests of a model's base weights under their original names (peft's
``.base_layer`` wrapper removed, LoRA tensors apart), to report which base tensors a method
changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from ..utils.env import hash_tensor, state_sha256
from .compat import peft_reads_old_names
from .files import CONFIG_NAME, WEIGHTS_NAME

__all__ = [
    "LORA_DIR",
    "MODEL_DIR",
    "apply_lora",
    "base_state",
    "import_peft",
    "base_weights_report",
    "load_trained_weights",
    "run_parts",
    "tensor_digests",
    "tuned_model",
]

#: sub-directory of a run holding the peft LoRA adapter
LORA_DIR = "lora"
#: sub-directory of a run holding the transformers model with trained base weights
MODEL_DIR = "model"
#: peft's file names (``peft.utils.constants``)
LORA_CONFIG_FILE = "adapter_config.json"


def run_parts(directory: str | Path) -> dict[str, bool]:
    """Which parts a run directory (or checkpoint) holds: ``focus`` (a Focus adapter),
    ``lora`` (a peft adapter in ``lora/``), ``model`` (base weights in ``model/``). A
    Focus adapter counts when either of its files is there, so that the reader reports a
    damaged or missing one by name."""
    d = Path(directory)
    return {
        "focus": (d / CONFIG_NAME).exists() or (d / WEIGHTS_NAME).exists(),
        "lora": (d / LORA_DIR / LORA_CONFIG_FILE).is_file(),
        "model": (d / MODEL_DIR / "config.json").is_file(),
    }


def load_trained_weights(base: Any, directory: str | Path) -> Any:
    """The model with the trained base weights of a run: a new model read from
    ``directory/model`` with the dtype and device of ``base`` (in eval mode), or ``base``
    itself when the run trained no base weights.

    Raises:
        RuntimeError: transformers cannot read ``model/``.
    """
    path = Path(directory) / MODEL_DIR
    if not (path / "config.json").is_file():
        return base
    ref = next(base.parameters())
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=ref.dtype, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as err:
        raise RuntimeError(f"cannot load the trained model in {path}: {err}") from err
    return model.to(ref.device).eval()


def import_peft() -> Any:
    """The ``peft`` module (the ``baselines`` extra).

    Raises:
        ImportError: peft is not installed (the message says how to install it).
    """
    try:
        import peft  # optional: the baselines extra, needed by LoRA runs only
    except ImportError as err:
        raise ImportError("LoRA needs peft: pip install -e '.[baselines]' (peft==0.21.2)") from err
    return peft


def apply_lora(model: Any, directory: str | Path, *, is_trainable: bool = False) -> Any:
    """Inject the run's LoRA adapter (``directory/lora``) into ``model`` in place; returns
    the ``peft.PeftModel`` around it (``.base_model.model`` is ``model``).

    Raises:
        FileNotFoundError: no ``lora/adapter_config.json``.
        ImportError: peft is not installed.
    """
    PeftModel = import_peft().PeftModel  # noqa: N806 (a class)

    path = Path(directory) / LORA_DIR
    if not (path / LORA_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path / LORA_CONFIG_FILE} not found: not a LoRA run")
    with peft_reads_old_names():
        return PeftModel.from_pretrained(model, str(path), is_trainable=is_trainable)


def tuned_model(base: Any, directory: str | Path) -> Any:
    """The tuned model of a run without its Focus routers: the run's trained base weights
    (a new model, ``base`` untouched) or ``base`` with the run's LoRA injected in place, or
    ``base`` itself for a run that trained neither; in eval mode. Attach the run's Focus
    adapter, where it has one, with ``FocusModel.from_pretrained(tuned, directory)``.

    Raises:
        RuntimeError: transformers cannot read ``model/``.
        ImportError: the run has LoRA and peft is not installed.
    """
    model = load_trained_weights(base, directory)
    if run_parts(directory)["lora"]:
        apply_lora(model, directory)
    return model.eval()


def base_state(model: Any) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` restricted to the base weights under their original names:
    peft's ``.base_layer`` removed from the names, LoRA tensors (``lora_*``) left out."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = t
    return out


def tensor_digests(model: Any) -> dict[str, str]:
    """SHA-256 (hex) of every tensor of :func:`base_state` (dtype, shape and bytes), by
    name."""
    out = {}
    for name, t in base_state(model).items():
        h = hashlib.sha256()
        hash_tensor(h, t, f"{t.dtype}:{tuple(t.shape)}")
        out[name] = h.hexdigest()
    return out


def base_weights_report(before: dict[str, str], model: Any) -> dict[str, Any]:
    """How the base weights of ``model`` compare with the digests ``before``
    (:func:`tensor_digests` of the untouched base): ``after`` (SHA-256 over every base
    tensor, as :func:`~focus_attention.utils.env.weights_sha256` computes it, on the base
    names), ``changed`` (names of the tensors that differ, sorted), ``changed_count``,
    ``tensors`` (how many were compared) and ``lora_tensors`` (LoRA tensors present)."""
    after = tensor_digests(model)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    lora = sum(1 for k in model.state_dict() if ".lora_" in k)
    sha = state_sha256(base_state(model))
    return {"after": sha, "changed": changed, "changed_count": len(changed),
            "tensors": len(after), "lora_tensors": lora}  # fmt: skip
