"""``focus eval``: perplexity of a base model and its Focus adapter
(:func:`focus_attention.evaluation.evaluate`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..evaluation.settings import EvalConfig
from ..utils.io import check_output_file
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config


def _run(args: argparse.Namespace) -> int:
    from ..evaluation import evaluate, markdown_table
    from ..hf.card import CARD_NAME, refresh_card

    config = command_config(args, EvalConfig, "eval")
    for name in ("json", "markdown"):
        if getattr(config, name) is not None:
            check_output_file(getattr(config, name), f"--{name}")
    result = evaluate(config)
    print(markdown_table(result))
    weights = result.base_weights_sha256
    if weights.get("trained"):
        print(f"\ntrained base weights: {weights['changed_count']} of {weights['tensors']} base "
              f"tensors changed, {weights['lora_tensors']} LoRA tensors; SHA-256 "
              f"{weights['before']} (base) -> {weights['after']} (tuned)")  # fmt: skip
    else:
        print(f"\nbase weights SHA-256 unchanged: {weights['after']}")
    print(f"{result.seconds['total']:.0f} s" + (f"; JSON: {config.json}" if config.json else ""))
    if _beside_the_adapter(config) and refresh_card(config.adapter):
        print(f"model card {Path(config.adapter) / CARD_NAME} now reports it")
    return 0


def _beside_the_adapter(config: EvalConfig) -> bool:
    """Whether the result JSON was written into the folder of the adapter it evaluates (a
    record of that adapter, which its model card reports)."""
    if not config.json or not config.adapter or not Path(config.adapter).is_dir():
        return False
    return Path(config.json).resolve().parent == Path(config.adapter).resolve()


def register_cli(subparsers: Any) -> None:
    """Add ``focus eval``: flags from :class:`EvalConfig`."""
    p = subparsers.add_parser(
        "eval",
        help=summary("eval"),
        description="Token-weighted perplexity over non-overlapping --seq-len windows (each "
        "window scored independently; all tokens but the first of each window count) of the "
        "base model, Focus soft routing and Focus top-k routing for every top_k in 1..K, with "
        "pairs retained, dominance and group shares; checks that the base weights' SHA-256 "
        "is unchanged. For a run that trained LoRA or base weights (focus train --method), "
        "also the tuned model (dense), and the change of the base weights is reported.",
    )
    add_config_flag(p, "eval")
    add_flags(p, EvalConfig)
    p.set_defaults(func=run_guarded(_run))
