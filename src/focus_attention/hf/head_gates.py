"""A trained gate per key-value head of the Focus layers (DuoAttention-style; docs/method.md
§9, "Long-context settings"): a scalar ``alpha`` in [0, 1] per ``(layer, kv_head)`` mixes the
head's dense output and its Focus output, ``out_h = alpha * dense_h + (1 - alpha) * focus_h``
(the query heads of a key-value head share its gate). ``focus train --method head-gates``
trains the gates alone, routers and base frozen; the heads with the largest gates are the
ones to keep dense (``focus calibrate --head-budget --head-ranking``), so inference needs no
gate.

While a :class:`HeadGates` is attached (:meth:`HeadGates.attach`), every routed Focus-layer
call also runs the base attention of all its heads and mixes it in; ``alpha = 1`` gives the
dense layer exactly and ``alpha = 0`` the Focus layer exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .runtime import runtime_of

__all__ = ["GATES_NAME", "HeadGates", "mix_heads"]

#: the ranking file :meth:`HeadGates.save` writes beside a trained adapter
GATES_NAME = "head_gates.json"


def mix_heads(alpha: torch.Tensor, dense: torch.Tensor, focus: torch.Tensor) -> torch.Tensor:
    """``alpha_h * dense_h + (1 - alpha_h) * focus_h`` per query head ``h``.

    Args:
        alpha: ``[H_kv]`` gates in [0, 1] (float); query head ``h`` takes the gate of its
            key-value head ``h // (H // H_kv)`` (grouped-query attention).
        dense, focus: ``[B, H, Nq, D]`` outputs of the same heads.

    Returns:
        ``[B, H, Nq, D]`` in ``focus``'s dtype; exactly ``focus`` where ``alpha = 0`` and
        exactly ``dense`` where ``alpha = 1`` (finite outputs).

    Raises:
        ValueError: ``H`` not a multiple of ``H_kv``, or shapes that differ.
    """
    heads, kv = focus.shape[1], alpha.numel()
    if dense.shape != focus.shape or heads % kv:
        raise ValueError(f"mix_heads: dense {tuple(dense.shape)} and focus {tuple(focus.shape)} must be equal [B, H, Nq, D] with H a multiple of the {kv} gates")  # fmt: skip
    a = alpha.to(focus.dtype).repeat_interleave(heads // kv)[None, :, None, None]
    return a * dense.to(focus.dtype) + (1 - a) * focus


class HeadGates(nn.Module):
    """One gate per ``(layer, kv_head)`` of ``layers``: the parameter ``values`` ``[L, H_kv]``
    (float32), used clamped to [0, 1] (:meth:`alpha`), initialised to ``init`` (DuoAttention
    starts every head dense, 1.0)."""

    def __init__(self, layers: list[int] | tuple[int, ...], kv_heads: int, init: float = 1.0) -> None:  # fmt: skip
        super().__init__()
        self.layers = tuple(int(i) for i in layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.values = nn.Parameter(torch.full((len(self.layers), kv_heads), float(init)))

    def alpha(self, layer: int) -> torch.Tensor | None:
        """The gates of ``layer`` clamped to [0, 1], float32 ``[H_kv]``; None for a layer
        without gates."""
        row = self.row.get(layer)
        return None if row is None else self.values[row].clamp(0.0, 1.0)

    def mean(self) -> torch.Tensor:
        """Mean gate over every head (the penalty of the training loss), a scalar."""
        return self.values.clamp(0.0, 1.0).mean()

    def attach(self, model: Any) -> HeadGates:
        """Mix the heads of the Focus model ``model`` with these gates from its next call on.

        Raises:
            ValueError: ``model`` is not a Focus model, or its Focus layers are not
                :attr:`layers`.
        """
        runtime = runtime_of(getattr(model, "base_model", model))
        if runtime is None:
            raise ValueError("HeadGates.attach: the model has no Focus adapter attached")
        if tuple(runtime.focus_layers) != self.layers:
            raise ValueError(f"HeadGates.attach: gates of layers {list(self.layers)}, the model's Focus layers are {list(runtime.focus_layers)}")  # fmt: skip
        runtime.head_gates = self
        return self

    @staticmethod
    def detach(model: Any) -> None:
        """Remove the gates from ``model`` (its Focus layers run as configured again)."""
        runtime = runtime_of(getattr(model, "base_model", model))
        if runtime is not None:
            runtime.head_gates = None

    def ranking(self) -> dict[str, Any]:
        """``head_ranking`` (``[layer, kv_head]`` pairs, largest gate first; ties in layer
        and head order) and ``by_head`` (``{"layer:kv_head": gate}``): the ranking file
        ``focus calibrate --head-ranking`` reads."""
        gates = self.values.detach().clamp(0.0, 1.0).tolist()
        by_head = {(layer, h): g for layer, row in zip(self.layers, gates, strict=True) for h, g in enumerate(row)}  # fmt: skip
        order = sorted(by_head, key=lambda pair: (-by_head[pair], pair))
        return {"head_ranking": [list(p) for p in order],
                "by_head": {f"{a}:{b}": g for (a, b), g in by_head.items()}}  # fmt: skip

    def save(self, directory: str | Path, **record: Any) -> Path:
        """Write :data:`GATES_NAME` into ``directory``: :meth:`ranking`, ``layers``, the raw
        ``values`` (to resume) and ``record`` (such as ``config``)."""
        path = Path(directory) / GATES_NAME
        data = {**record, **self.ranking(), "layers": list(self.layers),
                "values": self.values.detach().tolist()}  # fmt: skip
        path.write_text(json.dumps(data, indent=1))
        return path

    def load(self, directory: str | Path) -> HeadGates:
        """Set :attr:`values` from the :data:`GATES_NAME` of ``directory``.

        Raises:
            FileNotFoundError: no such file.
            ValueError: gates of other layers or of another shape.
        """
        path = Path(directory) / GATES_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no head gates")
        data = json.loads(path.read_text())
        values = torch.tensor(data.get("values", []), dtype=torch.float32)
        if tuple(data.get("layers", ())) != self.layers or values.shape != self.values.shape:
            raise ValueError(f"{path}: gates of layers {data.get('layers')} and shape {tuple(values.shape)}, expected {list(self.layers)} and {tuple(self.values.shape)}")  # fmt: skip
        with torch.no_grad():
            self.values.copy_(values)
        return self
