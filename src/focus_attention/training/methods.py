"""What trains in a ``focus train --method`` run (docs/method.md §6, "Methods"): the model
each method builds, its parameter groups and their learning rates, its loss, its
validation and how it is saved.

- ``focus``: the Focus routers of the frozen model (:func:`trainable_parameters`).
- ``lora``: LoRA (peft) on the attention projections of the base model, dense attention.
- ``attention``: every parameter of the self-attention modules (the q, k, v, o projections
  and the norms inside the module, such as OLMo-2's and Gemma's q/k norms; the block's
  input norm is not part of the module and stays frozen), dense attention.
- ``full``: every base parameter, dense attention.
- ``focus+lora``: LoRA on the projections and the Focus routers together (two parameter
  groups: routers at ``lr``, LoRA at ``base_lr``).
- ``head-gates``: a gate per key-value head of the Focus layers of ``init_adapter``
  (:class:`~focus_attention.hf.head_gates.HeadGates`), routers and base frozen, top-k
  routing; saved as the ranking file ``head_gates.json`` beside the unchanged adapter.
- ``two-phase``: phase 1 (``phase1_steps``) trains the routers of the frozen model, as
  ``focus``; phase 2 trains the routers (``lr``) and the base weights or LoRA
  (``phase2_method``, at ``base_lr``) with Focus routing active, with a fresh AdamW and
  its own warm-up and cosine schedule (:func:`phase_schedule`).

The base model runs in ``eval()`` mode for every method (no dropout, the same function for
all of them); LoRA's own dropout is active when ``lora_dropout > 0``. LoRA matrices are
initialised from a generator seeded by the run's ``seed`` (peft's initialisation: ``A``
Kaiming-uniform, ``B`` zero), independently of the global random state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..hf import FocusModel, get_focus_model
from ..hf.architectures import attention_modules, get_architecture, kv_heads_of
from ..hf.compat import peft_reads_old_names
from ..hf.files import read_safetensors
from ..hf.head_gates import HeadGates
from ..hf.run_folder import (
    LORA_DIR,
    MODEL_DIR,
    apply_lora,
    import_peft,
    load_trained_weights,
)
from ..utils.io import staged_directory
from .config import DEFAULT_LORA_RANK, DEFAULT_LORA_TARGETS, FOCUS_METHODS, TrainConfig
from .objectives import StepLoss, head_gates_step, objective_loss
from .schedule import lr_factor

__all__ = [
    "LORA_SHORT_NAMES",
    "Trainee",
    "build_trainee",
    "lora_modules",
    "match_lora_rank",
    "phase_at",
    "phase_schedule",
    "start_phase2",
    "step_loss",
    "trainable_parameters",
]

#: short LoRA target names -> the projection names they stand for, first match wins
#: (GPT-2 computes q, k and v in one fused ``c_attn``)
LORA_SHORT_NAMES = {
    "q": ("q_proj", "c_attn"),
    "k": ("k_proj", "c_attn"),
    "v": ("v_proj", "c_attn"),
    "o": ("o_proj", "c_proj"),
}


def trainable_parameters(model: FocusModel) -> list[torch.nn.Parameter]:
    """The parameters that require grad, sorted by name, after checking that they are
    exactly the Focus routers' parameters (the base model is frozen).

    Raises:
        RuntimeError: a base parameter requires grad, or not every Focus parameter does.
    """
    named = sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)
    router_ids = {id(p) for p in model.routers.parameters()}
    base = [n for n, p in named if id(p) not in router_ids]
    if base:
        raise RuntimeError(
            f"centroid-only training: {len(base)} base parameters require grad ({base[:3]}...)"
        )
    if not named or len(named) != len(router_ids):
        raise RuntimeError(
            f"centroid-only training: {len(named)} of {len(router_ids)} Focus parameters "
            "require grad (expected all of them)"
        )
    return [p for _, p in named]


@dataclass
class Trainee:
    """The model of one method in one phase.

    Attributes:
        method, phase: the :class:`~.config.TrainConfig` method and the phase (1, or 2 in
            two-phase's second phase).
        model: what the loss is computed with: the :class:`FocusModel` (Focus methods) or
            the transformers model (dense methods).
        hf: the transformers model (LoRA injected in place where LoRA trains).
        focus: the :class:`FocusModel`, or None (dense methods).
        peft: the ``peft.PeftModel`` around ``hf``, or None.
        groups: the AdamW parameter groups, ``{"name", "params", "lr"}`` (``name``
            ``routers``, ``lora`` or ``base``), each sorted by parameter name.
        tokenizer: saved with trained base weights.
        info: what :meth:`describe` adds (LoRA rank, targets, rank matching).
        gates: the :class:`~focus_attention.hf.head_gates.HeadGates` of ``head-gates``, or
            None.
    """

    method: str
    phase: int
    model: Any
    hf: Any
    focus: FocusModel | None
    peft: Any | None
    groups: list[dict[str, Any]]
    tokenizer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    gates: Any = None

    @property
    def params(self) -> list[nn.Parameter]:
        """Every trained parameter, group by group."""
        return [p for g in self.groups for p in g["params"]]

    @property
    def num_trainable(self) -> int:
        """Number of trained values (elements of :attr:`params`)."""
        return sum(p.numel() for p in self.params)

    @property
    def trains_base(self) -> bool:
        """Whether base weights themselves train (then ``model/`` is saved)."""
        return any(g["name"] == "base" for g in self.groups)

    def optimizer(self, cfg: TrainConfig) -> torch.optim.AdamW:
        """AdamW over :attr:`groups` with ``cfg``'s betas and weight decay."""
        groups = [{"params": g["params"], "lr": g["lr"]} for g in self.groups]
        return torch.optim.AdamW(
            groups, lr=self.groups[0]["lr"], betas=cfg.betas, weight_decay=cfg.weight_decay
        )

    def train_mode(self) -> None:
        """Routers in training mode (soft routing), base model in eval mode, LoRA dropout
        on; ``head-gates``: everything in eval mode (top-k routing, as at inference)."""
        if self.gates is not None:
            self.model.eval()
            return
        self.model.train()
        self.hf.eval()
        if self.peft is not None:
            for name, module in self.hf.named_modules():
                if ".lora_dropout." in f".{name}." and isinstance(module, nn.Dropout):
                    module.train()

    def save_pretrained(self, directory: str | Path) -> None:
        """Write this model's trained parts into ``directory``: ``model/`` (transformers
        ``save_pretrained`` with the tokenizer) where base weights train, ``lora/`` (peft
        ``save_pretrained``) where LoRA trains, then the Focus adapter where there is one.
        The sub-directories are staged and renamed into place."""
        directory = Path(directory)
        if self.trains_base:
            with staged_directory(directory / MODEL_DIR, directory, ".tmp-model-") as tmp:
                self.hf.save_pretrained(tmp)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(tmp)
        if self.peft is not None:
            with staged_directory(directory / LORA_DIR, directory, ".tmp-lora-") as tmp:
                self.peft.save_pretrained(str(tmp))
        if self.focus is not None:
            self.focus.save_pretrained(directory)
        if self.gates is not None:
            self.gates.save(directory, config=self.info.get("head_gates", {}))

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load into this trainee, in place, what :meth:`save_pretrained` wrote into
        ``directory``: the trained base weights (``model/``), the LoRA matrices (``lora/``,
        peft's ``adapter_model.safetensors``) and the Focus routers (weights, routing bias
        and its count), in that order, so the adapter's base fingerprint matches.

        Raises:
            FileNotFoundError: a part this trainee trains is missing from ``directory``.
            UnreadableFileError: a damaged LoRA or Focus weights file (a ``ValueError``
                naming the file).
        """
        directory = Path(directory)
        if self.trains_base:
            trained = load_trained_weights(self.hf, directory)
            if trained is self.hf:
                raise FileNotFoundError(f"{directory / MODEL_DIR}: no trained base weights")
            self.hf.load_state_dict(trained.state_dict())
        if self.peft is not None:
            path = directory / LORA_DIR / "adapter_model.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no LoRA weights")
            lora, _ = read_safetensors(path, "the LoRA weights of a focus train checkpoint")
            import_peft().set_peft_model_state_dict(self.peft, lora)
        if self.focus is not None:
            self.focus.load_routers(directory)
        if self.gates is not None:
            self.gates.load(directory)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: method, phase, trained values in all and per group, the
        learning rates and :attr:`info`."""
        return {
            "method": self.method,
            "phase": self.phase,
            "trainable_parameters": self.num_trainable,
            "groups": {g["name"]: sum(p.numel() for p in g["params"]) for g in self.groups},
            "lr": {g["name"]: g["lr"] for g in self.groups},
            **self.info,
        }


def phase_at(cfg: TrainConfig, step: int) -> int:
    """The phase of optimizer step ``step`` (0-based): 2 from ``phase1_steps`` on in a
    two-phase run, else 1."""
    if cfg.method == "two-phase" and step >= cfg.phase1_steps:
        return 2
    return 1


def phase_schedule(cfg: TrainConfig, phase: int) -> Any:
    """The learning-rate multiplier of ``phase`` as a function of the optimizer steps taken
    in that phase (for ``LambdaLR``): warm-up over ``warmup_steps`` and cosine decay to 0
    over the phase's own steps (:func:`~.schedule.lr_factor`); outside two-phase, over
    ``steps``."""
    if cfg.method != "two-phase":
        total = cfg.steps
    else:
        total = cfg.phase1_steps if phase == 1 else cfg.steps - cfg.phase1_steps
    return lambda s: lr_factor(s, total, cfg.warmup_steps)


def _sorted_named(module: nn.Module, keep: Any) -> list[nn.Parameter]:
    """The parameters of ``module`` for which ``keep(name, p)`` holds, sorted by name."""
    return [p for _, p in sorted((n, p) for n, p in module.named_parameters() if keep(n, p))]


def lora_modules(hf: Any, targets: tuple[str, ...]) -> tuple[list[str], list[str], int]:
    """The modules that get LoRA: ``(full module names, projection names, values per
    rank)``; the values per rank are ``sum(in + out)`` over the modules (a rank-``r``
    LoRA has ``r`` times as many).

    Raises:
        ValueError: a target that names no linear layer of the attention modules.
    """
    names_of = {id(m): n for n, m in hf.named_modules()}
    full, short, per_rank = [], [], 0
    for att in attention_modules(hf, get_architecture(hf)).values():
        linear = {n: m for n, m in att.named_children() if isinstance(m, (nn.Linear, Conv1D))}
        for target in targets:
            child = next((c for c in LORA_SHORT_NAMES.get(target, (target,)) if c in linear), None)
            if child is None:
                raise ValueError(
                    f"TrainConfig.lora_targets: {target!r} names no linear layer of "
                    f"{type(att).__name__} (its linear layers: {sorted(linear)}; short names "
                    f"{sorted(LORA_SHORT_NAMES)})"
                )
            name = f"{names_of[id(att)]}.{child}"
            if name not in full:
                full.append(name)
                per_rank += sum(linear[child].weight.shape)
            if child not in short:
                short.append(child)
    return full, short, per_rank


def match_lora_rank(per_rank: int, target: int) -> int:
    """The rank ``r >= 1`` whose trainable count ``r * per_rank`` is closest to ``target``
    (the smaller one on a tie)."""
    guess = max(1, round(target / per_rank))
    candidates = [r for r in (guess - 1, guess, guess + 1) if r >= 1]
    return min(candidates, key=lambda r: (abs(r * per_rank - target), r))


def _focus_count(hf: Any, cfg: TrainConfig) -> int:
    """Trainable values of the Focus routers ``cfg`` would attach to ``hf``."""
    fm = get_focus_model(hf, cfg.focus_config())
    try:
        return sum(p.numel() for p in fm.routers.parameters())
    finally:
        fm.unload()


def _new_lora(hf: Any, cfg: TrainConfig, focus: FocusModel | None = None) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """Inject a fresh LoRA into ``hf`` (peft, seeded by ``cfg.seed``): ``(PeftModel,
    info)``; ``info["lora"]`` records rank, alpha, targets, dropout and, with
    ``lora_rank = "match"``, the Focus count matched (that of ``focus`` when ``hf``
    already has its routers)."""
    peft_module = import_peft()
    targets = cfg.lora_targets or DEFAULT_LORA_TARGETS
    full, short, per_rank = lora_modules(hf, targets)
    info: dict[str, Any] = {"targets": short, "modules": len(full), "per_rank": per_rank}
    rank = cfg.lora_rank or DEFAULT_LORA_RANK
    if rank == "match":
        count = (_focus_count(hf, cfg) if focus is None
                 else sum(p.numel() for p in focus.routers.parameters()))  # fmt: skip
        rank = match_lora_rank(per_rank, count)
        info["matched_focus_parameters"] = count
    alpha = float(cfg.lora_alpha) if cfg.lora_alpha is not None else float(rank)
    dropout = float(cfg.lora_dropout or 0.0)
    info.update(rank=rank, alpha=alpha, dropout=dropout, parameters=rank * per_rank)
    lcfg = peft_module.LoraConfig(r=rank, lora_alpha=alpha, target_modules=full,
                                  lora_dropout=dropout, bias="none", task_type="CAUSAL_LM")  # fmt: skip
    with torch.random.fork_rng(), peft_reads_old_names():
        torch.manual_seed(cfg.seed)
        peft = peft_module.get_peft_model(hf, lcfg)
    return peft, {"lora": info}


def _loaded_lora(hf: Any, ckpt: Path) -> tuple[Any, dict[str, Any]]:
    """The LoRA of checkpoint ``ckpt`` injected into ``hf``, trainable, and its info."""
    peft = apply_lora(hf, ckpt, is_trainable=True)
    lc = peft.peft_config["default"]
    count = sum(p.numel() for n, p in hf.named_parameters() if ".lora_" in n)
    targets = sorted({t.rsplit(".", 1)[-1] for t in lc.target_modules})
    info = {"rank": lc.r, "alpha": float(lc.lora_alpha), "dropout": float(lc.lora_dropout),
            "targets": targets, "modules": len(lc.target_modules), "parameters": count}  # fmt: skip
    return peft, {"lora": info}


def _lora_params(hf: Any) -> list[nn.Parameter]:
    """The LoRA matrices of ``hf``, made trainable, sorted by name."""
    params = _sorted_named(hf, lambda n, p: ".lora_" in n)
    for p in params:
        p.requires_grad_(True)
    return params


def _focus(hf: Any, cfg: TrainConfig, ckpt: Path | None) -> FocusModel:
    """Trainable Focus routers on ``hf``: those of ``ckpt``, else fresh ones or, with
    ``init_adapter``, those of that adapter under this run's settings."""
    if ckpt is not None:
        return FocusModel.from_pretrained(hf, ckpt, is_trainable=True)
    fm = get_focus_model(hf, cfg.focus_config())
    if cfg.init_adapter is not None:
        try:
            fm.load_routers(cfg.init_adapter)
        except Exception:
            fm.unload()
            raise
    return fm


def _check_only(model: nn.Module, params: list[nn.Parameter], method: str) -> None:
    """Every parameter of ``model`` requires grad exactly when it is in ``params``.

    Raises:
        RuntimeError: naming the first parameters that break it.
    """
    ids = {id(p) for p in params}
    wrong = [n for n, p in model.named_parameters() if p.requires_grad != (id(p) in ids)]
    if wrong:
        raise RuntimeError(f"--method {method}: these parameters are wrongly (un)frozen: "
                           f"{wrong[:4]}{'...' if len(wrong) > 4 else ''}")  # fmt: skip


def _dense(cfg: TrainConfig, hf: Any, ckpt: Path | None, tokenizer: Any) -> Trainee:
    """``lora``, ``attention`` and ``full``: dense attention."""
    peft, info = None, {}
    if cfg.method == "lora":
        peft, info = _loaded_lora(hf, ckpt) if ckpt is not None else _new_lora(hf, cfg)
        groups = [{"name": "lora", "params": _lora_params(hf), "lr": cfg.lr}]
    else:
        if ckpt is not None:
            hf = load_trained_weights(hf, ckpt)
        hf.requires_grad_(False)
        if cfg.method == "attention":
            keep = {id(p) for m in attention_modules(hf, get_architecture(hf)).values()
                    for p in m.parameters()}  # fmt: skip
            params = _sorted_named(hf, lambda n, p: id(p) in keep)
        else:
            params = _sorted_named(hf, lambda n, p: True)
        for p in params:
            p.requires_grad_(True)
        groups = [{"name": "base", "params": params, "lr": cfg.lr}]
    trainee = Trainee(cfg.method, 1, hf, hf, None, peft, groups, tokenizer, info)
    _check_only(hf, trainee.params, cfg.method)
    return trainee


def _with_focus(cfg: TrainConfig, hf: Any, ckpt: Path | None, tokenizer: Any, phase: int) -> Trainee:  # fmt: skip
    """``focus``, ``focus+lora`` and both phases of ``two-phase``."""
    lora = cfg.method == "focus+lora" or (phase == 2 and cfg.phase2_method == "lora")
    full = phase == 2 and not lora
    peft, info = None, {}
    if lora:
        peft, info = _loaded_lora(hf, ckpt) if ckpt is not None else _new_lora(hf, cfg)
    elif full and ckpt is not None:
        hf = load_trained_weights(hf, ckpt)
    fm = _focus(hf, cfg, ckpt)
    if set(fm.focus_layers) <= set(fm.focus_config.dense_layers):
        raise ValueError(
            f"dense_layers {list(fm.focus_config.dense_layers)}: every Focus layer runs dense "
            "attention, so the routers get no gradient and there is nothing to train; leave "
            "at least one Focus layer routed"
        )
    groups = [{"name": "routers", "params": trainable_parameters(fm), "lr": cfg.lr}]
    if lora:
        groups.append({"name": "lora", "params": _lora_params(hf), "lr": cfg.base_lr})
    elif full:
        params = _sorted_named(hf, lambda n, p: True)
        for p in params:
            p.requires_grad_(True)
        groups.append({"name": "base", "params": params, "lr": cfg.base_lr})
    trainee = Trainee(cfg.method, phase, fm, hf, fm, peft, groups, tokenizer, info)
    _check_only(fm, trainee.params, cfg.method)
    return trainee


def _head_gates(cfg: TrainConfig, hf: Any, ckpt: Path | None, tokenizer: Any) -> Trainee:
    """``head-gates``: the frozen Focus model of ``init_adapter`` (or of checkpoint
    ``ckpt``, its gates loaded too) with a gate per key-value head, every gate 1."""
    fm = _focus(hf, cfg, ckpt)
    fm.requires_grad_(False)
    gates = HeadGates(fm.focus_layers, kv_heads_of(hf.config)).attach(fm)
    if ckpt is not None:
        gates.load(ckpt)
    info = {"head_gates": {"model": cfg.model, "init_adapter": cfg.init_adapter,
                           "gate_penalty": cfg.gate_penalty, "gates": gates.values.numel()}}  # fmt: skip
    groups = [{"name": "gates", "params": [gates.values], "lr": cfg.lr}]
    trainee = Trainee(cfg.method, 1, fm, hf, fm, None, groups, tokenizer, info, gates)
    _check_only(fm, [], cfg.method)
    return trainee


def build_trainee(cfg: TrainConfig, base: Any, tokenizer: Any, ckpt: Path | None, step: int) -> Trainee:  # fmt: skip
    """The model of ``cfg.method`` on the base model ``base``: fresh, or continuing the
    checkpoint ``ckpt`` of optimizer step ``step`` (in the phase of its last step, so that
    its optimizer state fits).

    Raises:
        ValueError: LoRA targets that name no projection; every Focus layer in
            ``dense_layers``.
        RuntimeError: a parameter that is frozen or trainable against the method.
    """
    phase = phase_at(cfg, max(0, step - 1))
    if cfg.method == "head-gates":
        return _head_gates(cfg, base, ckpt, tokenizer)
    if cfg.method in FOCUS_METHODS:
        return _with_focus(cfg, base, ckpt, tokenizer, phase)
    return _dense(cfg, base, ckpt, tokenizer)


def start_phase2(trainee: Trainee, cfg: TrainConfig) -> Trainee:
    """Two-phase: the phase-2 model from the phase-1 one (same routers; the base weights
    made trainable, or a fresh LoRA injected)."""
    hf, fm = trainee.hf, trainee.focus
    groups = [{"name": "routers", "params": trainee.groups[0]["params"], "lr": cfg.lr}]
    peft, info = None, {}
    if cfg.phase2_method == "lora":
        peft, info = _new_lora(hf, cfg, fm)
        groups.append({"name": "lora", "params": _lora_params(hf), "lr": cfg.base_lr})
    else:
        params = _sorted_named(hf, lambda n, p: True)
        for p in params:
            p.requires_grad_(True)
        groups.append({"name": "base", "params": params, "lr": cfg.base_lr})
    new = Trainee(cfg.method, 2, fm, hf, fm, peft, groups, trainee.tokenizer, info)
    _check_only(fm, new.params, cfg.method)
    return new


def step_loss(trainee: Trainee, x: torch.Tensor, cfg: TrainConfig, generator: torch.Generator,
              forward: Any = None) -> StepLoss:  # fmt: skip
    """The loss of one micro-batch ``x`` (int64 ``[B, N]``): ``cfg.objective`` with Focus
    (:func:`~.objectives.objective_loss`); next-token cross-entropy (nats/token) of the
    dense model otherwise. ``forward`` runs the forward that carries the gradient (the
    model as the engine wraps it, such as DDP's module; default ``trainee.model``).

    Raises:
        RuntimeError: a non-finite loss.
    """
    if trainee.gates is not None:
        return head_gates_step(trainee.model, x, trainee.gates, cfg.gate_penalty, forward)
    if trainee.focus is not None:
        return objective_loss(trainee.model, x, cfg, generator, forward)
    loss = (forward or trainee.model)(input_ids=x, labels=x, use_cache=False).loss
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite training loss {float(loss)}")
    return StepLoss(loss, {"loss": float(loss.detach())})
