"""Does calibrating the causal routing bias at the evaluation length help top-k routing?

usage: python benchmarks/calibrate_length.py [--adapter runs/austen] [--seq-len 4096]
           [--json benchmarks/results/calibrate_length.json]

The causal top-k routing adds a per-group bias, the running mean of the Sinkhorn column
normalisers seen in soft training (docs/method.md §4), which the main job collects on
512-token blocks. This script compares, on held-out windows of ``--seq-len`` tokens of the
test split, the perplexity of the dense model and of top-k routing with (a) the bias as
trained and (b) the bias collected afresh from ``--calib-blocks`` blocks of ``--seq-len``
tokens of the validation split (never the test book). Writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from focus_attention.assets.corpora import DEFAULT_CORPUS, load_corpus, token_blocks
from focus_attention.assets.models import DEFAULT_MODEL, auto_prepend_bos, load_model
from focus_attention.evaluation import score_windows
from focus_attention.hf import FocusModel
from focus_attention.utils.env import environment, library_versions
from focus_attention.utils.io import atomic_write_text


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered model name or path")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="registered corpus name or path")
    p.add_argument("--adapter", default="runs/austen", help="Focus adapter folder")
    p.add_argument("--seq-len", type=int, default=4096, help="window length in tokens")
    p.add_argument("--windows", type=int, default=4, help="test windows scored (default 4)")
    p.add_argument("--calib-blocks", type=int, default=4, help="validation blocks (default 4)")
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2], help="top_k values")
    p.add_argument("--json", default="benchmarks/results/calibrate_length.json")
    return p.parse_args()


def blocks(tokenizer, corpus, split: str, seq_len: int, n: int, bos: bool) -> torch.Tensor:
    out = token_blocks(tokenizer, corpus.split(split), seq_len, max_tokens=n * seq_len,
                       prepend_bos=bos)  # fmt: skip
    if out.shape[0] < n:
        raise SystemExit(f"{split}: only {out.shape[0]} blocks of {seq_len} tokens, {n} asked")
    return out[:n]


def perplexity(model, windows: torch.Tensor) -> float:
    nll, n = score_windows(model, windows)
    return math.exp(nll / n)


def topk_perplexities(fm: FocusModel, windows: torch.Tensor, ks: list[int]) -> dict[str, float]:
    out = {}
    for k in ks:
        fm.set_top_k(k)
        out[str(k)] = perplexity(fm, windows)
        print(f"  top-{k}: {out[str(k)]:.3f}", flush=True)
    return out


def recalibrate(fm: FocusModel, calib: torch.Tensor) -> None:
    """Forget the trained bias and collect it again from ``calib`` (one block per call)."""
    for i, block in enumerate(calib):
        fm.calibrate(block[None], reset=i == 0)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    base, tokenizer = load_model(args.model)
    fm = FocusModel.from_pretrained(base, args.adapter).eval()
    bos = auto_prepend_bos(base)
    corpus = load_corpus(args.corpus)
    test = blocks(tokenizer, corpus, "test", args.seq_len, args.windows, bos)
    calib = blocks(tokenizer, corpus, "validation", args.seq_len, args.calib_blocks, bos)
    with fm.disable_focus():
        dense = perplexity(fm, test)
    print(f"dense: {dense:.3f}", flush=True)
    print("bias as trained:", flush=True)
    trained = topk_perplexities(fm, test, args.top_k)
    trained_bias = {i: r.routing_bias.tolist() for i, r in fm.routers.items()}
    recalibrate(fm, calib)
    print(f"bias calibrated on {args.calib_blocks} validation blocks of {args.seq_len}:")
    calibrated = topk_perplexities(fm, test, args.top_k)
    out = {
        "what": "top-k perplexity with the causal routing bias as trained vs recalibrated "
        "at the evaluation length",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "scored_tokens": int(test.shape[0] * (test.shape[1] - 1)),
        "dense": dense,
        "topk_bias_as_trained": trained,
        "topk_bias_recalibrated": calibrated,
        "routing_bias": {
            "as_trained": trained_bias,
            "recalibrated": {i: r.routing_bias.tolist() for i, r in fm.routers.items()},
        },
        "focus_config": fm.focus_config.to_dict(),
        "versions": library_versions(),
        "environment": environment(),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
