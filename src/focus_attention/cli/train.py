"""``focus train``: training by method, centroid-only by default
(:func:`focus_attention.training.train`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..hf.config import FocusConfig
from ..training.config import TrainConfig
from .common import run_guarded
from .flags import add_config_flag, add_flags, flag_values, read_config_table

#: FocusConfig fields that are not ``focus train`` flags: training routes softly, every
#: full-attention layer gets Focus, and ``--seed`` seeds the routers too
FOCUS_FIELDS_NOT_FLAGS = ("routing", "layers", "seed")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``focus train`` arguments: the defaults, then the
    ``[train]`` table of ``--config`` (Focus settings in ``[train.focus]``), then the flags.

    Raises:
        ValueError: unknown or invalid settings (the message names the file).
    """
    settings = read_config_table(args.config, "train")
    focus = dict(settings.pop("focus", {}))
    focus.update(flag_values(args, FocusConfig, exclude=FOCUS_FIELDS_NOT_FLAGS))
    settings.update(flag_values(args, TrainConfig))
    try:
        return TrainConfig.from_dict({**settings, "focus": focus})
    except ValueError as err:
        raise ValueError(f"{args.config}: {err}" if args.config else str(err)) from err


def _run(args: argparse.Namespace) -> int:
    from ..training import train
    from ..training.distributed import end_process_group

    result = train(config_from_args(args))
    end_process_group()
    if result.extra.get("already_finished"):
        return 0  # train() said "nothing to do"
    if os.environ.get("RANK", "0") != "0":
        return 0  # a distributed run's summary is printed by rank 0
    last = result.validation[-1] if result.validation else {}
    loss = "" if result.final_loss is None else f"; final loss {result.final_loss:.4f}"
    print(f"trained {result.steps} steps ({result.train_seconds:.0f} s of optimizer steps "
          f"over every run, {result.seconds:.0f} s in this call){loss}")  # fmt: skip
    if "val_ppl_topk" in last:
        soft = f", soft {last['val_ppl_soft']:.3f}" if "val_ppl_soft" in last else ""
        print(f"validation PPL at step {last['step']}: top-k {last['val_ppl_topk']:.3f}"
              f"{soft} ({last['val_tokens']} tokens)")  # fmt: skip
    elif last:
        print(f"validation PPL at step {last['step']}: {last['val_ppl']:.3f} (dense, "
              f"{last['val_tokens']} tokens)")  # fmt: skip
    info = result.extra["method"]
    lora = info.get("lora")
    print(f"method {info['method']}: {result.trainable_parameters:,d} trainable parameters"
          + (f" (LoRA rank {lora['rank']} on {','.join(lora['targets'])})" if lora else ""))  # fmt: skip
    weights = result.extra["base_weights_sha256"]
    if not weights["equal"]:
        print(f"base weights changed: {weights['changed_count']} tensors")
    files = [f"adapter: {result.adapter}"]
    files += [f"{name}: {path}" for name, path in (("log", result.log), ("plot", result.plot))
              if path is not None and path.is_file()]  # fmt: skip
    print("  ".join(files))
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus train``: flags from :class:`TrainConfig` and :class:`FocusConfig`."""
    p = subparsers.add_parser(
        "train",
        help="train the Focus centroids of a frozen model, or LoRA / fine-tuning baselines",
        description="Centroid-only Focus training by default: base model frozen, only the "
        "routers (W_g, centroids) train, with soft Sinkhorn routing. --method picks other "
        "recipes (LoRA, attention or full fine-tuning, LoRA with Focus, two-phase) in the "
        "same loop. Writes the adapter (and lora/ or model/), log.jsonl, train.png and "
        "checkpoints into --out. Ctrl-C saves; --resume continues exactly.",
    )
    add_config_flag(p, "train")
    add_flags(p, TrainConfig)
    add_flags(p.add_argument_group("Focus"), FocusConfig, exclude=FOCUS_FIELDS_NOT_FLAGS)
    p.set_defaults(func=run_guarded(_run))
