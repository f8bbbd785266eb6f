"""``TrainConfig``: the settings of a training run (docs/method.md §6), each field the one
source of its default and of its ``focus train`` flag."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import field
from pathlib import Path
from typing import Any

from ..hf.config import FocusConfig
from ..settings import BaseModelSettings, BosSettings, settings_class
from ..utils.checks import bad, check_int, check_known_keys, check_number
from .settings import TrainingSettings

__all__ = ["DEFAULT_LR", "METHODS", "OBJECTIVES", "RESUME_FREE_FIELDS", "TrainConfig"]

#: training losses (docs/method.md §6, "Objectives")
OBJECTIVES = ("lm", "distill", "mix", "coverage", "attention", "ranking")
#: the objectives that score the routers against the dense model's recorded attention on
#: sampled queries, with no soft forward of the model: the only ones of query-key routers
#: (``FocusConfig.router_input="query_key"``), and those ``question_weight`` weighs
RECORDED_OBJECTIVES = ("attention", "coverage", "ranking")
#: the recorded objectives of query-key routers only
QUERY_KEY_OBJECTIVES = ("attention", "ranking")

#: what trains (docs/method.md §6, "Methods"): the Focus routers of the frozen model; LoRA
#: on the attention projections (dense); every attention weight (dense); every base weight
#: (dense); LoRA and the routers together; routers first, then the base too (Focus active);
#: a gate per key-value head of a trained adapter (routers and base frozen)
METHODS = ("focus", "lora", "attention", "full", "focus+lora", "two-phase", "head-gates")
#: methods whose model has Focus routers
FOCUS_METHODS = ("focus", "focus+lora", "two-phase", "head-gates")
#: methods that use the LoRA settings (two-phase only with ``phase2_method = "lora"``)
LORA_METHODS = ("lora", "focus+lora", "two-phase")
#: peak learning rate when ``lr`` is not given: the routers' 3e-2 (the best of 3e-3, 1e-2,
#: 3e-2 on the validation book) for the Focus methods; 5e-4 for LoRA (a usual LoRA rate,
#: the first probe's); 5e-5 when pretrained weights themselves train (a usual fine-tuning
#: rate, 10x below LoRA's: every weight moves). None of the base-side rates was tuned here.
DEFAULT_LR = {"focus": 3e-2, "lora": 5e-4, "attention": 5e-5, "full": 5e-5,
              "focus+lora": 3e-2, "two-phase": 3e-2, "head-gates": 2e-2}  # fmt: skip
#: ``gate_penalty`` of ``--method head-gates`` when not given: the weight of the mean gate
#: beside the KL divergence (nats per token; DuoAttention's 0.05 is on another loss scale)
DEFAULT_GATE_PENALTY = 0.05
#: ``base_lr`` when not given: of LoRA matrices, of base weights
DEFAULT_BASE_LR = {"lora": 5e-4, "full": 5e-5}
#: the LoRA defaults (rank 8 on q, k, v and o; alpha = rank; no dropout)
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_TARGETS = ("q", "k", "v", "o")
#: with ``retrieval_blocks``, the last tokens of every block whose queries the coverage and
#: attention objectives always score (a needle prompt's question is about a dozen tokens)
QUESTION_TOKENS = 16

#: fields that may differ between a run and its ``--resume``: they do not change the trained
#: parameters (validation runs in eval mode, without bias updates or randomness)
RESUME_FREE_FIELDS = (
    "resume",
    "overwrite",
    "threads",
    "save_every",
    "keep_checkpoints",
    "progress",
    "eval_every",
    "eval_tokens",
    "out",
)
#: why a locked field cannot change on ``--resume`` (added to the error message)
RESUME_LOCKED_WHY = {
    "steps": "steps sets the learning-rate schedule (warm-up and cosine decay to 0 at the "
    "last step); to train longer start a new run with another --out",
}


def _lora_rank(text: str) -> int | str:
    """``"8"`` -> 8; ``"match"`` stays (the ``--lora-rank`` flag).

    Raises:
        argparse.ArgumentTypeError: neither a whole number nor ``match``.
    """
    if text.strip().lower() == "match":
        return "match"
    try:
        return int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected a rank like 8 or 'match', got {text!r}"
        ) from err


def _names(text: str) -> tuple[str, ...]:
    """``"q,v"`` -> ``("q", "v")`` (the ``--lora-targets`` flag)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _betas(text: str) -> tuple[float, float]:
    """``"0.9,0.99"`` -> ``(0.9, 0.99)`` (the ``--betas`` flag).

    Raises:
        argparse.ArgumentTypeError: not comma-separated numbers.
    """
    parts = [p for p in text.split(",") if p.strip()]
    try:
        return tuple(float(p) for p in parts)  # type: ignore[return-value]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected two numbers like 0.9,0.99, got {text!r}"
        ) from err


@settings_class(defaults={"seq_len": 512})
class TrainConfig(TrainingSettings, BaseModelSettings, BosSettings):
    """Settings of a training run (docs/method.md §6).

    Defaults are sized so that training plus the README's evaluation finish within about
    15 minutes on a 2-core CPU: 80 steps of one 512-token block (about 4-5 s per step with
    2 threads for smollm2-135m), leaving ~4-5 minutes for ``focus eval``'s 4,096 tokens. The
    learning rate 3e-2 was the best of 3e-3, 1e-2 and 3e-2 in 80-step runs scored on the
    validation book (never on the test book). ``method`` picks what trains
    (:data:`METHODS`); the defaults of the learning rates depend on it (:data:`DEFAULT_LR`,
    :data:`DEFAULT_BASE_LR`) and are filled in by :meth:`validate`.

    Every field but ``focus`` is a ``focus train`` flag (``seq_len`` -> ``--seq-len``); the
    Focus settings are the flags of :class:`~focus_attention.hf.FocusConfig` (``routing``,
    ``layers`` and ``seed`` excepted: training routes softly, every full-attention layer gets
    Focus, and the run's ``seed`` also seeds the routers).

    Attributes:
        focus: the Focus retrofit to train; its ``seed`` is set to the run's ``seed``
            (by :meth:`validate`, which construction calls).
        (the others: see each field's help text, ``focus train --help``)

    Raises:
        ValueError: on construction or :meth:`validate`, naming the first bad field.
    """

    method: str = field(
        default="focus",
        metadata={
            "help": "what trains (docs/method.md §6): focus = the Focus routers of the frozen "
            "model; lora = LoRA on the attention projections, dense attention; attention = "
            "every attention weight, dense; full = every base weight, dense; focus+lora = LoRA "
            "and the routers together; two-phase = the routers for --phase1-steps, then the "
            "base weights too (--phase2-method) with Focus active; head-gates = a gate per key-value "
            "head mixing its dense and Focus outputs, on pass-key prompts of the validation "
            "split, the --init-adapter's routers and the base frozen (--objective distill)",
            "choices": METHODS,
        },
    )
    lr: float | None = field(
        default=None,
        metadata={
            "help": "peak AdamW learning rate of what trains (the routers' with focus+lora "
            "and two-phase); default by method: focus 3e-2, lora 5e-4, attention and full "
            "5e-5, focus+lora and two-phase 3e-2, head-gates 2e-2"
        },
    )
    base_lr: float | None = field(
        default=None,
        metadata={
            "help": "focus+lora and two-phase: peak learning rate of the LoRA matrices or "
            "base weights that train beside the routers (default 5e-4 for LoRA, 5e-5 for "
            "base weights)"
        },
    )
    lora_rank: int | str | None = field(
        default=None,
        metadata={
            "help": "LoRA rank, or 'match': the rank whose trainable count is closest to the "
            "Focus routers' (default 8)",
            "type": _lora_rank,
            "metavar": "R|match",
        },
    )
    lora_alpha: float | None = field(
        default=None, metadata={"help": "LoRA alpha (scale alpha / rank; default = the rank)"}
    )
    lora_targets: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "attention projections that get LoRA: q, k, v, o (GPT-2's fused c_attn "
            "for q/k/v, c_proj for o) or module names (default q,k,v,o)",
            "type": _names,
            "metavar": "T1,T2,...",
        },
    )
    lora_dropout: float | None = field(
        default=None, metadata={"help": "dropout on the LoRA input (default 0)"}
    )
    phase1_steps: int | None = field(
        default=None,
        metadata={"help": "two-phase: steps of phase 1, routers only (default steps // 2)"},
    )
    phase2_method: str | None = field(
        default=None,
        metadata={
            "help": "two-phase: what trains beside the routers in phase 2: full = every base "
            "weight, lora = LoRA on the attention projections (default full)",
            "choices": ("full", "lora"),
        },
    )
    betas: tuple[float, float] = field(
        default=(0.9, 0.99),
        metadata={"help": "AdamW betas", "type": _betas, "metavar": "B1,B2"},
    )
    eval_every: int = field(
        default=0,
        metadata={
            "help": "validate every N steps, also at step 0 and at the end "
            "(0: only then; < 0: never)"
        },
    )
    save_every: int = field(
        default=20, metadata={"help": "checkpoint every N steps and at the end (0: end only)"}
    )
    overwrite: bool = field(
        default=False, metadata={"help": "delete an earlier run in --out and start again"}
    )
    objective: str = field(
        default="lm",
        metadata={
            "help": "training loss (docs/method.md §6): lm = next-token cross-entropy; "
            "distill = KL divergence from the frozen model's own dense output; mix = lm + "
            "distill_weight * distill; coverage = share of the dense model's attention beyond "
            "the window that the soft groups drop (query-key routers: per key-value head, "
            "the keys' groups Sinkhorn-balanced); attention = KL from the dense attention's "
            "mass per group to the query's groups (query-key routers, experimental); "
            "ranking = the same KL with the keys' groups Sinkhorn-balanced, so the query's "
            "top groups are those attention weighs most (query-key routers, experimental)",
            "choices": OBJECTIVES,
        },
    )
    distill_weight: float = field(
        default=1.0, metadata={"help": "weight of the distillation term in --objective mix"}
    )
    coverage_queries: int = field(
        default=512,
        metadata={
            "help": "queries per layer and block sampled for --objective coverage, attention "
            "and ranking (0: every query; the cost of the dense attention rows grows with it)"
        },
    )
    retrieval_blocks: int = field(
        default=0,
        metadata={
            "help": "needle prompts of --seq-len tokens mixed into the training blocks (a "
            "number hidden in the filler paragraph or in the train split's text, asked for at "
            "the end: the needle benchmark's prompts, depths drawn from 0.05-0.95); with them "
            "the --objective coverage and attention always score the last "
            f"{QUESTION_TOKENS} queries of each block, the question (default 0: none)"
        },
    )
    question_weight: float = field(
        default=1.0,
        metadata={
            "help": f"weight of each block's last {QUESTION_TOKENS} queries (a needle "
            "prompt's question) against the other sampled queries in --objective coverage, "
            "attention and ranking; needs --retrieval-blocks (default 1: every query alike)"
        },
    )
    init_adapter: str | None = field(
        default=None,
        metadata={
            "help": "start the Focus routers from this adapter folder (its projections, "
            "centroids and routing bias) instead of fresh ones, under this run's Focus "
            "settings: to continue training at another block length or window; its "
            "num_groups, group_dim and layers must be this run's (default: fresh routers)",
            "metavar": "DIR",
        },
    )
    gate_penalty: float | None = field(
        default=None,
        metadata={
            "help": "--method head-gates: the loss is KL(dense || gated) + gate_penalty * "
            f"mean gate (default {DEFAULT_GATE_PENALTY})"
        },
    )
    focus: FocusConfig = field(default_factory=FocusConfig)

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        """Check every field; raises ``ValueError`` naming the first bad one (the Focus
        settings are checked by :class:`~focus_attention.hf.FocusConfig`)."""
        owner = "TrainConfig"
        self.check_shared()
        check_int(owner, "steps", self.steps, 0)
        for name in ("batch_size", "grad_accum", "keep_checkpoints"):
            check_int(owner, name, getattr(self, name), 1)
        self._validate_method()
        check_number(owner, "lr", self.lr)
        check_int(owner, "warmup_steps", self.warmup_steps, 0)
        check_number(owner, "weight_decay", self.weight_decay, inclusive=True)
        # inf: no clipping, like 0
        check_number(owner, "max_grad_norm", self.max_grad_norm, inclusive=True, finite=False)
        betas = self.betas
        if not isinstance(betas, tuple) or len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise bad(owner, "betas", betas, "two numbers in [0, 1)")
        check_int(owner, "eval_every", self.eval_every)
        check_int(owner, "eval_tokens", self.eval_tokens, 1)
        check_int(owner, "save_every", self.save_every, 0)
        check_int(owner, "max_train_tokens", self.max_train_tokens, 1, optional=True)
        if self.objective not in OBJECTIVES:
            raise bad(owner, "objective", self.objective, f"one of {OBJECTIVES}")
        check_number(owner, "distill_weight", self.distill_weight, inclusive=True)
        check_int(owner, "coverage_queries", self.coverage_queries, 0)
        check_int(owner, "retrieval_blocks", self.retrieval_blocks, 0)
        if self.retrieval_blocks and self.method == "head-gates":
            raise bad(owner, "retrieval_blocks", self.retrieval_blocks,
                      "0 with --method head-gates, which trains on needle prompts only")  # fmt: skip
        check_number(owner, "question_weight", self.question_weight)
        if self.question_weight != 1.0 and not self.retrieval_blocks:
            raise bad(owner, "question_weight", self.question_weight,
                      "1 without --retrieval-blocks, whose questions it weighs")  # fmt: skip
        if self.question_weight != 1.0 and self.objective not in RECORDED_OBJECTIVES:
            raise bad(owner, "question_weight", self.question_weight,
                      "1 with --objective coverage, attention or ranking, the objectives it "
                      "weighs")  # fmt: skip
        if self.init_adapter is not None:
            if not isinstance(self.init_adapter, str) or not self.init_adapter:
                raise bad(owner, "init_adapter", self.init_adapter, "an adapter folder path")
            if self.method not in FOCUS_METHODS:
                raise bad(owner, "init_adapter", self.init_adapter,
                          f"None with --method {self.method}, which has no Focus routers")  # fmt: skip
        if self.resume and self.overwrite:
            raise bad(owner, "resume", self.resume, "not both resume and overwrite")
        self._validate_focus()

    def _validate_method(self) -> None:
        """Check ``method`` and its settings; fill in the method's default learning rates,
        ``phase1_steps`` and ``phase2_method``."""
        owner, method = "TrainConfig", self.method
        if method not in METHODS:
            raise bad(owner, "method", method, f"one of {METHODS}")
        if self.lr is None:
            self.lr = DEFAULT_LR[method]
        self._validate_gates()
        if method not in ("focus", "head-gates") and self.objective != "lm":
            raise bad(owner, "objective", self.objective,
                      f"'lm' with --method {method}: the other objectives compare with the "
                      "frozen dense model, which is no longer the untouched base once base "
                      "weights or LoRA train (or there is no Focus to train)")  # fmt: skip
        if method == "two-phase":
            if self.phase2_method is None:
                self.phase2_method = "full"
            if self.phase2_method not in ("full", "lora"):
                raise bad(owner, "phase2_method", self.phase2_method, "'full' or 'lora'")
            if self.phase1_steps is None:
                self.phase1_steps = self.steps // 2
            check_int(owner, "phase1_steps", self.phase1_steps, 0)
            if self.phase1_steps > self.steps:
                raise bad(owner, "phase1_steps", self.phase1_steps, f"at most steps ({self.steps})")
        else:
            for name in ("phase1_steps", "phase2_method"):
                if getattr(self, name) is not None:
                    raise bad(owner, name, getattr(self, name), "None (a two-phase setting)")
        if method in ("focus+lora", "two-phase"):
            if self.base_lr is None:
                self.base_lr = DEFAULT_BASE_LR["lora" if self.uses_lora() else "full"]
            check_number(owner, "base_lr", self.base_lr)
        elif self.base_lr is not None:
            raise bad(owner, "base_lr", self.base_lr,
                      f"None with --method {method} (use --lr)")  # fmt: skip
        self._validate_lora()

    def _validate_gates(self) -> None:
        """``--method head-gates``: an ``init_adapter``, the distill objective and a
        ``gate_penalty >= 0`` (filled in); other methods: no ``gate_penalty``."""
        owner = "TrainConfig"
        if self.method != "head-gates":
            if self.gate_penalty is not None:
                raise bad(owner, "gate_penalty", self.gate_penalty, "None: a head-gates setting")
            return
        if self.objective != "distill":
            raise bad(owner, "objective", self.objective,
                      "'distill' with --method head-gates (the gates learn to match the "
                      "dense model)")  # fmt: skip
        if self.init_adapter is None:
            raise bad(owner, "init_adapter", None, "the trained adapter whose heads get gates")
        if self.gate_penalty is None:
            self.gate_penalty = DEFAULT_GATE_PENALTY
        check_number(owner, "gate_penalty", self.gate_penalty, inclusive=True)

    def uses_lora(self) -> bool:
        """Whether this run trains LoRA matrices (lora, focus+lora, two-phase with
        ``phase2_method = "lora"``)."""
        if self.method == "two-phase":
            return self.phase2_method == "lora"
        return self.method in LORA_METHODS

    def _validate_lora(self) -> None:
        owner = "TrainConfig"
        names = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
        if not self.uses_lora():
            for name in names:
                if getattr(self, name) is not None:
                    raise bad(owner, name, getattr(self, name),
                              f"None: --method {self.method} trains no LoRA")  # fmt: skip
            return
        rank = self.lora_rank
        if rank is not None and rank != "match":
            check_int(owner, "lora_rank", rank, 1)
        if self.lora_alpha is not None:
            check_number(owner, "lora_alpha", self.lora_alpha)
        if isinstance(self.lora_targets, list):
            self.lora_targets = tuple(self.lora_targets)
        targets = self.lora_targets
        if targets is not None and (not isinstance(targets, tuple) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):  # fmt: skip
            raise bad(owner, "lora_targets", targets, "one or more module names")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise bad(owner, "lora_dropout", self.lora_dropout, "a number in [0, 1)")

    def _validate_router_input(self) -> None:
        """``--objective attention`` and ``ranking`` train query-key routers; they have no
        soft routing, so they train with those or with ``coverage`` only."""
        query_key = self.focus.router_input == "query_key"
        if self.objective in QUERY_KEY_OBJECTIVES and not query_key:
            raise bad("TrainConfig", "objective", self.objective,
                      "another objective unless focus.router_input is 'query_key' (it trains "
                      "query-key routers)")  # fmt: skip
        if query_key and self.objective not in RECORDED_OBJECTIVES:
            raise bad("TrainConfig", "focus.router_input", "query_key",
                      f"'hidden_state' with objective {self.objective!r} (query-key routers "
                      "have no soft routing: train them with --objective attention, "
                      "coverage or ranking)")  # fmt: skip
        if query_key and self.method != "focus":
            raise bad("TrainConfig", "focus.router_input", "query_key",
                      f"'hidden_state' with method {self.method!r} (query-key routers train "
                      "with --method focus)")  # fmt: skip

    def _validate_focus(self) -> None:
        owner = "TrainConfig"
        if not isinstance(self.focus, FocusConfig):
            raise bad(owner, "focus", self.focus, "a FocusConfig")
        if self.focus.seed != self.seed:  # the run's seed also seeds the routers
            self.focus = self.focus.replace(seed=self.seed)
        if self.focus.routing == "topk":
            raise bad(owner, "focus.routing", "topk", "'auto' or 'soft' (training routes softly)")
        self.focus.check_straight_through()
        self._validate_router_input()
        if self.focus.straight_through and self.method not in FOCUS_METHODS:
            raise bad(
                owner,
                "focus.straight_through",
                True,
                f"False with method {self.method!r} (it trains no Focus routing)",
            )
        if self.focus.straight_through and self.objective in RECORDED_OBJECTIVES:
            raise bad(
                owner,
                "focus.straight_through",
                True,
                f"False with objective {self.objective!r} (it computes no soft attention)",
            )
        window = self.focus.window
        if self.method in FOCUS_METHODS and self.seq_len <= window:
            raise bad(
                owner,
                "seq_len",
                self.seq_len,
                f"more than window ({window}): in blocks of {self.seq_len} tokens every "
                "pair is inside the local window, so routing changes nothing and the centroids "
                "get no gradient (use a longer --seq-len or a smaller --window)",
            )

    def focus_config(self) -> FocusConfig:
        """The :class:`~focus_attention.hf.FocusConfig` of this run: ``focus`` with its
        ``seed`` set to the run's ``seed``."""
        return self.focus.replace(seed=self.seed)

    def out_dir(self) -> Path:
        """``out``, or ``runs/<corpus name>`` when ``out`` is None."""
        if self.out is not None:
            return Path(self.out)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(self.corpus)).name).strip("-.")
        return Path("runs") / (slug or "focus")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field; ``focus`` as :meth:`FocusConfig.to_dict` of
        :meth:`focus_config`."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["betas"] = list(self.betas)
        if self.lora_targets is not None:
            d["lora_targets"] = list(self.lora_targets)
        d["focus"] = self.focus_config().to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`. A flat dict whose Focus settings sit beside the run's
        (the layout of earlier ``train_config.json`` files) is read too.

        Raises:
            ValueError: unknown keys or invalid values.
        """
        data = dict(data)
        focus_keys = {f.name for f in dataclasses.fields(FocusConfig)} - {"seed"}
        focus = dict(data.pop("focus", {}) or {})
        for key in sorted(focus_keys & set(data)):
            focus[key] = data.pop(key)
        check_known_keys("TrainConfig", data, cls)
        return cls(**data, focus=FocusConfig.from_dict(focus))

    def locked_differences(self, other: TrainConfig) -> dict[str, tuple[Any, Any]]:
        """Fields that differ between ``self`` and ``other``, except
        :data:`RESUME_FREE_FIELDS`: ``{name: (self's, other's)}``, the Focus settings as
        ``focus.<name>``."""
        mine, theirs = self.to_dict(), other.to_dict()
        diff = {
            name: (mine[name], theirs[name])
            for name in mine
            if name not in RESUME_FREE_FIELDS and name != "focus" and mine[name] != theirs[name]
        }
        for name, value in mine["focus"].items():  # the Focus settings one by one
            if value != theirs["focus"].get(name):
                diff[f"focus.{name}"] = (value, theirs["focus"].get(name))
        return diff
