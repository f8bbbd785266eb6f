#!/usr/bin/env bash
# Honest results of the main job (issue 4, section 5): longer centroid-only trainings of
# smollm2-135m on austen/train and their evaluation on the first 12,288 tokens of the held-out
# book (Persuasion) in 1024-token windows -- the token range of the issue's orientation numbers.
#
#   usage: bash benchmarks/honest.sh 1|2|3|4 [RUNS_DIR]   (lanes of one torch thread each, niced;
#          run two at a time on a 2-core machine, ~2.5 h in all; they resume where they stopped)
#   then:  .venv/bin/python benchmarks/summarize_honest.py RUNS_DIR > benchmarks/results/honest.md
#
# Lane 1: gate=log  (default) sink_tokens=4: 300 steps; eval causal, sequence, and sink_tokens=0.
# Lane 2: gate=paper          sink_tokens=4: 300 steps; eval causal, sequence; untrained random
#         centroids (0 steps, sequence routing: Sinkhorn-balanced random projections).
# Lanes 3 and 4: the README's default job (80 steps, defaults) with sink_tokens 0 and 4.
set -euo pipefail
cd "$(dirname "$0")/.."
LANE=${1:?usage: honest.sh 1|2|3|4 [RUNS_DIR]}
H=${2:-runs/honest}
mkdir -p "$H"
export PATH="$PWD/.venv/bin:$PATH"
COMMON=(--lr 3e-2 --warmup-steps 20 --eval-every 100 --eval-tokens 2048
  --save-every 50 --threads 1 --no-progress)
EV=(--split test --max-tokens 12288 --seq-len 1024 --top-k-values 1,2,4 --threads 1 --no-progress)
log() { echo "$(date -Is) $*" >>"$H/lane$LANE.log"; }
run() { log "start: $*"; if nice -n 10 "$@" >>"$H/lane$LANE.log" 2>&1; then log "ok: $1 $2"; else log "FAILED $?: $*"; fi; }
train() { # out, steps, flags...  (the first flags are COMMON's or the default job's)
  local out=$1 steps=$2; shift 2
  if [ -f "$out/train_result.json" ] && python3 -c "import json,sys; sys.exit(json.load(open('$out/train_result.json'))['steps'] != $steps)"; then return; fi
  if [ -d "$out/checkpoints" ]; then run focus train --out "$out" --steps "$steps" "$@" --resume
  else run focus train --out "$out" --steps "$steps" "$@"; fi
}
evaluate() { # adapter, name, flags...
  local a=$1 name=$2; shift 2
  [ -f "$a/eval-$name.json" ] || run focus eval --adapter "$a" "${EV[@]}" "$@" --json "$a/eval-$name.json" --markdown "$a/eval-$name.md"
}
if [ "$LANE" = 3 ] || [ "$LANE" = 4 ]; then  # the README default job's budget (80 steps)
  sinks=$([ "$LANE" = 3 ] && echo 0 || echo 4)
  train "$H/default-s$sinks" 80 --threads 1 --no-progress --sink-tokens "$sinks"
  evaluate "$H/default-s$sinks" causal
elif [ "$LANE" = 1 ]; then
  train "$H/log-s4" 300 "${COMMON[@]}" --gate log --sink-tokens 4
  evaluate "$H/log-s4" causal
  evaluate "$H/log-s4" sequence --inference-routing sequence
  evaluate "$H/log-s4" causal-sinks0 --sink-tokens 0
else
  train "$H/paper-s4" 300 "${COMMON[@]}" --gate paper --sink-tokens 4
  evaluate "$H/paper-s4" causal
  evaluate "$H/paper-s4" sequence --inference-routing sequence
  [ -f "$H/random/focus_config.json" ] || run focus train --out "$H/random" --steps 0 --eval-every -1 --threads 1 --no-progress
  evaluate "$H/random" sequence --inference-routing sequence --top-k-values 1,2
fi
log "lane $LANE done"
