"""``focus train``: centroid-only Focus training of a frozen pretrained causal LM (issue 4 s. 2).

Only the Focus routers (``W_g`` and the centroids ``C`` of every Focus layer, spec section 1)
are trained; every base parameter is frozen (asserted before the first step). The model is in
soft Sinkhorn routing with the soft gate while training (spec sections 2-3); each soft batch
also updates the routers' calibrated causal bias used by top-k inference (spec section 4).
The base model itself runs in ``eval()`` mode (no dropout): it is frozen, only the routers
are in training mode.

Recipe (product decisions; the paper gives neither optimizer nor learning rate):

* data: the corpus' ``train`` split tokenised into non-overlapping ``seq_len`` blocks
  (:func:`focus_attention.data.token_blocks`, documents joined with EOS), optionally capped
  at ``max_train_tokens``; blocks are visited in a seeded random order, one fresh
  permutation per epoch, so the data of a step depends only on ``(seed, step)`` and a resumed
  run sees exactly the data of an uninterrupted one;
* loss: mean next-token cross-entropy over the ``batch_size * grad_accum`` blocks of a step;
* AdamW on the Focus parameters only, gradient-norm clipping, learning rate linear warm-up
  from 0 over ``warmup_steps`` then cosine decay to 0 at ``steps``;
* validation perplexity (top-k and soft routing) on the first ``eval_tokens`` tokens of the
  ``validation`` split in ``seq_len`` windows (same scheme as :mod:`focus_attention.evaluate`)
  at step 0, every ``eval_every`` steps and at the end.

Outputs under ``out``: the final adapter (``focus_config.json`` + ``focus_model.safetensors``,
loadable with ``FocusModel.from_pretrained``), ``train_config.json``, ``log.jsonl`` (one JSON
object per step), ``train_result.json``, ``train.png`` (loss and validation PPL over steps)
and ``checkpoints/step-NNNNNNN/`` (adapter + ``trainer_state.pt``: optimizer, scheduler, RNG
states, step, elapsed seconds). Every file is written atomically; a checkpoint directory is
built under a temporary name and renamed into place, so an interrupted save never leaves a
half checkpoint. Ctrl-C (SIGINT / ``KeyboardInterrupt``) between or during steps saves a
checkpoint of the last completed step and the adapter, then re-raises; a SIGINT arriving
during the optimizer update or a save is deferred until that finishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .utils.checks import bad, check_int, check_number
from .utils.io import atomic_write, atomic_write_text, staged_directory, write_json_atomic

if TYPE_CHECKING:  # pragma: no cover
    import argparse

    import torch

__all__ = [
    "CHECKPOINT_DIR",
    "STATE_NAME",
    "TrainConfig",
    "TrainResult",
    "latest_checkpoint",
    "register_cli",
    "train",
]

#: sub-directory of ``out`` holding the step checkpoints
CHECKPOINT_DIR = "checkpoints"
#: trainer state file inside a checkpoint directory
STATE_NAME = "trainer_state.pt"
#: version of the trainer state layout
STATE_FORMAT = 1

#: FocusConfig fields that ``TrainConfig`` exposes (CLI flag = field name with dashes)
FOCUS_FIELDS = (
    "num_groups",
    "top_k",
    "window",
    "gate",
    "gate_sharpness",
    "temperature",
    "sink_tokens",
    "group_dim",
    "sinkhorn_iters",
    "inference_routing",
)
#: TrainConfig fields that may differ between a run and its ``--resume`` (they do not change
#: the trained parameters: validation runs in eval mode, without bias updates or randomness)
RESUME_FREE_FIELDS = (
    "resume",
    "overwrite",
    "threads",
    "save_every",
    "keep_checkpoints",
    "progress",
    "eval_every",
    "eval_tokens",
)
#: why a locked field cannot change on ``--resume`` (added to the error message)
_RESUME_LOCKED_WHY = {
    "steps": "steps sets the learning-rate schedule (warm-up and cosine decay to 0 at the "
    "last step); to train longer start a new run with another --out",
}


@dataclass
class TrainConfig:
    """Settings of a centroid-only training run (issue 4 section 2).

    Defaults are sized so that training plus the README's evaluation finish within about
    15 minutes on a 2-core CPU: 80 steps of one 512-token block (about 4-5 s per step with
    2 threads for smollm2-135m, so ~6-7 minutes with validation), leaving ~4-5 minutes for
    ``focus eval``'s default 4,096 tokens. The learning rate 3e-2 was the best of 3e-3, 1e-2
    and 3e-2 in 80-step runs scored on the validation book (never on the test book).

    Attributes:
        model: registered model name, local model directory or hub id
            (:func:`focus_attention.models.load_model`).
        corpus: registered corpus or local text file/folder (:func:`focus_attention.data.load_corpus`).
        out: output directory (created); ``None`` means ``runs/<corpus name>``.
        steps: optimizer steps (0 saves the untrained, freshly initialised adapter).
        seq_len: tokens per training block.
        batch_size: blocks per micro-batch.
        grad_accum: micro-batches per optimizer step (tokens per step =
            ``seq_len * batch_size * grad_accum``).
        lr: peak AdamW learning rate.
        warmup_steps: linear warm-up steps (from 0 to ``lr``), then cosine decay to 0.
        weight_decay: AdamW decoupled weight decay on the Focus parameters.
        betas: AdamW betas.
        max_grad_norm: gradient-norm clip (``0`` disables clipping).
        seed: seeds Python, NumPy and torch, the data order and the router initialisation.
        eval_every: validation every this many steps, and at step 0 (where the base model is
            scored too) and at the end; ``0``: only at step 0 and at the end; a negative
            value disables validation.
        eval_tokens: validation tokens (cap on the validation stream; whole ``seq_len``
            windows).
        save_every: checkpoint every this many steps (and at the end); ``0``: only at the end.
        keep_checkpoints: how many step checkpoints to keep (the newest).
        max_train_tokens: cap on the training-token stream (``None``: the whole split).
        threads: torch intra-op threads (``None``: torch's default).
        resume: continue from the newest checkpoint under ``out``.
        overwrite: delete an earlier run's log and checkpoints in ``out`` and start again.
        progress: show a tqdm progress bar.
        prepend_bos: start each block with BOS (``None``: automatic, True for Gemma models).
        num_groups, top_k, window, gate, gate_sharpness, temperature, sink_tokens, group_dim,
        sinkhorn_iters, inference_routing: the :class:`~focus_attention.hf.FocusConfig`
            fields of the same names (``FocusConfig.seed`` is ``seed``).
    """

    model: str = "smollm2-135m"
    corpus: str = "austen"
    out: str | None = None
    steps: int = 80
    seq_len: int = 512
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 3e-2
    warmup_steps: int = 8
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    seed: int = 0
    eval_every: int = 0
    eval_tokens: int = 1024
    save_every: int = 20
    keep_checkpoints: int = 2
    max_train_tokens: int | None = None
    threads: int | None = None
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    prepend_bos: bool | None = None
    # FocusConfig
    num_groups: int = 8
    top_k: int = 2
    window: int = 128
    gate: str = "log"
    gate_sharpness: float = 10.0
    temperature: float = 0.1
    sink_tokens: int = 4
    group_dim: int = 16
    sinkhorn_iters: int = 10
    inference_routing: str = "causal"

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        """Check the ranges; raises ``ValueError`` naming the first bad field (the Focus
        fields are checked by ``FocusConfig``)."""
        owner = "TrainConfig"
        check_int(owner, "steps", self.steps, 0)
        check_int(owner, "seq_len", self.seq_len, 2)
        for name in ("batch_size", "grad_accum", "keep_checkpoints"):
            check_int(owner, name, getattr(self, name), 1)
        check_number(owner, "lr", self.lr)
        check_int(owner, "warmup_steps", self.warmup_steps, 0)
        check_number(owner, "weight_decay", self.weight_decay, inclusive=True)
        # inf: no clipping, like 0
        check_number(owner, "max_grad_norm", self.max_grad_norm, inclusive=True, finite=False)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise bad(owner, "betas", self.betas, "two in [0, 1)")
        check_int(owner, "seed", self.seed)
        check_int(owner, "eval_every", self.eval_every)
        check_int(owner, "eval_tokens", self.eval_tokens, 1)
        check_int(owner, "save_every", self.save_every, 0)
        check_int(owner, "max_train_tokens", self.max_train_tokens, 1, optional=True)
        check_int(owner, "threads", self.threads, 1, optional=True)
        if self.resume and self.overwrite:
            raise bad(owner, "resume", self.resume, "not both resume and overwrite")
        self.focus_config()  # validates the Focus fields
        if self.seq_len <= self.window:
            raise bad(
                owner,
                "seq_len",
                self.seq_len,
                f"more than window ({self.window}): in blocks of {self.seq_len} tokens every "
                "pair is inside the local window, so routing changes nothing and the centroids "
                "get no gradient (use a longer --seq-len or a smaller --window)",
            )

    def focus_config(self):
        """The :class:`~focus_attention.hf.FocusConfig` of this run (``seed`` = ``seed``).

        Raises:
            ValueError: a Focus field out of range (the message names it).
        """
        from .hf import FocusConfig

        return FocusConfig(**{k: getattr(self, k) for k in FOCUS_FIELDS}, seed=self.seed)

    def out_dir(self) -> Path:
        """``out``, or ``runs/<corpus name>`` when ``out`` is None."""
        if self.out is not None:
            return Path(self.out)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(self.corpus)).name).strip("-.")
        return Path("runs") / (slug or "focus")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TrainConfig: unknown keys {unknown}")
        return cls(**data)


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        out: the output directory (final adapter, log, plot, checkpoints).
        steps: optimizer steps completed in total (including those before a resume).
        start_step: the step this call started from (0, or the resumed checkpoint's).
        losses: training loss (mean next-token cross-entropy, nats/token) of every step run
            by this call, in order.
        validation: the validation records of this call: dicts with ``step``,
            ``val_ppl_topk``, ``val_ppl_soft``, ``val_tokens`` (and ``val_ppl_base`` at step
            0).
        final_loss: loss of the last step (``None`` if no step ran).
        seconds: wall-clock seconds of this call (loading included).
        train_seconds: cumulative seconds spent in the training loop over all resumes.
        trainable_parameters: number of trained (Focus) parameters.
        adapter: directory of the final adapter (= ``out``).
        checkpoint: directory of the last checkpoint written (or ``None``).
        log: path of ``log.jsonl``; plot: path of ``train.png`` (``None`` if not written).
    """

    out: Path
    steps: int
    start_step: int
    losses: list[float]
    validation: list[dict[str, Any]]
    final_loss: float | None
    seconds: float
    train_seconds: float
    trainable_parameters: int
    adapter: Path
    checkpoint: Path | None
    log: Path
    plot: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (paths as strings)."""
        d = dataclasses.asdict(self)
        for k in ("out", "adapter", "checkpoint", "log", "plot"):
            d[k] = None if d[k] is None else str(d[k])
        return d


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (CPU and CUDA)."""
    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    except ImportError:  # pragma: no cover
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def lr_factor(step: int, steps: int, warmup_steps: int) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based): ``(step + 1) /
    warmup_steps`` during warm-up, then a cosine from 1 to 0 over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    rest = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / rest)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def auto_prepend_bos(model: Any) -> bool:
    """True for models trained with a BOS at every sequence start (Gemma family)."""
    return str(getattr(model.config, "model_type", "")).startswith("gemma")


class _SigintGuard:
    """Turns SIGINT into ``KeyboardInterrupt`` at once, except inside :meth:`critical`
    sections (optimizer update, saves), where it is deferred to the section's end. Installed
    only in the main thread (elsewhere it is a no-op)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _SigintGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.depth > 0:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0 and self.pending:
                self.pending = False
                raise KeyboardInterrupt


def latest_checkpoint(out: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory under ``out/checkpoints`` (or ``None``).

    Complete checkpoints are ``step-NNNNNNN`` directories holding a trainer state (they are
    renamed into place only when complete)."""
    root = Path(out) / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in root.iterdir():
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and (p / STATE_NAME).is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), p)
    return None if best is None else best[1]


def _sample_indices(step: int, micro: int, cfg: TrainConfig, n_blocks: int) -> list[int]:
    """Block indices of micro-batch ``micro`` of optimizer step ``step``: a seeded random
    permutation of the blocks per epoch (depends only on seed, step and micro)."""
    import torch

    per_step = cfg.batch_size * cfg.grad_accum
    first = step * per_step + micro * cfg.batch_size
    out = []
    perm_epoch, perm = -1, None
    for i in range(first, first + cfg.batch_size):
        epoch, pos = divmod(i, n_blocks)
        if epoch != perm_epoch:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
            perm = torch.randperm(n_blocks, generator=gen)
            perm_epoch = epoch
        out.append(int(perm[pos]))
    return out


def _dominances(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean and max over layers of: the share of tokens whose largest Sinkhorn weight lies in
    the most popular group (``dominance``; the paper's collapse measure), and the share of
    causal top-k memberships held by the largest group (``dominance_topk``)."""
    import torch

    from .ops import dominance

    soft, hard = [], []
    for r in records:
        probs = r.get("probs")
        if probs is not None:
            onehot = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).bool()
            soft.append(dominance(onehot, r.get("key_padding")))
        if r.get("query_groups") is not None:
            pad = r.get("key_padding")
            if pad is not None:
                pad = pad[:, pad.shape[1] - r["query_groups"].shape[1] :]
            hard.append(dominance(r["query_groups"], pad))
    out: dict[str, float] = {}
    if soft:
        out["dominance"] = sum(soft) / len(soft)
        out["dominance_max"] = max(soft)
    if hard:
        out["dominance_topk"] = sum(hard) / len(hard)
    return out


def _trainable(fm: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, parameter) pairs that require grad, sorted by name, after checking that
    they are exactly the Focus routers' parameters (the base model is frozen).

    Raises:
        RuntimeError: a base parameter requires grad, or no Focus parameter does.
    """
    named = sorted((n, p) for n, p in fm.named_parameters() if p.requires_grad)
    router_ids = {id(p) for p in fm.routers.parameters()}
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
    return named


def _save_checkpoint(fm: Any, opt: Any, sched: Any, step: int, elapsed: float,
                     cfg: TrainConfig, out: Path) -> Path:  # fmt: skip
    """Write ``out/checkpoints/step-NNNNNNN`` (adapter + trainer state) atomically and prune
    older checkpoints beyond ``keep_checkpoints``. An existing checkpoint of the same step is
    kept as it is."""
    import torch

    root = out / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    if not (final / STATE_NAME).is_file():
        # a directory without state at ``final`` (leftover of a foreign tool) is replaced
        with staged_directory(final, root, prefix=f".tmp-step-{step:07d}-") as tmp:
            fm.save_pretrained(tmp)
            state = {
                "format": STATE_FORMAT,
                "step": step,
                "elapsed": elapsed,
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "rng": _rng_state(),
                "config": cfg.to_dict(),
            }
            atomic_write(tmp / STATE_NAME, lambda path: torch.save(state, path))
    steps = sorted(
        (int(p.name[5:]), p)
        for p in root.iterdir()
        if re.fullmatch(r"step-\d+", p.name) and (p / STATE_NAME).is_file()
    )
    for _, p in steps[: max(0, len(steps) - cfg.keep_checkpoints)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a hard kill: drop it
            continue
    return rows


def _prepare_out(out: Path, cfg: TrainConfig) -> None:
    """Refuse to mix runs: ``out`` may hold an earlier run only with ``resume`` (continue)
    or ``overwrite`` (its log, checkpoints, adapter, plot and results are deleted)."""
    existing = [
        name
        for name in (CHECKPOINT_DIR, "log.jsonl", "focus_config.json", "train_result.json")
        if (out / name).exists()
    ]
    if cfg.resume:
        return
    if existing and not cfg.overwrite:
        raise ValueError(
            f"{out} already holds a training run ({', '.join(existing)}): pass --resume to "
            "continue it or --overwrite to start again"
        )
    if existing:
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
        for name in ("log.jsonl", "focus_config.json", "focus_model.safetensors",
                     "train_result.json", "train.png", "train_config.json"):  # fmt: skip
            (out / name).unlink(missing_ok=True)


def write_plot(log_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path | None:
    """Plot training loss and validation perplexity (top-k and soft) over steps from a
    ``log.jsonl`` into ``png_path`` (matplotlib Agg, written atomically).

    Returns:
        the path written, or ``None`` when the log has nothing to plot.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = _read_log(Path(log_path))
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_ppl_topk" in r]
    if not train_rows and not val_rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train_rows:
        xs = [r["step"] for r in train_rows]
        ys = [r["loss"] for r in train_rows]
        ax1.plot(xs, ys, lw=0.8, alpha=0.5, label="loss (soft routing)")
        span = max(1, len(ys) // 20)
        if span > 1:
            smooth = [sum(ys[max(0, i - span + 1) : i + 1]) / len(ys[max(0, i - span + 1) : i + 1])
                      for i in range(len(ys))]  # fmt: skip
            ax1.plot(xs, smooth, lw=1.5, label=f"mean of last {span}")
        ax1.legend()
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (nats/token)")
    ax1.set_title("training loss")
    if val_rows:
        xs = [r["step"] for r in val_rows]
        ax2.plot(xs, [r["val_ppl_topk"] for r in val_rows], "o-", label="Focus top-k")
        ax2.plot(xs, [r["val_ppl_soft"] for r in val_rows], "s-", label="Focus soft")
        base = [r.get("val_ppl_base") for r in val_rows if r.get("val_ppl_base") is not None]
        if base:
            ax2.axhline(base[0], color="gray", ls="--", label="base model")
        ax2.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("validation perplexity")
    ax2.set_title("validation perplexity")
    fig.tight_layout()
    png = Path(png_path)
    try:
        atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return png


def _validate(fm: Any, blocks: torch.Tensor, *, base: bool = False) -> dict[str, Any]:
    """Validation perplexity of ``blocks`` with top-k and with soft routing (eval mode, no
    bias update) and, with ``base``, of the base model (Focus disabled); the model is put
    back into training mode (base model in eval mode)."""
    from .evaluate import score_windows

    fm.eval()
    extra = {}
    try:
        if base:
            with fm.disable_focus():
                nll_base, n = score_windows(fm, blocks)
            extra["val_ppl_base"] = math.exp(nll_base / n)
        fm.set_routing("topk")
        nll_topk, n = score_windows(fm, blocks)
        fm.set_routing("soft")
        nll_soft, _ = score_windows(fm, blocks)
    finally:
        fm.set_routing("auto")
        fm.train()
        fm.base_model.eval()
    return {
        "val_ppl_topk": math.exp(nll_topk / n),
        "val_ppl_soft": math.exp(nll_soft / n),
        "val_tokens": n,
        **extra,
    }


#: what :attr:`TrainResult.validation` keeps of a validation record
_VALIDATION_KEYS = ("step", "val_ppl_topk", "val_ppl_soft", "val_tokens", "val_ppl_base")


def _finished_result(out: Path, ckpt: Path, state: dict[str, Any], t_call: float) -> TrainResult:
    """``--resume`` of a run whose newest checkpoint is its last step: say so and touch
    nothing (the adapter, log, plot and ``train_result.json`` stay as they are)."""
    from safetensors.torch import load_file

    from .hf.model import WEIGHTS_NAME

    step = int(state["step"])
    print(
        f"focus train: nothing to do: run already finished at step {step} ({out}); "
        "its files are left as they are",
        file=sys.stderr,
    )
    tensors = load_file(str(ckpt / WEIGHTS_NAME))
    n_trainable = sum(t.numel() for k, t in tensors.items() if k.endswith((".proj", ".centroids")))
    png = out / "train.png"
    return TrainResult(
        out=out,
        steps=step,
        start_step=step,
        losses=[],
        validation=[],
        final_loss=None,
        seconds=time.monotonic() - t_call,
        train_seconds=float(state["elapsed"]),
        trainable_parameters=n_trainable,
        adapter=out,
        checkpoint=ckpt,
        log=out / "log.jsonl",
        plot=png if png.is_file() else None,
        extra={"already_finished": True},
    )


def _eval_due(step: int, cfg: TrainConfig) -> bool:
    if cfg.eval_every < 0:
        return False
    return step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def train(
    config: TrainConfig,
    *,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train the Focus centroids of a frozen pretrained causal LM (issue 4 section 2).

    Args:
        config: the :class:`TrainConfig`.
        callback: called as ``callback(step, record)`` after every optimizer step with the
            1-based step count and its log record (after validation, before the periodic
            checkpoint). An exception raised there stops training; ``KeyboardInterrupt``
            is handled like Ctrl-C.

    Returns:
        a :class:`TrainResult`; the final adapter is in ``config.out_dir()``.

    Raises:
        ValueError: bad configuration, an ``out`` directory holding another run (without
            ``resume``/``overwrite``), a ``resume`` whose settings differ from the
            checkpoint's (other than :data:`RESUME_FREE_FIELDS`), too little text.
        FileNotFoundError: ``resume`` without a checkpoint.
        RuntimeError: base parameters that require grad, a non-finite loss, base weights
            that changed (SHA-256 of every base tensor before and after training).
        KeyboardInterrupt: after Ctrl-C, once the adapter (in ``out``) and a checkpoint of
            the last completed step are saved.
    """
    import torch
    from tqdm.auto import tqdm

    from .bench import environment
    from .data import load_corpus, token_blocks
    from .evaluate import library_versions, weights_sha256
    from .hf import FocusModel, get_focus_model
    from .models import load_model

    t_call = time.monotonic()
    cfg = config
    cfg.validate()
    out = cfg.out_dir()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    _prepare_out(out, cfg)
    state = None
    ckpt = None
    if cfg.resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {out / CHECKPOINT_DIR}")
        state = torch.load(ckpt / STATE_NAME, weights_only=True)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{ckpt}: trainer state format {state.get('format')!r} unsupported")
        saved = TrainConfig.from_dict(state["config"])
        diff = {
            f.name: (getattr(saved, f.name), getattr(cfg, f.name))
            for f in dataclasses.fields(TrainConfig)
            if f.name not in RESUME_FREE_FIELDS + ("out",)
            and getattr(saved, f.name) != getattr(cfg, f.name)
        }
        if diff:
            why = "".join(f"; {_RESUME_LOCKED_WHY[k]}" for k in diff if k in _RESUME_LOCKED_WHY)
            raise ValueError(
                f"--resume: settings differ from the checkpoint {ckpt} "
                f"(field: (checkpoint, now)): {diff}{why}"
            )
        if int(state["step"]) >= cfg.steps:
            return _finished_result(out, ckpt, state, t_call)
    quiet = not cfg.progress
    corpus = load_corpus(cfg.corpus, quiet=quiet)  # a bad corpus fails before the model loads
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "train_config.json", cfg.to_dict())
    seed_everything(cfg.seed)

    model, tokenizer = load_model(cfg.model, quiet=quiet)
    bos = auto_prepend_bos(model) if cfg.prepend_bos is None else cfg.prepend_bos
    train_blocks = token_blocks(tokenizer, corpus.texts("train"), cfg.seq_len,
                                max_tokens=cfg.max_train_tokens, prepend_bos=bos)  # fmt: skip
    val_blocks = None
    if cfg.eval_every >= 0:
        val_blocks = token_blocks(tokenizer, corpus.texts("validation"), cfg.seq_len,
                                  max_tokens=cfg.eval_tokens, prepend_bos=bos)  # fmt: skip
    n_blocks = int(train_blocks.shape[0])
    sha_before = weights_sha256(model)

    if ckpt is not None:
        fm = FocusModel.from_pretrained(model, ckpt, is_trainable=True)
    else:
        fm = get_focus_model(model, cfg.focus_config())
    named = _trainable(fm)
    params = [p for _, p in named]
    n_trainable = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.steps, cfg.warmup_steps)
    )
    step, elapsed = 0, 0.0
    log_path = out / "log.jsonl"
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        step, elapsed = int(state["step"]), float(state["elapsed"])
        kept = [r for r in _read_log(log_path) if r.get("step", 0) <= step]
        atomic_write_text(log_path, "".join(json.dumps(r) + "\n" for r in kept))
    else:
        log_path.unlink(missing_ok=True)
    start_step = step
    fm.train()
    fm.base_model.eval()
    if fm.routing_mode != "soft":  # pragma: no cover - adapter contract
        raise RuntimeError(f"training expects soft routing, the adapter uses {fm.routing_mode}")
    tokens_per_step = cfg.seq_len * cfg.batch_size * cfg.grad_accum
    if not quiet:
        print(
            f"focus train: {cfg.model} on {corpus.name} -> {out}\n"
            f"  trainable (Focus) parameters: {n_trainable:,d} of "
            f"{sum(p.numel() for p in fm.parameters()):,d}; {len(fm.focus_layers)} Focus layers\n"
            f"  {n_blocks} training blocks of {cfg.seq_len} tokens; {tokens_per_step} tokens/step"
            + (f"; validation {val_blocks.numel()} tokens" if val_blocks is not None else ""),
            file=sys.stderr,
        )

    losses: list[float] = []
    validation: list[dict[str, Any]] = []
    last_ckpt: Path | None = ckpt
    logged_steps = {r.get("step") for r in _read_log(log_path) if "val_ppl_topk" in r}
    pbar = tqdm(total=cfg.steps, initial=step, disable=quiet, desc="train", dynamic_ncols=True,
                file=sys.stderr)  # fmt: skip
    interrupted = False
    with _SigintGuard() as guard, open(log_path, "a") as log:

        def emit(rec: dict[str, Any], started: float) -> None:
            """Add the time since ``started`` to the loop time and log ``rec`` with it."""
            nonlocal elapsed
            elapsed += time.monotonic() - started
            rec["seconds"] = round(elapsed, 3)
            log.write(json.dumps(rec) + "\n")
            log.flush()

        def validate(rec: dict[str, Any], *, base: bool = False) -> None:
            """Score the validation blocks into ``rec`` and keep them in ``validation``."""
            rec.update(_validate(fm, val_blocks, base=base))
            validation.append({k: rec[k] for k in _VALIDATION_KEYS if k in rec})

        def save(*, final: bool = False) -> None:
            """A checkpoint of the current step; ``final`` (end of run, Ctrl-C): also the
            adapter in ``out`` and the plot. SIGINT waits until it is written."""
            nonlocal last_ckpt
            with guard.critical():
                last_ckpt = _save_checkpoint(fm, opt, sched, step, elapsed, cfg, out)
                if final:
                    fm.save_pretrained(out)
                    log.flush()
                    write_plot(log_path, out / "train.png")

        try:
            if val_blocks is not None and step == 0 and 0 not in logged_steps:
                t0 = time.monotonic()
                rec = {"step": 0}
                validate(rec, base=True)
                emit(rec, t0)
                pbar.set_postfix(val_ppl=f"{rec['val_ppl_topk']:.2f}")
            while step < cfg.steps:
                t0 = time.monotonic()
                opt.zero_grad(set_to_none=True)
                micro_losses: list[float] = []
                doms: list[dict[str, float]] = []
                for micro in range(cfg.grad_accum):
                    x = train_blocks[_sample_indices(step, micro, cfg, n_blocks)]
                    with fm.record_routing() as records:
                        output = fm(input_ids=x, labels=x, use_cache=False)
                    loss = output.loss
                    if not torch.isfinite(loss):
                        raise RuntimeError(
                            f"non-finite training loss {float(loss)} at step {step + 1}"
                        )
                    (loss / cfg.grad_accum).backward()
                    micro_losses.append(float(loss.detach()))
                    doms.append(_dominances(records))
                    del records, output, loss
                with guard.critical():
                    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
                    lr_now = float(opt.param_groups[0]["lr"])
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1
                rec = {
                    "step": step,
                    "loss": sum(micro_losses) / len(micro_losses),
                    "lr": lr_now,
                    "grad_norm": grad_norm,
                }
                for key in ("dominance", "dominance_max", "dominance_topk"):
                    vals = [d[key] for d in doms if key in d]
                    if vals:
                        rec[key] = max(vals) if key.endswith("max") else sum(vals) / len(vals)
                rec["tokens"] = step * tokens_per_step
                losses.append(rec["loss"])
                if val_blocks is not None and _eval_due(step, cfg):
                    validate(rec)
                emit(rec, t0)
                pbar.update(1)
                post = {"loss": f"{rec['loss']:.3f}", "dom": f"{rec.get('dominance', 0):.2f}",
                        "lr": f"{lr_now:.1e}"}  # fmt: skip
                if "val_ppl_topk" in rec:
                    post["val_ppl"] = f"{rec['val_ppl_topk']:.2f}"
                pbar.set_postfix(post)
                if callback is not None:
                    callback(step, rec)
                if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                    save()
            save(final=True)
        except KeyboardInterrupt:
            interrupted = True
            pbar.close()
            save(final=True)
            print(
                f"\nfocus train: interrupted after step {step}; adapter saved in {out}, "
                f"checkpoint {last_ckpt}; continue with --resume",
                file=sys.stderr,
            )
        finally:
            pbar.close()

    sha_after = weights_sha256(fm.base_model)
    result = TrainResult(
        out=out,
        steps=step,
        start_step=start_step,
        losses=losses,
        validation=validation,
        final_loss=losses[-1] if losses else None,
        seconds=time.monotonic() - t_call,
        train_seconds=elapsed,
        trainable_parameters=n_trainable,
        adapter=out,
        checkpoint=last_ckpt,
        log=log_path,
        plot=out / "train.png" if (out / "train.png").is_file() else None,
        extra={
            "interrupted": interrupted,
            "train_blocks": n_blocks,
            "prepend_bos": bos,
            "base_weights_sha256": {
                "before": sha_before,
                "after": sha_after,
                "equal": sha_before == sha_after,
            },
        },
    )
    doc = {**result.to_dict(), "config": cfg.to_dict(),
           "focus_config": fm.focus_config.to_dict(), "versions": library_versions(),
           "environment": environment()}  # fmt: skip
    write_json_atomic(out / "train_result.json", doc)
    if sha_after != sha_before:
        raise RuntimeError(
            f"the base model's weights changed during training (SHA-256 {sha_before} before, "
            f"{sha_after} after): only the Focus parameters may train"
        )
    if interrupted:
        raise KeyboardInterrupt
    return result


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def add_focus_arguments(p: argparse.ArgumentParser, defaults: Any) -> None:
    """Add the Focus config flags (``--num-groups`` ... ``--inference-routing``) with the
    defaults taken from ``defaults`` (a :class:`TrainConfig`)."""
    from .hf.config import GATES, INFERENCE_ROUTINGS

    g = p.add_argument_group("Focus")
    g.add_argument(
        "--num-groups", type=int, default=defaults.num_groups, help="K (default %(default)s)"
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=defaults.top_k,
        help="groups per token at inference (default %(default)s)",
    )
    g.add_argument(
        "--window",
        type=int,
        default=defaults.window,
        help="local window incl. the query (default %(default)s)",
    )
    g.add_argument(
        "--gate",
        choices=GATES,
        default=defaults.gate,
        help="soft training gate (default %(default)s)",
    )
    g.add_argument(
        "--gate-sharpness",
        type=float,
        default=defaults.gate_sharpness,
        help="lambda of the paper gate (default %(default)s)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        help="routing tau (default %(default)s)",
    )
    g.add_argument(
        "--sink-tokens",
        type=int,
        default=defaults.sink_tokens,
        help="first tokens visible to every query (default %(default)s)",
    )
    g.add_argument(
        "--group-dim", type=int, default=defaults.group_dim, help="d_g (default %(default)s)"
    )
    g.add_argument(
        "--sinkhorn-iters",
        type=int,
        default=defaults.sinkhorn_iters,
        help="Sinkhorn iterations (default %(default)s)",
    )
    g.add_argument("--inference-routing", choices=INFERENCE_ROUTINGS, default=defaults.inference_routing,
                   help="top-k group choice at inference (default %(default)s)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build a :class:`TrainConfig` from parsed ``focus train`` arguments."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    kwargs["progress"] = not args.no_progress
    return TrainConfig(**kwargs)


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    result = train(cfg)
    if result.extra.get("already_finished"):
        return 0  # train() said "nothing to do"
    last = result.validation[-1] if result.validation else {}
    print(f"trained {result.steps} steps ({result.train_seconds:.0f} s in the loop, "
          f"{result.seconds:.0f} s in all); final loss {result.final_loss}")  # fmt: skip
    if last:
        print(f"validation PPL at step {last['step']}: top-k {last['val_ppl_topk']:.3f}, "
              f"soft {last['val_ppl_soft']:.3f} ({last['val_tokens']} tokens)")  # fmt: skip
    print(f"adapter: {result.adapter}  log: {result.log}  plot: {result.plot}")
    return 0


def run_guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command: ``ValueError``, ``RuntimeError`` and ``FileNotFoundError`` become a
    one-line ``focus: error: ...`` on stderr and exit status 1."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            print(f"focus: error: {e}", file=sys.stderr)
            return 1

    return wrapper


def register_cli(subparsers: Any) -> None:
    """Add ``focus train`` (see :func:`train`)."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train the Focus centroids of a frozen model (centroid-only)",
        description="Centroid-only Focus training: base model frozen, only the routers "
        "(W_g, centroids) train, with soft Sinkhorn routing. Writes the adapter, log.jsonl, "
        "train.png and checkpoints into --out. Ctrl-C saves; --resume continues exactly.",
    )
    p.add_argument(
        "--model",
        default=d.model,
        help="registered model, model directory or hub id (default %(default)s)",
    )
    p.add_argument(
        "--corpus",
        default=d.corpus,
        help="registered corpus or local text file/folder (default %(default)s)",
    )
    p.add_argument("--out", default=None, help="output directory (default runs/<corpus>)")
    p.add_argument(
        "--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)"
    )
    p.add_argument(
        "--seq-len", type=int, default=d.seq_len, help="tokens per block (default %(default)s)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="blocks per micro-batch (default %(default)s)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=d.grad_accum,
        help="micro-batches per step (default %(default)s)",
    )
    p.add_argument(
        "--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=d.warmup_steps,
        help="linear warm-up, then cosine (default %(default)s)",
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=d.weight_decay,
        help="AdamW weight decay (default %(default)s)",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=d.max_grad_norm,
        help="gradient clip, 0 = off (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of everything (default %(default)s)"
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="validate every N steps (also at 0 and the end; 0 = only then, <0 = never; default %(default)s)")  # fmt: skip
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=d.eval_tokens,
        help="validation tokens (default %(default)s)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help="checkpoint every N steps, 0 = end only (default %(default)s)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        help="checkpoints kept (default %(default)s)",
    )
    p.add_argument(
        "--max-train-tokens",
        type=int,
        default=None,
        help="cap on training tokens (default: the whole split)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    p.add_argument("--prepend-bos", action=argparse_bool(), default=None,
                   help="start blocks with BOS (default: automatic, on for Gemma)")  # fmt: skip
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --out"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete an earlier run in --out and start again"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar or messages")
    add_focus_arguments(p, d)
    p.set_defaults(func=run_guarded(_cmd_train))


def argparse_bool() -> Any:
    """``argparse.BooleanOptionalAction`` (``--flag`` / ``--no-flag``)."""
    import argparse

    return argparse.BooleanOptionalAction
