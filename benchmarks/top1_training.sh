#!/usr/bin/env bash
# Training for top_k = 1 with K = 4 (README, "Other K, training at 4,096 tokens, and queries in
# three groups"): from the K = 4 adapter of benchmarks/other_k.sh (runs/austen-k4),
#   - cross-entropy at 4,096-token blocks, 12 steps (--init-adapter);
#   - straight-through top-1 distillation at 2,048-token blocks, 20 steps: the soft layers
#     attend under the hard top-1 mask, the gradient goes through the Sinkhorn rows
#     (--straight-through, docs/method.md §6);
#   - the mix objective (cross-entropy + KL from the dense model), the main job's training
#     otherwise, from fresh routers.
# Each is calibrated as the main job calibrates runs/austen-4k and chosen on the validation
# book and seed-1 pass keys, like benchmarks/other_k.sh. The recorded runs used one thread
# each, two at a time (THREADS=1): about 1.5 hours of CPU per run. Results:
# benchmarks/results/other_k/.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/choose.sh

test -d runs/austen-k4 || "$focus" train --num-groups 4 --out runs/austen-k4 "${quiet[@]}"
"$focus" train --init-adapter runs/austen-k4 --num-groups 4 --seq-len 4096 --steps 12 \
  --warmup-steps 2 --lr 1e-2 --soft-chunk-size 512 --eval-every -1 --save-every 4 "${recipe[@]}" \
  --out runs/austen-k4lm4k --overwrite "${quiet[@]}"
choose austen-k4lm4k 1 2
"$focus" train --init-adapter runs/austen-k4 --num-groups 4 --top-k 1 --straight-through \
  --objective distill --seq-len 2048 --steps 20 --warmup-steps 2 --lr 1e-2 --soft-chunk-size 512 \
  --eval-every -1 --save-every 5 "${recipe[@]}" --out runs/austen-k4st --overwrite "${quiet[@]}"
choose austen-k4st 1
"$focus" train --num-groups 4 --objective mix --out runs/austen-k4mix --overwrite "${quiet[@]}"
choose austen-k4mix 1 2
