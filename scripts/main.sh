#!/usr/bin/env bash
# The main job (README): set up, prepare the real model and books offline, train the Focus
# centroids of smollm2-135m on Jane Austen, evaluate on the held-out book (Persuasion).
# Extra arguments go to `focus train`. Outputs: runs/austen/ (adapter, log, plot, eval JSON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh "assets"
.venv/bin/focus setup --model smollm2-135m --corpus austen
.venv/bin/focus train --model smollm2-135m --corpus austen --out runs/austen "$@"
.venv/bin/focus eval --model smollm2-135m --adapter runs/austen --corpus austen --split test \
  --json runs/austen/eval.json
