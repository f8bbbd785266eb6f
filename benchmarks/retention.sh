#!/usr/bin/env bash
# Retention at the same data and budget (benchmarks/results/retention.*): every `focus train
# --method` on smollm2-135m (SmolLM2-135M-Instruct) with the main job's data, steps, seed and
# schedule, then for each run the held-out domain perplexity (focus eval, Persuasion), the
# zero-shot benchmarks (focus bench tasks) and instruction following with KL from the
# untouched model (focus bench instructions); then the table and plot
# (benchmarks/summarize_retention.py). Each method is one chain (train, eval, tasks,
# instructions); two chains run at once, one thread each (JOBS, THREADS). Every step skips
# outputs that exist, so rerunning the script resumes (training from its last checkpoint).
# Usage: bash benchmarks/retention.sh [all|one NAME|untouched|summary]
#   RUNS=runs/retention  LIMIT=50 (five tasks)  LAMBADA_LIMIT=200  PROMPTS=48  NEW_TOKENS=96
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:-all}"
runs="${RUNS:-runs/retention}"
out=benchmarks/results/retention
jobs="${JOBS:-2}"
threads="${THREADS:-1}"
focus=.venv/bin/focus
mkdir -p "$runs" "$out"

# name and the `focus train` flags of each method (the defaults are the main job's)
methods=(
  "focus|--method focus"
  "lora-match|--method lora --lora-rank match --lora-targets q,v"
  "lora-r8|--method lora --lora-rank 8 --lora-targets q,k,v,o"
  "attention|--method attention"
  "full|--method full"
  "focus+lora|--method focus+lora --lora-rank 8 --lora-targets q,k,v,o"
  "two-phase|--method two-phase --phase1-steps 40 --phase2-method full"
)

run_parallel() {  # the commands on stdin, $jobs at a time
  xargs -d '\n' -P "$jobs" -I{} bash -c '{}'
}

flags_of() {
  for m in "${methods[@]}"; do
    [[ ${m%%|*} == "$1" ]] && { echo "${m#*|}"; return; }
  done
  echo "unknown method $1" >&2
  return 2
}

tasks() {  # tasks NAME [--adapter DIR]: the five multiple-choice tasks and LAMBADA
  local name=$1
  shift
  local common=(--threads "$threads" --batch-size 16 "$@")
  [[ -f "$out/$name-tasks.json" ]] || $focus bench tasks "${common[@]}" --limit "${LIMIT:-50}" \
    --tasks hellaswag arc_easy arc_challenge piqa winogrande --json "$out/$name-tasks.json"
  [[ -f "$out/$name-lambada.json" ]] || $focus bench tasks "${common[@]}" \
    --limit "${LAMBADA_LIMIT:-200}" --tasks lambada_openai --json "$out/$name-lambada.json"
}

one() {  # the chain of one method
  local name=$1 dir="$runs/$1" flags
  flags=$(flags_of "$name")
  if [[ ! -f "$dir/done" ]]; then
    resume=--overwrite
    [[ -d "$dir/checkpoints" ]] && resume=--resume
    # shellcheck disable=SC2086  # the flags are words
    $focus train --corpus austen --out "$dir" --threads "$threads" --no-progress $flags $resume
    touch "$dir/done"
  fi
  [[ -f "$out/$name-eval.json" ]] || $focus eval --adapter "$dir" --corpus austen --split test \
    --threads "$threads" --no-progress --json "$out/$name-eval.json"
  tasks "$name" --adapter "$dir"
  [[ -f "$out/$name-instructions.json" ]] || $focus bench instructions --adapter "$dir" \
    --limit "${PROMPTS:-48}" --max-new-tokens "${NEW_TOKENS:-96}" --batch-size 16 \
    --threads "$threads" --no-progress --json "$out/$name-instructions.json"
}

case "$stage" in
  one) one "$2" ;;
  untouched) tasks untouched ;;
  summary) .venv/bin/python benchmarks/summarize_retention.py ;;
  all)
    {
      for m in "${methods[@]}"; do
        echo "bash benchmarks/retention.sh one '${m%%|*}' > '$runs/${m%%|*}.log' 2>&1"
      done
      echo "bash benchmarks/retention.sh untouched > '$runs/untouched.log' 2>&1"
    } | run_parallel
    .venv/bin/python benchmarks/summarize_retention.py
    ;;
  *) echo "unknown stage $stage (all|one NAME|untouched|summary)" >&2; exit 2 ;;
esac
