#!/usr/bin/env bash
# The README's quality runs: centroid-only trainings of smollm2-135m on austen/train and their
# evaluation on the first 12,288 tokens of the held-out book (Persuasion) in 1024-token
# windows. The settings are one sweep grid, configs/sweeps/honest.toml (a [[cells]] table per
# training, an [[evals]] table per evaluation); this script only runs it with focus sweep,
# niced, and collects the table.
#
#   usage: bash benchmarks/honest.sh [RUNS_DIR] [JOBS] [summarize_honest.py flags]
#          JOBS cells at once, one torch thread each (default 2, for a 2-core machine; ~2.5 h
#          in all); a rerun skips finished cells and evaluations and resumes an interrupted
#          training. Writes RUNS_DIR/cells/<cell>/eval-<evaluation>.json (default RUNS_DIR:
#          runs/honest), RUNS_DIR/sweep.json, sweep.md and plots, then prints the table:
#   bash benchmarks/honest.sh runs/honest 2 --json benchmarks/results/honest.json \
#     --plot benchmarks/results/honest.png > benchmarks/results/honest.md
set -euo pipefail
cd "$(dirname "$0")/.."
H=${1:-runs/honest}
JOBS=${2:-2}
export PATH="$PWD/.venv/bin:$PATH"
nice -n 10 focus sweep --grid configs/sweeps/honest.toml --out "$H" --jobs "$JOBS" \
  --threads "$JOBS" --no-progress >&2
python benchmarks/summarize_honest.py "$H/cells" "${@:3}"
