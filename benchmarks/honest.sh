#!/usr/bin/env bash
# The README's quality runs: centroid-only trainings of smollm2-135m on austen/train and their
# evaluation on the first 12,288 tokens of the held-out book (Persuasion) in 1024-token
# windows. The settings are files in configs/honest/ (one per training, eval.toml for every
# evaluation); this script only names the lanes.
#
#   usage: bash benchmarks/honest.sh 1|2|3|4 [RUNS_DIR]   (lanes of one torch thread each, niced;
#          run two at a time on a 2-core machine, ~2.5 h in all; they resume where they stopped)
#   then:  .venv/bin/python benchmarks/summarize_honest.py RUNS_DIR > benchmarks/results/honest.md
#
# Lane 1: log-s4 (300 steps); eval causal, sequence, and sink_tokens=0.
# Lane 2: paper-s4 (300 steps); eval causal, sequence; untrained random routers (sequence).
# Lanes 3 and 4: the main job's recipe (80 steps) with sink_tokens 0 and 4.
set -euo pipefail
cd "$(dirname "$0")/.."
LANE=${1:?usage: honest.sh 1|2|3|4 [RUNS_DIR]}
H=${2:-runs/honest}
C=configs/honest
mkdir -p "$H"
export PATH="$PWD/.venv/bin:$PATH"
log() { echo "$(date -Is) $*" >>"$H/lane$LANE.log"; }
run() { log "start: $*"; if nice -n 10 "$@" >>"$H/lane$LANE.log" 2>&1; then log "ok: $1 $2"; else log "FAILED $?: $*"; fi; }
train() { # name: configs/honest/NAME.toml into RUNS_DIR/NAME (resumed if it stopped; a
  local name=$1 out="$H/$1"  # finished run's --resume does nothing)
  if [ -d "$out/checkpoints" ]; then run focus train --config "$C/$name.toml" --out "$out" --resume
  else run focus train --config "$C/$name.toml" --out "$out"; fi
}
evaluate() { # name, evaluation name, extra flags...
  local a="$H/$1" name=$2; shift 2
  [ -f "$a/eval-$name.json" ] || run focus eval --config "$C/eval.toml" --adapter "$a" "$@" \
    --json "$a/eval-$name.json" --markdown "$a/eval-$name.md"
}
case "$LANE" in
  1) train log-s4
     evaluate log-s4 causal
     evaluate log-s4 sequence --inference-routing sequence
     evaluate log-s4 causal-sinks0 --sink-tokens 0 ;;
  2) train paper-s4
     evaluate paper-s4 causal
     evaluate paper-s4 sequence --inference-routing sequence
     train random
     evaluate random sequence --inference-routing sequence --top-k-values 1,2 ;;
  3) train default-s0; evaluate default-s0 causal ;;
  4) train default-s4; evaluate default-s4 causal ;;
  *) echo "usage: honest.sh 1|2|3|4 [RUNS_DIR]" >&2; exit 2 ;;
esac
log "lane $LANE done"
