#!/usr/bin/env bash
# The long-context recipe (README, "The long-context recipe: focus calibrate"): the choice of
# sink tokens and routing bias on the validation book, then `focus calibrate` and the
# test-book rows (perplexity at 4,096 and 8,192 tokens, needles, prefill speed). ADAPTER
# defaults to the main job's runs/austen; the recipe adapter goes to LONG (runs/austen-4k).
# About 2 hours on 2 cores. Results: benchmarks/results/long_context/recipe-*.
set -euo pipefail
cd "$(dirname "$0")/.."
adapter="${ADAPTER:-runs/austen}"
long="${LONG:-runs/austen-4k}"
out=benchmarks/results/long_context
focus=.venv/bin/focus
dense=(18 20 21 22 23)  # focus bench retrieval-layers on the validation book (benchmarks/retrieval.sh)
quiet=(--threads 2 --no-progress)
mkdir -p "$out"
choice=(--adapter "$adapter" --split validation --seq-len 4096 --max-tokens 16384 --top-k-values 1,2
        --window 512 --dense-layers "${dense[@]}" --no-soft "${quiet[@]}")
for s in 4 16 64 256; do
  "$focus" eval "${choice[@]}" --sink-tokens "$s" --json "$out/recipe-choice-s$s.json"
done
for s in 4 64 256; do
  "$focus" eval "${choice[@]}" --sink-tokens "$s" --calibrate-blocks 4 --json "$out/recipe-choice-s$s-cal4.json"
done
"$focus" calibrate --adapter "$adapter" --out "$long" --overwrite --seq-len 4096 --blocks 4 --window 512 \
  --sink-tokens 256 --dense-layers "${dense[@]}" "${quiet[@]}"
cp "$long/calibration.json" "$out/recipe-calibration.json"
for n in 4096 8192; do
  "$focus" eval --adapter "$long" --seq-len "$n" --max-tokens 16384 --top-k-values 1,2 --no-soft "${quiet[@]}" \
    --json "$out/recipe-eval-$n.json"
done
"$focus" bench needle --adapter "$long" --lengths 2048 4096 --depths 0.25 0.5 0.75 --trials 2 "${quiet[@]}" \
  --json "$out/recipe-needle.json"
"$focus" bench needle --adapter "$long" --lengths 8192 --depths 0.25 0.5 0.75 --trials 2 --threads 1 --no-progress \
  --json "$out/recipe-needle-8192.json" --plot "$out/recipe-needle-8192.png"
# timings: on a quiet machine
"$focus" bench model --adapter "$long" --lengths 4096 16384 --top-k 1 2 "${quiet[@]}" --json "$out/recipe-model.json"
