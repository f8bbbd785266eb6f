#!/usr/bin/env bash
# Honest results of the main job (issue 4, section 5): longer centroid-only trainings of
# smollm2-135m on austen/train and their evaluation on the first 12,288 tokens of the held-out
# book (Persuasion) in 1024-token windows -- the token range of the issue's orientation numbers.
#
#   usage: bash benchmarks/honest.sh 1|2 [RUNS_DIR]   (two lanes, one torch thread each, niced;
#          run both in parallel on a 2-core machine, ~2 h; they resume where they stopped)
#   then:  .venv/bin/python benchmarks/summarize_honest.py RUNS_DIR > benchmarks/results/honest.md
#
# Lane 1: gate=log  (default) sink_tokens=4: 300 steps; eval causal, sequence, and sink_tokens=0.
# Lane 2: gate=paper          sink_tokens=4: 300 steps; eval causal, sequence; untrained random
#         centroids (0 steps; sequence routing, with and without sink tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
LANE=${1:?usage: honest.sh 1|2 [RUNS_DIR]}
H=${2:-runs/honest}
mkdir -p "$H"
export PATH="$PWD/.venv/bin:$PATH"
COMMON=(--steps 300 --lr 3e-2 --warmup-steps 20 --eval-every 100 --eval-tokens 2048
  --save-every 50 --threads 1 --no-progress)
EV=(--split test --max-tokens 12288 --seq-len 1024 --top-k-values 1,2,4 --threads 1 --no-progress)
log() { echo "$(date -Is) $*" >>"$H/lane$LANE.log"; }
run() { log "start: $*"; if nice -n 10 "$@" >>"$H/lane$LANE.log" 2>&1; then log "ok: $1 $2"; else log "FAILED $?: $*"; fi; }
train() { # out, flags...
  local out=$1; shift
  if [ -f "$out/train_result.json" ] && python3 -c "import json,sys; sys.exit(json.load(open('$out/train_result.json'))['steps'] != 300)"; then return; fi
  if [ -d "$out/checkpoints" ]; then run focus train --out "$out" "${COMMON[@]}" "$@" --resume
  else run focus train --out "$out" "${COMMON[@]}" "$@"; fi
}
evaluate() { # adapter, name, flags...
  local a=$1 name=$2; shift 2
  [ -f "$a/eval-$name.json" ] || run focus eval --adapter "$a" "${EV[@]}" "$@" --json "$a/eval-$name.json" --markdown "$a/eval-$name.md"
}
if [ "$LANE" = 1 ]; then
  train "$H/log-s4" --gate log --sink-tokens 4
  evaluate "$H/log-s4" causal
  evaluate "$H/log-s4" sequence --inference-routing sequence
  evaluate "$H/log-s4" causal-sinks0 --sink-tokens 0
else
  train "$H/paper-s4" --gate paper --sink-tokens 4
  evaluate "$H/paper-s4" causal
  evaluate "$H/paper-s4" sequence --inference-routing sequence
  [ -f "$H/random/focus_config.json" ] || run focus train --out "$H/random" --steps 0 --eval-every -1 --threads 1 --no-progress
  evaluate "$H/random" sequence --inference-routing sequence
  evaluate "$H/random" sequence-sinks0 --inference-routing sequence --sink-tokens 0
fi
log "lane $LANE done"
