"""``focus export``: a Focus adapter and its base model as one model directory that
transformers loads with ``trust_remote_code=True``
(:func:`focus_attention.deploy.export.export_adapter`, docs/deploy.md)."""

from __future__ import annotations

import argparse
from typing import Any

from ..deploy.settings import ExportConfig
from .common import run_guarded, summary
from .flags import add_config_flag, add_flags, command_config


def _run(args: argparse.Namespace) -> int:
    from ..deploy.export import export_adapter

    config = command_config(args, ExportConfig, "export", required=("adapter", "out"))
    out = export_adapter(config)
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          "trust_remote_code=True) or pipeline('text-generation', ..., trust_remote_code=True); "
          "lm-eval: --model hf --model_args pretrained=...,trust_remote_code=True")  # fmt: skip
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus export``: flags from :class:`ExportConfig`."""
    p = subparsers.add_parser(
        "export",
        help=summary("export"),
        description="Write --model with the Focus adapter --adapter (a folder or a hub repo "
        "id) as one Hugging Face model directory in --out: the base weights, the routers, the "
        "settings, the tokenizer, a model card and the custom code that transformers runs "
        "with trust_remote_code=True, so that AutoModelForCausalLM.from_pretrained, pipeline "
        "and lm-eval's hf model load it with Focus active (the focus-attention package must be "
        "installed where it loads). Inference settings given here are written into it; they "
        "can still change at load time. The directory is built beside --out and renamed into "
        "place.",
    )
    add_config_flag(p, "export")
    add_flags(p, ExportConfig)
    p.set_defaults(func=run_guarded(_run))
