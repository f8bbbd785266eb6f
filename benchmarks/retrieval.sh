#!/usr/bin/env bash
# Dense retrieval layers (README, "Keeping the retrieval layers dense"): rank the layers on the
# validation book, then the needle, 4K perplexity and prefill speed on the test book with
# them dense, at windows 128 and 512, and the window-512 recipe at 8K. ADAPTER defaults to
# the main job's runs/austen; the dense layers are the ranking's suggestion. Results:
# benchmarks/results/retrieval/.
set -euo pipefail
cd "$(dirname "$0")/.."
adapter="${ADAPTER:-runs/austen}"
out=benchmarks/results/retrieval
focus=.venv/bin/focus
mkdir -p "$out"
"$focus" bench retrieval-layers --adapter "$adapter" --threads 2 --no-progress --json "$out/layers.json"
read -r -a dense < <(.venv/bin/python -c "import json; print(*json.load(open('$out/layers.json'))['dense_layers'])")
needle=(--lengths 2048 4096 --depths 0.25 0.5 0.75 --trials 2 --threads 2 --no-progress)
eval4k=(--seq-len 4096 --max-tokens 16384 --top-k-values 1,2 --threads 2 --no-progress)
"$focus" bench needle --adapter "$adapter" --dense-layers "${dense[@]}" "${needle[@]}" --json "$out/needle-dense5.json"
"$focus" bench needle --adapter "$adapter" --dense-layers "${dense[@]}" --window 512 "${needle[@]}" --json "$out/needle-w512-dense5.json"
"$focus" eval --adapter "$adapter" --dense-layers "${dense[@]}" "${eval4k[@]}" --json "$out/eval-4096-dense5.json"
"$focus" eval --adapter "$adapter" --dense-layers "${dense[@]}" --window 512 "${eval4k[@]}" --json "$out/eval-4096-w512-dense5.json"
"$focus" eval --adapter "$adapter" --window 512 "${eval4k[@]}" --json "$out/eval-4096-w512.json"
# the recipe at 8,192 tokens (2 windows; about 30 minutes on one thread each)
"$focus" eval --adapter "$adapter" --dense-layers "${dense[@]}" --window 512 --seq-len 8192 \
  --max-tokens 16384 --top-k-values 1,2 --threads 2 --no-progress --json "$out/eval-8192-w512-dense5.json"
"$focus" bench needle --adapter "$adapter" --dense-layers "${dense[@]}" --window 512 --lengths 8192 \
  --depths 0.25 0.5 0.75 --trials 2 --threads 2 --no-progress --json "$out/needle-8192-w512-dense5.json"
# timings: on a quiet machine
"$focus" bench model --adapter "$adapter" --dense-layers "${dense[@]}" --lengths 4096 16384 \
  --windows 128 512 --top-k 1 2 --threads 2 --no-progress --json "$out/model-dense5.json"
