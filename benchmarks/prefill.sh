#!/usr/bin/env bash
# End-to-end prefill with the main job's adapter (ADAPTER, default runs/austen): smollm2-135m
# on LENGTHS tokens (default 4096 16384) of the test book, stock sdpa, the no-attention floor
# and Focus top-1 / top-2, side by side in one run, two threads, on a quiet machine.
# Results: benchmarks/results/prefill/model.json and model.md.
set -euo pipefail
cd "$(dirname "$0")/.."
adapter="${ADAPTER:-runs/austen}"
out=benchmarks/results/prefill
mkdir -p "$out"
lengths="${LENGTHS:-4096 16384}"
# shellcheck disable=SC2086  # lengths is a list of words
.venv/bin/focus bench model --adapter "$adapter" --lengths $lengths --threads 2 --no-progress \
  --json "$out/model.json" | grep -v "^wrote " > "$out/model.md"
