#!/usr/bin/env bash
# Asymmetric top-k (README, "Asymmetric top-k: query_top_k"): the long-context adapter with
# queries in two groups and keys in one (top_k 1, query_top_k 2) against top-1, top-2 and
# dense. Choices on the validation book and seed-1 pass keys; measurements on the test book and
# the benchmark's seed-0 needles (the prompts of recipe-needle*.json) and seed-2 ones. LONG defaults to the
# main job's runs/austen-4k. About 1.5 hours on 2 cores.
# Results: benchmarks/results/query_top_k/.
set -euo pipefail
cd "$(dirname "$0")/.."
long="${LONG:-runs/austen-4k}"
out=benchmarks/results/query_top_k
focus=.venv/bin/focus
quiet=(--threads 2 --no-progress)
mkdir -p "$out"
# choice: validation perplexity at 4,096 tokens, seed-1 pass keys
val=(--adapter "$long" --split validation --seq-len 4096 --max-tokens 16384 --no-soft "${quiet[@]}")
"$focus" eval "${val[@]}" --top-k-values 1,2 --json "$out/val-4096.json"
"$focus" eval "${val[@]}" --top-k-values 1 --query-top-k 2 --json "$out/val-4096-k1q2.json"
"$focus" eval "${val[@]}" --top-k-values 2 --query-top-k 1 --json "$out/val-4096-k2q1.json"
choose=(--adapter "$long" --haystacks passkey --lengths 2048 4096 --depths 0.25 0.5 0.75 --trials 4 --seed 1)
"$focus" bench needle "${choose[@]}" --top-k 1 2 "${quiet[@]}" --json "$out/choice-needle.json"
"$focus" bench needle "${choose[@]}" --top-k 1 --query-top-k 2 --no-dense "${quiet[@]}" \
  --json "$out/choice-needle-k1q2.json"
# measurement: the test book and the benchmark's seed-0 prompts (those of recipe-needle*.json)
"$focus" eval --adapter "$long" --seq-len 4096 --max-tokens 16384 --top-k-values 1,2 --no-soft "${quiet[@]}" \
  --json "$out/eval-4096.json"
for n in 4096 8192; do
  "$focus" eval --adapter "$long" --seq-len "$n" --max-tokens 16384 --top-k-values 1 --query-top-k 2 \
    --no-soft "${quiet[@]}" --json "$out/eval-$n-k1q2.json"
done
needle=(--adapter "$long" --depths 0.25 0.5 0.75 "${quiet[@]}")
"$focus" bench needle "${needle[@]}" --lengths 2048 4096 --trials 2 --top-k 1 2 --json "$out/needle.json"
"$focus" bench needle "${needle[@]}" --lengths 2048 4096 --trials 2 --top-k 1 --query-top-k 2 --no-dense \
  --json "$out/needle-k1q2.json"
"$focus" bench needle "${needle[@]}" --lengths 8192 --trials 2 --top-k 1 --query-top-k 2 --no-dense \
  --json "$out/needle-8192-k1q2.json"
# two more prompts per cell (seed 2)
"$focus" bench needle "${needle[@]}" --lengths 2048 4096 --trials 2 --seed 2 --top-k 1 2 \
  --json "$out/needle-seed2.json"
"$focus" bench needle "${needle[@]}" --lengths 2048 4096 --trials 2 --seed 2 --top-k 1 --query-top-k 2 \
  --no-dense --json "$out/needle-seed2-k1q2.json"
# timings: on a quiet machine, the symmetric rows and then the asymmetric one (each against
# its own run's sdpa)
"$focus" bench model --adapter "$long" --lengths 4096 16384 --top-k 1 2 "${quiet[@]}" --json "$out/model.json"
"$focus" bench model --adapter "$long" --lengths 4096 16384 --top-k 1 --query-top-k 2 --no-floor "${quiet[@]}" \
  --json "$out/model-k1q2.json"
