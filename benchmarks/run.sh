#!/usr/bin/env bash
# Reproduce the committed benchmark results (run on an otherwise idle machine).
#   kernel: sparse_attention vs dense SDPA, N in {1024, 4096, 16384, 32768}   (~10 min on 2 cores)
#   model:  smollm2-135m prefill, stock sdpa vs Focus top-k, N in {4096, 16384} (~15 min)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh "assets"
.venv/bin/focus bench kernel --json benchmarks/results/kernel.json
.venv/bin/focus setup --model smollm2-135m --corpus austen
.venv/bin/focus bench model --json benchmarks/results/model.json
