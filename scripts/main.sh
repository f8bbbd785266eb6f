#!/usr/bin/env bash
# The main job (README): set up, prepare the real model and books offline, train the Focus
# centroids of smollm2-135m on Jane Austen, evaluate on the held-out book (Persuasion).
# Extra arguments go to `focus train`. Outputs: runs/austen/ (adapter, log, plot, eval JSON),
# then the long-context recipe (README, "Long context"): the adapter recalibrated for
# 4,096-token inputs with window 512, 256 sink tokens and the five retrieval layers dense
# (ranked by `focus bench retrieval-layers` on the validation book), in runs/austen-4k/,
# evaluated on two 4,096-token windows of the test book (runs/austen-4k/eval-4096.json, beside
# the adapter it scores, so that its model card and an export's report it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh "assets"
.venv/bin/focus setup --model smollm2-135m --corpus austen
.venv/bin/focus train --model smollm2-135m --corpus austen --out runs/austen "$@"
.venv/bin/focus eval --model smollm2-135m --adapter runs/austen --corpus austen --split test \
  --json runs/austen/eval.json
.venv/bin/focus calibrate --model smollm2-135m --adapter runs/austen --corpus austen \
  --out runs/austen-4k --overwrite --seq-len 4096 --blocks 4 --window 512 --sink-tokens 256 \
  --dense-layers 18 20 21 22 23
.venv/bin/focus eval --model smollm2-135m --adapter runs/austen-4k --corpus austen --split test \
  --seq-len 4096 --max-tokens 8192 --top-k 1 2 --no-soft --json runs/austen-4k/eval-4096.json
