#!/usr/bin/env bash
# Decoding-step latency with a KV cache (focus bench decode): dense against Focus top-1 and
# top-2 with the main job's adapter (ADAPTER, default runs/austen), at the op level and end
# to end on smollm2-135m (dense through transformers' DynamicCache and through a buffered
# cache) for 1K, 4K, 16K and 32K cached tokens (CONTEXTS), two threads, on a quiet machine.
# Results: benchmarks/results/decode/{op,model}.json and .md.
set -euo pipefail
cd "$(dirname "$0")/.."
adapter="${ADAPTER:-runs/austen}"
out=benchmarks/results/decode
mkdir -p "$out"
contexts="${CONTEXTS:-1024 4096 16384 32768}"
# shellcheck disable=SC2086  # contexts is a list of words
.venv/bin/focus bench decode --adapter "$adapter" --contexts $contexts --levels op \
  --steps 32 --warmup 3 --threads 2 --no-progress --json "$out/op.json" | grep -v "^wrote " > "$out/op.md"
# shellcheck disable=SC2086
.venv/bin/focus bench decode --adapter "$adapter" --contexts $contexts --levels model \
  --steps 16 --warmup 2 --threads 2 --no-progress --json "$out/model.json" | grep -v "^wrote " > "$out/model.md"
