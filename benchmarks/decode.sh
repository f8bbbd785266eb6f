#!/usr/bin/env bash
# Decoding-step latency with a KV cache (focus bench decode): dense against Focus top-1 and
# top-2 with the main job's adapter (ADAPTER, default runs/austen), at the op level for 4K,
# 16K and 32K cached tokens and end to end on smollm2-135m for 4K and 16K (CONTEXTS), two
# threads, on a quiet machine. Results: benchmarks/results/decode/{op,model}.json.
set -euo pipefail
cd "$(dirname "$0")/.."
adapter="${ADAPTER:-runs/austen}"
out=benchmarks/results/decode
mkdir -p "$out"
.venv/bin/focus bench decode --adapter "$adapter" --contexts 4096 16384 32768 --levels op \
  --steps 32 --warmup 3 --threads 2 --no-progress --json "$out/op.json"
# shellcheck disable=SC2086  # CONTEXTS is a list of words
.venv/bin/focus bench decode --adapter "$adapter" --contexts ${CONTEXTS:-4096 16384} \
  --levels model --steps 16 --warmup 2 --threads 2 --no-progress --json "$out/model.json"
