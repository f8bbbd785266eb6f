#!/usr/bin/env bash
# Other ways to keep top_k = 1 retrieval (README, "Other K, training at 4,096 tokens,
# query_top_k 3"): adapters with K = 4 and K = 16 (the main job's training otherwise), the
# coverage objective at 4,096-token blocks under the recipe's settings, cross-entropy at
# 4,096-token blocks continuing the main job's routers, and the recipe adapter with queries in
# three groups. Each is calibrated as the main job calibrates runs/austen-4k, then chosen on the
# validation book and seed-1 pass keys; the chosen one is measured on the test book and the
# benchmark's seed-0 and seed-2 needles. Needs the main job's runs/austen and runs/austen-4k.
# About 3.5 hours of CPU (the recorded runs used one thread each, two at a time: THREADS=1). Results: benchmarks/results/other_k/.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/choose.sh

"$focus" train --num-groups 16 --out runs/austen-k16 --overwrite "${quiet[@]}"
choose austen-k16 1 2 3
"$focus" train --num-groups 4 --out runs/austen-k4 --overwrite "${quiet[@]}"
choose austen-k4 1 2
"$focus" train --objective coverage --seq-len 4096 --steps 60 --eval-every -1 "${recipe[@]}" \
  --out runs/austen-cov4k --overwrite "${quiet[@]}"
choose austen-cov4k 1 2
"$focus" train --init-adapter runs/austen --seq-len 4096 --steps 12 --warmup-steps 2 --lr 1e-2 \
  --soft-chunk-size 512 --eval-every -1 --save-every 4 "${recipe[@]}" --out runs/austen-lm4k \
  --overwrite "${quiet[@]}"
choose austen-lm4k 1 2
# the recipe adapter with queries in three groups
"$focus" eval --adapter runs/austen-4k --split validation --seq-len 4096 --max-tokens 16384 --no-soft \
  --top-k-values 1 --query-top-k 3 "${quiet[@]}" --json "$out/val-4096-k1q3.json"
"$focus" bench needle --adapter runs/austen-4k --haystacks passkey --lengths 2048 4096 \
  --depths 0.25 0.5 0.75 --trials 4 --seed 1 --top-k 1 --query-top-k 3 --no-dense "${quiet[@]}" \
  --json "$out/choice-needle-k1q3.json"
# the choice (K = 4) on the test book and the benchmark's needles (dense: query_top_k/needle*.json)
k4=runs/austen-k4-4k
for n in 4096 8192; do
  "$focus" eval --adapter "$k4" --seq-len "$n" --max-tokens 16384 --top-k-values 1,2 --no-soft \
    "${quiet[@]}" --json "$out/eval-$n-k4.json"
done
needle=(--adapter "$k4" --depths 0.25 0.5 0.75 --lengths 2048 4096 --trials 2 --top-k 1 2 --no-dense "${quiet[@]}")
"$focus" bench needle "${needle[@]}" --json "$out/needle-k4.json"
"$focus" bench needle "${needle[@]}" --seed 2 --json "$out/needle-seed2-k4.json"
.venv/bin/python benchmarks/summarize_choice.py \
  "K 16=$out/val-4096-austen-k16.json,$out/choice-needle-austen-k16.json" \
  "K 4=$out/val-4096-austen-k4.json,$out/choice-needle-austen-k4.json" \
  "coverage 4K=$out/val-4096-austen-cov4k.json,$out/choice-needle-austen-cov4k.json" \
  "lm 4K=$out/val-4096-austen-lm4k.json,$out/choice-needle-austen-lm4k.json" \
  "recipe=$out/val-4096-k1q3.json,$out/choice-needle-k1q3.json" --out "$out/choice.md"
