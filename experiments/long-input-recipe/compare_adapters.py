"""Compare several Focus adapters at one context length on one split (for recipe choices:
use the validation split, never the test book).

Loads the base model once, scores the dense base, then every adapter's top-k routing for each
``--top-k``, optionally after re-collecting the causal routing bias from ``--calibrate-blocks``
blocks of the *training* split at the evaluation length (so the scored text never feeds the
bias). Perplexity is token-weighted over independent ``--seq-len`` windows, as ``focus eval``.

    .venv/bin/python experiments/long-input-recipe/compare_adapters.py runs/a runs/b --seq-len 4096 \\
        --max-tokens 16384 --split validation --json experiments/long-input-recipe/results/compare.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from focus_attention.assets.blocks import token_blocks
from focus_attention.assets.corpora import load_corpus
from focus_attention.assets.models import auto_prepend_bos, load_model
from focus_attention.evaluation.coverage import evenly_spaced_rows, topk_coverage
from focus_attention.evaluation.perplexity import score_windows
from focus_attention.hf import FocusModel
from focus_attention.utils.env import environment, library_versions
from focus_attention.utils.io import write_json_atomic


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("adapters", nargs="+", help="adapter directories")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="austen")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--top-k", default="1,2", help="comma-separated top_k values")
    p.add_argument("--calibrate-blocks", type=int, default=0,
                   help="training-split blocks that re-collect the routing bias (0: as trained)")  # fmt: skip
    p.add_argument("--coverage-queries", type=int, default=0,
                   help="also measure the distant dense attention kept by top-k on this many "
                   "queries per window (0: skip)")  # fmt: skip
    p.add_argument("--window", type=int, default=None, help="override the adapters' window")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def _ppl(model, blocks) -> float:
    nll, n = score_windows(model, blocks)
    return math.exp(nll / n)


def main() -> int:
    a = _args()
    if a.threads:
        torch.set_num_threads(a.threads)
    corpus = load_corpus(a.corpus, quiet=True)
    base, tok = load_model(a.model, quiet=True)
    base.eval()
    bos = auto_prepend_bos(base)
    blocks = token_blocks(tok, corpus.texts(a.split), a.seq_len, max_tokens=a.max_tokens,
                          prepend_bos=bos)  # fmt: skip
    calib = None
    if a.calibrate_blocks:
        calib = token_blocks(tok, corpus.texts("train"), a.seq_len,
                             max_tokens=a.calibrate_blocks * a.seq_len, prepend_bos=bos)  # fmt: skip
    t = time.monotonic()
    result = {"base": _ppl(base, blocks), "adapters": {}}
    print(f"base {result['base']:.3f} ({time.monotonic() - t:.0f} s)", file=sys.stderr)
    ks = [int(k) for k in a.top_k.split(",")]
    for path in a.adapters:
        fm = FocusModel.from_pretrained(base, path)
        if a.window:
            fm.focus_config = fm.focus_config.replace(window=a.window)
        for i, block in enumerate(calib if calib is not None else []):
            fm.calibrate(block[None], reset=i == 0)
        fm.eval()
        row = {}
        for k in ks:
            fm.set_top_k(k)
            row[str(k)] = _ppl(fm, blocks)
            rel = 100 * (row[str(k)] / result["base"] - 1)
            print(f"{path} top-{k} {row[str(k)]:.3f} ({rel:+.2f}%)", file=sys.stderr)
        if a.coverage_queries:
            rows = evenly_spaced_rows(a.seq_len, fm.focus_config.window, a.coverage_queries)
            cov = topk_coverage(fm, blocks, ks, rows=rows)
            row["coverage"] = cov["topk"]
            print(f"{path} coverage {cov['topk']}", file=sys.stderr)
        result["adapters"][str(path)] = row
        fm.unload()
    result.update(config=vars(a) | {"json": str(a.json), "tokens": int(blocks.numel())},
                  versions=library_versions(), environment=environment())  # fmt: skip
    if a.json:
        write_json_atomic(a.json, result)
    print(json.dumps({k: result[k] for k in ("base", "adapters")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
