# Shared by benchmarks/other_k.sh and benchmarks/top1_training.sh (sourced from the repository
# root): the recipe's settings and choose(), which calibrates an adapter as the main job
# calibrates runs/austen-4k and scores it on the validation book and seed-1 pass keys.
out=benchmarks/results/other_k
focus=.venv/bin/focus
quiet=(--threads "${THREADS:-2}" --no-progress)
recipe=(--window 512 --sink-tokens 256 --dense-layers 18 20 21 22 23)
mkdir -p "$out"

choose() {  # choose NAME TOP_K...: calibrate runs/NAME, validation perplexity, seed-1 pass keys
  local name=$1
  shift
  "$focus" calibrate --adapter "runs/$name" --out "runs/$name-4k" --overwrite --seq-len 4096 \
    --blocks 4 "${recipe[@]}" "${quiet[@]}"
  "$focus" eval --adapter "runs/$name-4k" --split validation --seq-len 4096 --max-tokens 16384 \
    --no-soft --top-k-values "$(IFS=,; echo "$*")" "${quiet[@]}" --json "$out/val-4096-$name.json"
  "$focus" bench needle --adapter "runs/$name-4k" --haystacks passkey --lengths 2048 4096 \
    --depths 0.25 0.5 0.75 --trials 4 --seed 1 --top-k "$@" --no-dense "${quiet[@]}" \
    --json "$out/choice-needle-$name.json"
}
