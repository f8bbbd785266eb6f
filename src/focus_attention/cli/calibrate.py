"""``focus calibrate``: an adapter set up for long inputs
(:func:`focus_attention.evaluation.calibration.calibrate_adapter`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..evaluation.settings import CalibrateConfig
from ..utils.io import check_output_folder
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config

#: the settings the command needs from a flag or --config
REQUIRED = ("adapter", "out")


def _run(args: argparse.Namespace) -> int:
    from ..evaluation.calibration import CALIBRATION_NAME, calibrate_adapter

    config = command_config(args, CalibrateConfig, "calibrate", required=REQUIRED)
    check_output_folder(config.out, "--out")
    if config.split == "test":
        print("focus: warning: --split test: the test split is meant for evaluation; calibrate "
              "on the validation split (the default) to keep it held out", file=sys.stderr)  # fmt: skip
    record = calibrate_adapter(config)
    focus = record["focus"]
    print(f"wrote {config.out}: window {focus['window']}, sink_tokens {focus['sink_tokens']}, "
          f"dense_layers {focus['dense_layers']}, top_k {focus['top_k']}; bias from "
          f"{record['tokens']:,} tokens (largest change {record['bias_change']:.4f}); "
          f"{record['seconds']:.0f} s; record: {config.out}/{CALIBRATION_NAME}")  # fmt: skip
    budget = record["head_budget"]
    if budget is not None:
        heads = ",".join(f"{layer}:{head}" for layer, head in budget["dense_heads"])
        print(f"head budget {budget['share']}: {budget['dense_kv_heads']} of {budget['kv_heads']} "
              f"key-value heads dense; dense_heads {heads or 'none'}")  # fmt: skip
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus calibrate``: flags from :class:`CalibrateConfig`."""
    p = subparsers.add_parser(
        "calibrate",
        help=summary("calibrate"),
        description="Copy a Focus adapter into --out with its causal routing bias collected "
        "afresh from --blocks blocks of --seq-len tokens of held-out text (soft routing, no "
        "gradients; the trained projections and centroids are unchanged) and with the "
        "inference settings given here written into its config, so that focus eval, focus "
        "bench and FocusModel.from_pretrained use them without overrides. Writes "
        "calibration.json beside it.",
    )
    add_config_flag(p, "calibrate")
    add_flags(p, CalibrateConfig, required=REQUIRED)
    p.set_defaults(func=run_guarded(_run))
