"""How much soft (training-mode) routing leaks the future into earlier logits, on a real model.

usage: python experiments/soft-leak/soft_leak.py [--adapter runs/austen] [--json OUT.json]

Soft routing normalises the routing scores over the whole sequence (Sinkhorn, docs/method.md
§2), so a token's soft group weights, and through them earlier logits, depend on later
tokens. This script measures that on the default real model and the held-out book: for
``--rows`` blocks of ``--length`` tokens it scores the first ``--prefix`` tokens twice, once
inside the full block and once alone, and compares the two logits and the two perplexities
of those prefix tokens. Top-k routing (inference; causal, docs/method.md §4) is measured the
same way as the control and must show no leak beyond float noise.

Writes one JSON with the numbers, the settings, versions and hardware.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from focus_attention.assets.blocks import token_blocks
from focus_attention.assets.corpora import DEFAULT_CORPUS, load_corpus
from focus_attention.assets.models import DEFAULT_MODEL, auto_prepend_bos, load_model
from focus_attention.hf import FocusConfig, FocusModel, get_focus_model
from focus_attention.utils.env import environment, library_versions
from focus_attention.utils.io import atomic_write_text


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered model name or path")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="registered corpus name or path")
    p.add_argument("--split", default="test", help="corpus split to read (default: test)")
    p.add_argument("--adapter", help="Focus adapter folder (default: fresh routers, seed 0)")
    p.add_argument("--rows", type=int, default=4, help="blocks measured (default 4)")
    p.add_argument("--length", type=int, default=1024, help="tokens per block (default 1024)")
    p.add_argument("--prefix", type=int, default=512, help="earlier tokens compared (default 512)")
    p.add_argument(
        "--json", default="experiments/soft-leak/results/soft_leak.json", help="output file"
    )
    return p.parse_args()


def focus_model(args: argparse.Namespace) -> tuple[FocusModel, object]:
    model, tokenizer = load_model(args.model)
    if args.adapter:
        return FocusModel.from_pretrained(model, args.adapter), tokenizer
    return get_focus_model(model, FocusConfig()), tokenizer


def prefix_scores(fm: FocusModel, block: torch.Tensor, prefix: int) -> tuple[torch.Tensor, ...]:
    """Logits and next-token log-probabilities of the first ``prefix`` tokens, scored in the
    full block and alone: ``(full_logits, alone_logits, full_nll, alone_nll)``."""
    x = block[None]
    with torch.no_grad():
        full = fm(input_ids=x).logits[0, :prefix].float()
        alone = fm(input_ids=x[:, :prefix]).logits[0].float()
    target = block[1 : prefix + 1]
    nll = [
        torch.nn.functional.cross_entropy(lg[: prefix - 1], target[: prefix - 1], reduction="none")
        for lg in (full, alone)
    ]
    return full, alone, nll[0], nll[1]


def measure(fm: FocusModel, blocks: torch.Tensor, prefix: int, routing: str) -> dict:
    """Leak statistics of one routing mode over ``blocks`` ``[R, L]``."""
    fm.set_routing(routing)
    max_diff, mean_diff, nll_full, nll_alone, moved = 0.0, 0.0, 0.0, 0.0, 0
    for block in tqdm(blocks, desc=f"{routing} routing", unit="block"):
        full, alone, a, b = prefix_scores(fm, block, prefix)
        diff = (full - alone).abs()
        max_diff = max(max_diff, float(diff.max()))
        mean_diff += float(diff.mean()) / len(blocks)
        nll_full, nll_alone = nll_full + float(a.sum()), nll_alone + float(b.sum())
        moved += int((full.argmax(-1) != alone.argmax(-1)).sum())
    tokens = len(blocks) * (prefix - 1)
    ppl_full, ppl_alone = math.exp(nll_full / tokens), math.exp(nll_alone / tokens)
    return {
        "routing": routing,
        "max_abs_logit_difference": max_diff,
        "mean_abs_logit_difference": mean_diff,
        "perplexity_in_full_block": ppl_full,
        "perplexity_alone": ppl_alone,
        "perplexity_gain_from_the_future_percent": 100 * (ppl_alone - ppl_full) / ppl_alone,
        "argmax_changed_fraction": moved / (len(blocks) * prefix),
        "scored_tokens": tokens,
    }


def main() -> None:
    args = parse_args()
    if not 1 < args.prefix < args.length:
        raise SystemExit(f"--prefix must be in 2..{args.length - 1}, got {args.prefix}")
    torch.manual_seed(0)
    fm, tokenizer = focus_model(args)
    corpus = load_corpus(args.corpus)
    blocks = token_blocks(
        tokenizer,
        corpus.split(args.split),
        args.length,
        max_tokens=args.rows * args.length,
        prepend_bos=auto_prepend_bos(fm.base_model),
    )[: args.rows]
    results = [measure(fm, blocks, args.prefix, mode) for mode in ("soft", "topk")]
    out = {
        "what": "earlier logits moved by later tokens (soft vs top-k routing)",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "focus_config": fm.focus_config.to_dict(),
        "results": results,
        "versions": library_versions(),
        "environment": environment(),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    for r in results:
        print(
            f"{r['routing']:>5}: max |dlogit| {r['max_abs_logit_difference']:.4f}, mean "
            f"{r['mean_abs_logit_difference']:.5f}, perplexity of the first {args.prefix} tokens "
            f"{r['perplexity_in_full_block']:.3f} in the block vs {r['perplexity_alone']:.3f} "
            f"alone, argmax changed {100 * r['argmax_changed_fraction']:.2f}%"
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
