"""``focus pretrain``: train a small LLaMA-style model from scratch, with Focus or dense
attention (:func:`focus_attention.training.pretrain.pretrain`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..hf.config import FocusConfig
from ..training.settings import PRETRAIN_NUM_GROUPS, PretrainConfig
from .common import run_guarded
from .flags import add_config_flag, add_flags, flag_values, note_flags, read_config_table

#: FocusConfig fields that are not flags: training routes softly (so hidden-state routers,
#: which have soft routing), every layer gets Focus, and ``--seed`` seeds the routers too
FOCUS_FIELDS_NOT_FLAGS = ("routing", "router_input", "layers", "seed")


def config_from_args(args: argparse.Namespace) -> PretrainConfig:
    """The :class:`PretrainConfig` of parsed ``focus pretrain`` arguments: the defaults, the
    ``[pretrain]`` table of ``--config`` (Focus settings in ``[pretrain.focus]``), the flags.

    Raises:
        ValueError: unknown or invalid settings (the message names the file).
    """
    settings = read_config_table(args.config, "pretrain")
    focus = dict(settings.pop("focus", {}))
    focus.update(flag_values(args, FocusConfig, exclude=FOCUS_FIELDS_NOT_FLAGS))
    if hasattr(args, "num_groups"):
        focus["num_groups"] = args.num_groups
    settings.update(flag_values(args, PretrainConfig))
    try:
        return PretrainConfig.from_dict({**settings, "focus": focus})
    except ValueError as err:
        raise ValueError(f"{args.config}: {err}" if args.config else str(err)) from err


def _run(args: argparse.Namespace) -> int:
    from ..training.distributed import end_process_group
    from ..training.pretrain import pretrain

    config = config_from_args(args)
    result = pretrain(config)
    end_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports
    last = result["validation"][-1]
    extra = ", ".join(f"{k} {v:.2f}" for k, v in last.items() if k.startswith("ppl_top"))
    speed = result["throughput"]["tokens_per_second"]
    print(f"{config.attention}: {result['steps']} steps, {result['data']['tokens_trained']} tokens, "
          f"{speed:.0f} tokens/s; validation PPL at step {last['step']}: {last['ppl']:.2f}"
          + (f" (soft; {extra})" if extra else ""))  # fmt: skip
    print(f"output: {config.out_dir()}")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus pretrain``: flags from :class:`PretrainConfig` and :class:`FocusConfig`."""
    p = subparsers.add_parser(
        "pretrain",
        help="train a small LLaMA-style model from scratch with Focus or dense attention",
        description="From-scratch training with transformers.Trainer (runs under torchrun / "
        "accelerate launch): a LLaMA-style model of --size, a BPE tokenizer trained on the "
        "corpus, validation perplexity at every checkpoint. --attention focus trains the "
        "routers with every weight (soft Sinkhorn routing); --attention dense is the same "
        "model, initialisation and data without Focus.",
    )
    add_config_flag(p, "pretrain")
    add_flags(p, PretrainConfig)
    group = p.add_argument_group("Focus (--attention focus)")
    # num_groups by hand: its from-scratch default differs from FocusConfig's
    add_flags(group, FocusConfig, exclude=(*FOCUS_FIELDS_NOT_FLAGS, "num_groups"))
    group.add_argument("--num-groups", dest="num_groups", type=int, default=argparse.SUPPRESS,
                       help=f"K, learned groups per layer (default {PRETRAIN_NUM_GROUPS})")  # fmt: skip
    # the size flags are checked as the fields of the model's ModelSize
    note_flags(p, ["num_groups"], owners=("ModelSize",))
    p.set_defaults(func=run_guarded(_run))
