#!/usr/bin/env bash
# Zero-shot benchmarks through lm-evaluation-harness (focus bench tasks): the dense model against
# the main job's Focus adapter at top_k 2 and 1, with its own window (128) on the six tasks and
# a stressed window of 32 tokens on the three with the longest contexts, on the first LIMIT
# examples of each task, and LAMBADA alone on 500 examples; then the tables
# (benchmarks/results/tasks/README.md).
# Usage: bash benchmarks/tasks.sh   (ADAPTER=runs/austen LIMIT=50 by default; one thread)
set -euo pipefail
cd "$(dirname "$0")/.."
adapter="${ADAPTER:-runs/austen}"
limit="${LIMIT:-50}"
long=(hellaswag arc_challenge lambada_openai)
out=benchmarks/results/tasks
mkdir -p "$out"
run() {
  local name=$1
  shift
  .venv/bin/focus bench tasks --limit "$limit" --threads 1 --batch-size 16 --json "$out/$name.json" "$@"
}
run dense
run top2-w32 --adapter "$adapter" --top-k 2 --window 32 --tasks "${long[@]}"
run top1-w32 --adapter "$adapter" --top-k 1 --window 32 --tasks "${long[@]}"
run top2-w128 --adapter "$adapter" --top-k 2
run top1-w128 --adapter "$adapter" --top-k 1
# LAMBADA, where every scored token is routed at window 32, on more examples (LAMBADA_LIMIT)
lam=(--tasks lambada_openai --limit "${LAMBADA_LIMIT:-500}")
run lambada500-dense "${lam[@]}"
run lambada500-top2-w32 --adapter "$adapter" --top-k 2 --window 32 "${lam[@]}"
run lambada500-top1-w32 --adapter "$adapter" --top-k 1 --window 32 "${lam[@]}"
.venv/bin/python benchmarks/summarize_tasks.py
