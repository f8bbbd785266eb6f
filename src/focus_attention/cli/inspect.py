"""``focus inspect``: what the learned groups of a Focus adapter hold
(:func:`focus_attention.evaluation.groups.inspect_groups`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..evaluation.settings import InspectConfig
from ..utils.io import check_output_folder
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config

#: the settings the command needs from a flag or --config
REQUIRED = ("adapter", "out")


def _run(args: argparse.Namespace) -> int:
    from ..evaluation.groups import inspect_groups

    config = command_config(args, InspectConfig, "inspect", required=REQUIRED)
    check_output_folder(config.out, "--out")
    result = inspect_groups(config)
    s = result["summary"]
    dense = result["dense_layers"]
    print(f"{result['tokens']:,d} tokens, {len(result['layers'])} Focus layers"
          + (f" ({len(dense)} more run dense attention: {dense})" if dense else ""))  # fmt: skip
    for name in result["routings"]:
        print(f"mean NMI(group; category) {name}: {s[f'nmi_{name}']:.4f}")
    if s["nmi_shuffled"] is not None:
        print(f"mean NMI shuffled (chance): {s['nmi_shuffled']:.4f}")
    print(f"best layer {s['best_layer']['layer']}: NMI {s['best_layer']['nmi']:.4f}")
    print(f"{result['seconds']:.0f} s; results in {config.out}")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus inspect``: flags from :class:`InspectConfig`."""
    p = subparsers.add_parser(
        "inspect",
        help=summary("inspect"),
        description="Route held-out text with a Focus adapter's top-k routing and report, per "
        "layer and group, the share of tokens, the most frequent and most typical tokens with "
        "context snippets, the composition by word category (a lexical categorisation), and "
        "the normalised mutual information between group and category against the untrained "
        "initialisation and shuffled groups. Writes inspect.json, inspect.md, shares.png and "
        "composition.png into --out.",
    )
    add_config_flag(p, "inspect")
    add_flags(p, InspectConfig, required=REQUIRED)
    p.set_defaults(func=run_guarded(_run))
