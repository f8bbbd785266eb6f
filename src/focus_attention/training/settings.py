"""Torch-free settings of the training package: :class:`PretrainConfig` (a from-scratch run,
docs/method.md §6 "From scratch") and its constants, the model shapes among them
(:class:`ModelSize`, :data:`SIZES`), so that ``focus pretrain --help`` and
settings files are read without importing torch or transformers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..hf.config import FocusConfig
from ..settings import (
    BatchSettings,
    BlockSettings,
    CorpusSettings,
    OutputSettings,
    RunSettings,
    SeedSettings,
    settings_class,
)
from ..utils.checks import bad, check_int, check_known_keys, check_number, comma_ints

__all__ = [
    "TrainingSettings",
    "ATTENTIONS",
    "MIN_VOCAB",
    "PRETRAIN_CONFIG_NAME",
    "PRETRAIN_NUM_GROUPS",
    "PRETRAIN_RESULT_NAME",
    "PRETRAIN_RESUME_FREE_FIELDS",
    "ROUTERS_MODULE",
    "PretrainConfig",
    "SIZES",
    "ModelSize",
    "resolve_size",
]

#: attention types of a from-scratch run
ATTENTIONS = ("focus", "dense")
#: name under which the Focus routers are registered inside the LLaMA model while it trains
ROUTERS_MODULE = "focus_routers"
#: files of an output directory
PRETRAIN_CONFIG_NAME = "pretrain_config.json"
PRETRAIN_RESULT_NAME = "pretrain_result.json"
#: fields that may differ between a run and its ``--resume``
PRETRAIN_RESUME_FREE_FIELDS = ("resume", "out", "threads", "progress")
#: the Focus settings of a from-scratch run: FocusConfig's, with K = 4 (the paper's
#: from-scratch setting) instead of its retrofit default 8
PRETRAIN_NUM_GROUPS = 4
#: byte-level BPE starts from the 256 byte symbols plus the special token
MIN_VOCAB = 257


@dataclass(frozen=True)
class ModelSize:
    """Shape of a LLaMA-style model (``transformers.LlamaConfig`` fields).

    Attributes:
        hidden_size: model width ``d_model``.
        num_layers: decoder layers.
        num_heads: attention heads; ``hidden_size / num_heads`` is the head width, which must
            be even (rotary embedding).
        num_kv_heads: key/value heads (grouped-query attention when fewer than the heads;
            must divide ``num_heads``).
        intermediate_size: width of the SwiGLU MLP.
        vocab_size: tokens of the BPE tokenizer trained for the run (the model takes the
            trained tokenizer's actual size, which is smaller on a tiny corpus).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        owner = "ModelSize"
        for f in dataclasses.fields(self):
            check_int(owner, f.name, getattr(self, f.name), 1)
        if self.vocab_size < MIN_VOCAB:
            raise bad(
                owner, "vocab_size", self.vocab_size, f"an int >= {MIN_VOCAB} (256 bytes + 1)"
            )
        if self.hidden_size % self.num_heads:
            raise bad(
                owner, "num_heads", self.num_heads, f"a divisor of hidden_size {self.hidden_size}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise bad(owner, "num_heads", self.num_heads,
                      "a head width hidden_size / num_heads that is even (rotary embedding)")  # fmt: skip
        if self.num_heads % self.num_kv_heads:
            raise bad(
                owner, "num_kv_heads", self.num_kv_heads, f"a divisor of num_heads {self.num_heads}"
            )

    def num_parameters(self, vocab_size: int | None = None) -> int:
        """Parameters of the model (tied input/output embedding), without Focus routers."""
        v = self.vocab_size if vocab_size is None else vocab_size
        d, f = self.hidden_size, self.intermediate_size
        kv = d // self.num_heads * self.num_kv_heads
        layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q, o, k, v, MLP, two RMSNorms
        return v * d + self.num_layers * layer + d


#: named sizes: ``tiny`` for tests (about 0.1M parameters), ``small`` (4.2M with its 4,096
#: tokens; the size of the README's comparison), ``medium`` (29M, for a GPU)
SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(64, 2, 2, 2, 128, 512),
    "small": ModelSize(256, 4, 4, 4, 688, 4096),
    "medium": ModelSize(512, 8, 8, 8, 1376, 8192),
}


def resolve_size(name: str, **overrides: int | None) -> ModelSize:
    """The preset ``name`` of :data:`SIZES` with the non-None ``overrides`` (field names of
    :class:`ModelSize`) applied, validated.

    Raises:
        ValueError: an unknown preset or field, or an invalid resulting shape.
    """
    if name not in SIZES:
        raise bad("PretrainConfig", "size", name, f"one of {sorted(SIZES)}")
    fields = {f.name for f in dataclasses.fields(ModelSize)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"ModelSize: unknown fields {unknown} (fields: {sorted(fields)})")
    size = dataclasses.replace(SIZES[name], **{k: v for k, v in overrides.items() if v is not None})
    size.validate()
    return size


@dataclass
class TrainingSettings(RunSettings, CorpusSettings, BlockSettings, BatchSettings, SeedSettings,
                       OutputSettings):  # fmt: skip
    """The settings ``focus train`` and ``focus pretrain`` share (each command gives some
    of them its own default): the run, the corpus and its blocks, the optimizer steps and
    their micro-batches, clipping, weight decay, validation tokens, checkpoints, resume."""

    steps: int = field(default=80, metadata={"help": "optimizer steps"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    warmup_steps: int = field(
        default=8, metadata={"help": "linear warm-up steps from 0, then cosine decay to 0"}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay"})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "gradient-norm clip (0 = no clipping)"}
    )
    eval_tokens: int = field(
        default=1024, metadata={"help": "validation tokens (whole seq_len blocks)"}
    )
    max_train_tokens: int | None = field(
        default=None, metadata={"help": "cap on training tokens (default: the whole split)"}
    )
    keep_checkpoints: int = field(default=2, metadata={"help": "newest checkpoints kept"})
    resume: bool = field(
        default=False, metadata={"help": "continue from the newest checkpoint in --out"}
    )


def _default_focus() -> FocusConfig:
    return FocusConfig(num_groups=PRETRAIN_NUM_GROUPS)


@settings_class(
    defaults={"corpus": "linux-docs", "seq_len": 512, "progress": False, "steps": 300,
              "batch_size": 4, "warmup_steps": 30, "weight_decay": 0.1, "eval_tokens": 8192}
)  # fmt: skip
class PretrainConfig(TrainingSettings):
    """Settings of a from-scratch run (docs/method.md §6, "From scratch").

    Defaults: the ``small`` model (4.2M parameters with its 4,096-token BPE) on ``linux-docs``
    in 512-token blocks, so the 128-token Focus window covers a quarter of the context; 300
    AdamW steps of 4 blocks (614,400 tokens) with a linear warm-up and cosine decay, validated
    and checkpointed every 50 steps. Focus uses :class:`~focus_attention.hf.FocusConfig`'s
    settings with ``num_groups`` K = 4, the paper's from-scratch setting (docs/method.md §7):
    with top-2 routing a distant key is then seen when its groups meet the query's, and
    top-1 and top-2 are both meaningful checks of the trained groups; the routers' ``seed``
    is the run's. Every field but ``focus`` is a ``focus pretrain`` flag; ``focus`` takes the
    FocusConfig flags (``routing``, ``layers``, ``seed`` excepted).

    Raises:
        ValueError: on construction or :meth:`validate`, naming the first bad field.
    """

    attention: str = field(
        default="focus", metadata={"help": "attention type", "choices": ATTENTIONS}
    )
    size: str = field(
        default="small", metadata={"help": "model size preset", "choices": tuple(SIZES)}
    )
    hidden_size: int | None = field(default=None, metadata={"help": "override the preset's width"})
    num_layers: int | None = field(default=None, metadata={"help": "override the preset's layers"})
    num_heads: int | None = field(default=None, metadata={"help": "override the preset's heads"})
    num_kv_heads: int | None = field(
        default=None, metadata={"help": "override the preset's key/value heads"}
    )
    intermediate_size: int | None = field(
        default=None, metadata={"help": "override the preset's MLP width"}
    )
    vocab_size: int | None = field(
        default=None, metadata={"help": "override the preset's BPE vocabulary (tokens)"}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "tokenizer directory to use instead of training one on the corpus"},
    )
    lr: float = field(default=2e-3, metadata={"help": "peak AdamW learning rate"})
    eval_every: int = field(
        default=50, metadata={"help": "validate and checkpoint every N steps (and at step 0)"}
    )
    eval_top_k: tuple[int, ...] = field(
        default=(1, 2),
        metadata={
            "help": "Focus top-k values validated besides soft routing",
            "type": comma_ints,
            "metavar": "K1,K2",
        },  # fmt: skip
    )
    log_every: int = field(default=10, metadata={"help": "log the training loss every N steps"})
    focus: FocusConfig = field(default_factory=_default_focus)

    def __post_init__(self) -> None:
        if isinstance(self.eval_top_k, list):
            self.eval_top_k = tuple(self.eval_top_k)
        self.validate()

    def validate(self) -> None:
        """Check every field; raises ``ValueError`` naming the first bad one."""
        owner = "PretrainConfig"
        self.check_shared()
        if self.attention not in ATTENTIONS:
            raise bad(owner, "attention", self.attention, f"one of {ATTENTIONS}")
        self.model_size()
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_tokens"):
            check_int(owner, name, getattr(self, name), 1)
        for name in ("keep_checkpoints", "log_every"):
            check_int(owner, name, getattr(self, name), 1)
        check_int(owner, "warmup_steps", self.warmup_steps, 0)
        check_int(owner, "max_train_tokens", self.max_train_tokens, 1, optional=True)
        check_number(owner, "lr", self.lr)
        check_number(owner, "weight_decay", self.weight_decay, inclusive=True)
        check_number(owner, "max_grad_norm", self.max_grad_norm, inclusive=True)
        if self.eval_tokens < self.seq_len:
            raise bad(owner, "eval_tokens", self.eval_tokens, f">= seq_len ({self.seq_len})")
        self._validate_focus()

    def _validate_focus(self) -> None:
        owner = "PretrainConfig"
        if not isinstance(self.focus, FocusConfig):
            raise bad(owner, "focus", self.focus, "a FocusConfig")
        self.focus = self.focus.replace(seed=self.seed)
        if self.focus.routing == "topk":
            raise bad(owner, "focus.routing", "topk", "'auto' or 'soft' (training routes softly)")
        k = self.focus.num_groups
        if not self.eval_top_k or any(not 1 <= t <= k for t in self.eval_top_k):
            raise bad(owner, "eval_top_k", self.eval_top_k, f"one or more ints in 1..{k}")
        if self.attention == "focus" and self.seq_len <= self.focus.window:
            raise bad(owner, "seq_len", self.seq_len,
                      f"more than the Focus window ({self.focus.window}): in shorter blocks "
                      "every pair is local and Focus is dense attention")  # fmt: skip

    def model_size(self) -> ModelSize:
        """The preset ``size`` with the override fields applied (:func:`resolve_size`)."""
        names = [f.name for f in dataclasses.fields(ModelSize)]
        overrides = {n: getattr(self, n) for n in names if n != "num_layers"}
        return resolve_size(self.size, num_layers=self.num_layers, **overrides)

    def run_name(self) -> str:
        """``<corpus>-<size>-<attention>-s<seed>`` (the default output folder's name)."""
        corpus = Path(str(self.corpus)).name.replace(" ", "-") or "corpus"
        return f"{corpus}-{self.size}-{self.attention}-s{self.seed}"

    def out_dir(self) -> Path:
        """``out``, or ``runs/pretrain/<run_name()>``."""
        return Path(self.out) if self.out is not None else Path("runs/pretrain") / self.run_name()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (``focus`` as :meth:`FocusConfig.to_dict`)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["eval_top_k"] = list(self.eval_top_k)
        d["focus"] = self.focus.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PretrainConfig:
        """Inverse of :meth:`to_dict` (``focus`` may be a partial dict of FocusConfig fields,
        missing ones taking the from-scratch defaults).

        Raises:
            ValueError: unknown keys or invalid values.
        """
        data = dict(data)
        focus = {**_default_focus().to_dict(), **dict(data.pop("focus", {}) or {})}
        check_known_keys("PretrainConfig", data, cls)
        return cls(**data, focus=FocusConfig.from_dict(focus))

    def locked_differences(self, other: PretrainConfig) -> dict[str, tuple[Any, Any]]:
        """Fields that differ from ``other``'s, except :data:`PRETRAIN_RESUME_FREE_FIELDS`."""
        mine, theirs = self.to_dict(), other.to_dict()
        return {
            k: (mine[k], theirs[k])
            for k in mine
            if k not in PRETRAIN_RESUME_FREE_FIELDS and mine[k] != theirs[k]
        }
