#!/usr/bin/env bash
# One prepared run on a machine with one CUDA GPU (H100 or H200) and a CUDA build of PyTorch
# already installed (nothing is installed or downloaded): at most 8 minutes, at most 8 JSON
# files, each step stopped at its cap so that a hang costs that step, not the run.
#
#   OUT=/some/dir bash scripts/gpu-check.sh        # results land in $OUT (default runs/gpu)
#
# Variables: PYTHON (default python3); BUDGET, the seconds the whole run may take (default
# 470); FOCUS_ADAPTER=DIR adds the last two steps (an adapter whose base model FOCUS_MODEL,
# default smollm2-135m, is prepared in the asset cache, with the corpus FOCUS_CORPUS, default
# austen: runs/austen-4k of the main job); DRY_RUN=1 prints every step's command instead.
#
# Steps, in order (estimated seconds on one H100 / the cap; each cap is also cut to the time
# left in BUDGET, 10 s kept for the record; Python's start, ~5 s, and Triton's or inductor's
# first compilations are inside the estimates):
#   0. the compile table for this device's compute capability, printed in full first: every
#      Triton kernel at the configurations its launchers choose for bfloat16 and float16 at
#      SmolLM2's and Llama-3-8B's head shapes, with shared memory, registers and spills
#      (python -m focus_attention.ops.sparse.triton_compile --set models)  ~25 / 60 -> compile.json
#   1. hardware and versions                                    ~8 / 20   -> check.json
#   2. the CUDA tests (pytest -m gpu, every test file marked)  ~60 / 75   -> check.json
#   3. bench kernel, bf16, K=8, window 128, 4K-128K tokens, top_k 1 and 2, against SDPA's
#      flash kernel: SmolLM2's head shape (9/3, D 64)          ~25 / 45
#      and Llama-3-8B's (32/8, D 128)                          ~40 / 60   -> kernel.json
#   4. bench model (prefill), random weights, bf16, 16K/32K/64K tokens, sdpa, the
#      no-attention floor and Focus top-1 with the long-input recipe (K=8, window 512,
#      256 sink tokens): random:llama-3.2-1b (1 warm-up, median of 2)  ~30 / 50
#      and random:llama-3-8b (1 warm-up, 1 timed)             ~60 / 80   -> prefill.json
#   5. bench decode, op level, Llama-3-8B's attention shape, 4K-128K cached tokens, batch 1
#      and 16, top_k 1 and 2, CUDA graphs, static-cache decoding op  ~25 / 45 -> decode-op.json
#   6. bench decode, model level, static caches and CUDA graphs, 8K-64K cached tokens, batch
#      1 and 16, top-1 with the recipe (cells whose caches do not fit are skipped, the
#      reason recorded): random:llama-3.2-1b                 ~35 / 55
#      and random:llama-3-8b                                   ~55 / 75   -> decode-model.json
#   7. with FOCUS_ADAPTER: bench decode of the adapter's model (op and model level, 4K and
#      8,000 cached tokens, batch 1 and 16, top_k 1 and 2, graphs)  ~25 / 40 -> decode-smollm2.json
#   8. with FOCUS_ADAPTER: bench serve, the serve study's 16-request cells (1K-8K-token
#      prompts, 8 new tokens) with --continuous-batching, top-1, top-2 and dense  ~70 / left
#                                                                              -> serve.json
#   Without FOCUS_ADAPTER: about 365 s expected, 470 s at most (the caps, cut to BUDGET).
#   Timed calls: kernel 3 repeats after a warm-up; decoding 20 steps after 3 warm-up steps
#   (graph replays where captured); each merge of parts below ~1 s.
#
# Files in $OUT (JSON only; each result records hardware, versions, settings, git commit):
#   compile.json (the compile table), check.json (hardware, versions, the GPU tests by
#   outcome, every step's status, time and the end of its output; rewritten after each
#   step), kernel.json, prefill.json,
#   decode-model.json (each the parts of one benchmark, merged by `focus bench merge`),
#   decode-op.json, and with FOCUS_ADAPTER decode-smollm2.json and serve.json.
#
# Plots, afterwards on any machine, from the JSON alone:
#   focus bench plot --results $OUT/kernel.json $OUT/prefill.json $OUT/decode-op.json \
#     $OUT/decode-model.json --out $OUT/plots
# The exit status is that of the first step that failed (124: stopped at its cap).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
budget="${BUDGET:-470}"
dry="${DRY_RUN:-0}"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
status=0
if [ "$dry" = 1 ]; then
  parts="${TMPDIR:-/tmp}/focus-gpu-check-parts"
else
  mkdir -p "$out"
  parts="$(mktemp -d "${TMPDIR:-/tmp}/focus-gpu-check.XXXXXX")"
  trap 'rm -rf "$parts"' EXIT
fi

# record: check.json from the steps so far (no torch: under a second)
record() {
  [ "$dry" = 1 ] || "$py" -m focus_attention.bench.run_record record "$parts" "$out/check.json"
}

# run NAME CAP COMMAND...: COMMAND under timeout (the cap, cut to the time left), its output
# in $parts/NAME.log (printed whole with SHOW=all, else its last 12 lines), its status in
# $parts/steps.tsv, then the record rewritten
run() {
  local name=$1 cap=$2
  shift 2
  if [ "$dry" = 1 ]; then
    printf '%s:' "$name"
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  local left=$((budget - (SECONDS - start) - 10))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 15 ]; then
    printf '%s\tnot run: no time left\t0\t0\n' "$name" >>"$parts/steps.tsv"
    echo "== $name: not run (no time left)"
    record
    return 0
  fi
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >"$parts/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$parts/steps.tsv"
  local summary="== $name: exit $rc after $((SECONDS - t0)) s (cap $limit s, $((SECONDS - start)) s in)"
  if [ "${SHOW:-tail}" = all ]; then
    cat "$parts/$name.log"
    echo "$summary"
  else
    echo "$summary"
    tail -n 12 "$parts/$name.log"
  fi
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
  record
}

# focus NAME CAP ARGS...: `focus ARGS` as a step (printed as `focus ARGS` in a dry run)
focus() {
  local name=$1 cap=$2
  shift 2
  if [ "$dry" = 1 ]; then
    printf 'focus'
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  run "$name" "$cap" "$py" -m focus_attention.cli "$@"
}

# merge FILE PART...: the parts that exist merged into $out/FILE
merge() {
  local target=$1 found=()
  shift
  for part in "$@"; do
    if [ "$dry" = 1 ] || [ -s "$part" ]; then found+=("$part"); fi
  done
  if [ "${#found[@]}" -gt 0 ]; then
    focus "merge-${target%.json}" 30 bench merge --results "${found[@]}" --json "$out/$target"
  fi
}

# 0. the compile table of this device's capability (Triton compiles on the host: no GPU time)
SHOW=all run compile 60 "$py" -m focus_attention.ops.sparse.triton_compile --set models \
  --jobs 4 --json "$out/compile.json"

# 1. hardware and versions
run hardware 20 "$py" -m focus_attention.bench.run_record hardware "$parts/hardware.json"

# 2. the CUDA tests: every test file with a test marked gpu (which ran: check.json)
gpu_tests=()
while IFS= read -r file; do gpu_tests+=("$file"); done < <(grep -rl --include='*.py' 'mark\.gpu' tests | sort)
[ "$dry" = 1 ] || printf '%s\n' "${gpu_tests[@]}" >"$parts/gpu-tests.files"
run gpu-tests 75 "$py" -m pytest -v -rs -m gpu -p no:cacheprovider "${gpu_tests[@]}"

# 3. the attention kernel against SDPA's flash kernel, two head shapes
lengths=(4096 8192 16384 32768 65536 131072)
kernel=(bench kernel --device cuda --dtype bfloat16 --lengths "${lengths[@]}" --top-k 1 2
  --window 128 --num-groups 8 --dense-kernel flash --repeats 3 --no-gates --no-progress)
focus kernel-smollm2 45 "${kernel[@]}" --num-heads 9 --num-key-value-heads 3 --head-dim 64 \
  --json "$parts/kernel-smollm2.json"
focus kernel-llama-8b 60 "${kernel[@]}" --num-heads 32 --num-key-value-heads 8 --head-dim 128 \
  --json "$parts/kernel-llama-8b.json"
merge kernel.json "$parts/kernel-smollm2.json" "$parts/kernel-llama-8b.json"

# 4. prefill of random-weight models: sdpa, no attention, Focus top-1 with the long-input recipe
recipe=(--num-groups 8 --window 512 --sink-tokens 256)
prefill=(bench model --device cuda --dtype bfloat16 --lengths 16384 32768 65536 --top-k 1
  "${recipe[@]}" --warmup 1 --no-progress)
focus prefill-1b 50 "${prefill[@]}" --model random:llama-3.2-1b --repeats 2 \
  --json "$parts/prefill-1b.json"
focus prefill-8b 80 "${prefill[@]}" --model random:llama-3-8b --repeats 1 \
  --json "$parts/prefill-8b.json"
merge prefill.json "$parts/prefill-1b.json" "$parts/prefill-8b.json"

# 5. one decoding call, Llama-3-8B's attention shape (no model loaded), CUDA graphs
decode=(bench decode --device cuda --dtype bfloat16 --kv-cache static --cuda-graphs
  --batch-size 1 16 --steps 20 --warmup 3 --no-progress)
focus decode-op 45 "${decode[@]}" --levels op --num-heads 32 --num-key-value-heads 8 \
  --head-dim 128 --contexts "${lengths[@]}" --top-k 1 2 --num-groups 8 --window 512 \
  --json "$out/decode-op.json" --plot "$parts/decode-op.png"

# 6. decoding steps of random-weight models over static caches, CUDA graphs
model_decode=("${decode[@]}" --levels model --contexts 8192 16384 32768 65536 --top-k 1
  "${recipe[@]}")
focus decode-1b 55 "${model_decode[@]}" --model random:llama-3.2-1b --json "$parts/decode-1b.json"
focus decode-8b 75 "${model_decode[@]}" --model random:llama-3-8b --json "$parts/decode-8b.json"
merge decode-model.json "$parts/decode-1b.json" "$parts/decode-8b.json"

# 7-8. the trained adapter: its model's decoding steps, and served with continuous batching
if [ -n "${FOCUS_ADAPTER:-}" ]; then
  base=(--model "${FOCUS_MODEL:-smollm2-135m}" --corpus "${FOCUS_CORPUS:-austen}"
    --adapter "$FOCUS_ADAPTER")
  focus decode-smollm2 40 "${decode[@]}" "${base[@]}" --levels op model --contexts 4096 8000 \
    --top-k 1 2 --json "$out/decode-smollm2.json" --plot "$parts/decode-smollm2.png"
  focus serve 600 bench serve "${base[@]}" --device cuda --dtype bfloat16 --concurrency 16 \
    --lengths 1024 2048 4096 8000 --top-k 1 2 --continuous-batching --max-new-tokens 8 \
    --cell-timeout 30 --json "$out/serve.json" --plot "$parts/serve.png"
fi
echo "gpu-check: $((SECONDS - start)) s, exit status $status; results in $out"
exit "$status"
