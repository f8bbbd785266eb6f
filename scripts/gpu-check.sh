#!/usr/bin/env bash
# One prepared run on a machine with a CUDA GPU and a CUDA build of PyTorch already installed
# (nothing is installed or downloaded): exactness of the CUDA paths, then the kernel benchmark
# from 4K to 128K tokens against the dense SDPA kernels of that machine.
#
#   OUT=/some/dir bash scripts/gpu-check.sh        # results land in $OUT (default runs/gpu)
#
# Writes: hardware.txt, gpu-tests.log, kernel-cuda-flash.json/.png, kernel-cuda-auto.json/.png,
# decode-op-8b-gather.json / decode-op-8b-masked.json, and decode-cuda-gather.json /
# decode-cuda-masked.json with FOCUS_ADAPTER=DIR (an adapter whose base model is prepared).
# Each step runs even when an earlier one fails; the exit status is that of the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
status=0
step() { "$@" || { rc=$?; echo "step failed ($rc): $*" >&2; [ "$status" -eq 0 ] && status=$rc; }; }

{
  nvidia-smi || true
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__); print(torch.cuda.get_device_name(0), \
torch.cuda.get_device_properties(0))"
} > "$out/hardware.txt" 2>&1
cat "$out/hardware.txt"

# exactness on CUDA: every test marked gpu (FlexAttention compiled with LSE, backward, dispatch,
# continuous batching with its decoding steps batched)
step "$py" -m pytest -q -m gpu -p no:cacheprovider tests/ops tests/bench/test_speed.py \
  tests/hf/test_attention_backend.py tests/hf/test_continuous_batching.py > "$out/gpu-tests.log" 2>&1
tail -n 30 "$out/gpu-tests.log"

# attention kernel: K = 8, window 128, SmolLM2's head shape, bf16, 4K..128K tokens
lengths="4096 8192 16384 32768 65536 131072"
for dense in flash auto; do
  step "$py" -m focus_attention.cli bench kernel --device cuda --dtype bfloat16 \
    --attention-backend flex --dense-kernel "$dense" --lengths $lengths --top-k 1 2 --repeats 5 \
    --no-gates --json "$out/kernel-cuda-$dense.json"
done
# one decoding call at the op level in a larger model's attention shape (Llama-3-8B's: 32 query,
# 8 key-value heads, D = 128; no model loaded), 4K..128K cached tokens, each decoding backend
for backend in gather masked; do
  step "$py" -m focus_attention.cli bench decode --device cuda --dtype bfloat16 --levels op \
    --num-heads 32 --num-key-value-heads 8 --head-dim 128 --contexts $lengths --top-k 1 2 \
    --attention-backend "$backend" --json "$out/decode-op-8b-$backend.json"
done
# decoding steps of the real model on the GPU, Focus against dense (only with FOCUS_ADAPTER, an
# adapter directory; FOCUS_MODEL, its base model, a registered name prepared in the asset cache
# or a model directory, default smollm2-135m; FOCUS_CORPUS, the text, default austen)
# with each decoding backend: gather ("auto"'s choice on CUDA) and masked (no host sync); each
# row counts the operations and host syncs of one step beside its time
if [ -n "${FOCUS_ADAPTER:-}" ]; then
  for backend in gather masked; do
    step "$py" -m focus_attention.cli bench decode --device cuda --dtype bfloat16 \
      --model "${FOCUS_MODEL:-smollm2-135m}" --corpus "${FOCUS_CORPUS:-austen}" \
      --adapter "$FOCUS_ADAPTER" --contexts 4096 16384 --levels op model --top-k 1 2 \
      --attention-backend "$backend" --json "$out/decode-cuda-$backend.json"
  done
fi
exit "$status"
