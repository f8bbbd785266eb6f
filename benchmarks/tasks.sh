#!/usr/bin/env bash
# Zero-shot benchmarks through lm-evaluation-harness (focus bench tasks): the dense model against
# the main job's Focus adapter at top_k 2 and 1, with its own window (128) and a stressed
# window of 32 tokens, on the first LIMIT examples of each task; then the README table.
# Usage: bash benchmarks/tasks.sh   (ADAPTER=runs/austen LIMIT=100 by default; one thread)
set -euo pipefail
cd "$(dirname "$0")/.."
adapter="${ADAPTER:-runs/austen}"
limit="${LIMIT:-100}"
out=benchmarks/results/tasks
mkdir -p "$out"
run() {
  local name=$1
  shift
  .venv/bin/focus bench tasks --limit "$limit" --threads 1 --batch-size 16 --json "$out/$name.json" "$@"
}
run dense
run top2-w32 --adapter "$adapter" --top-k 2 --window 32
run top1-w32 --adapter "$adapter" --top-k 1 --window 32
run top2-w128 --adapter "$adapter" --top-k 2
run top1-w128 --adapter "$adapter" --top-k 1
.venv/bin/python benchmarks/summarize_tasks.py
