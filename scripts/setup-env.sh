#!/usr/bin/env bash
# Create .venv (if missing) and install the package with the given extras.
# Usage: scripts/setup-env.sh [EXTRAS]   e.g. "test,assets"
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch is pinned to the CPU build on local disk; install it first so nothing else pulls CUDA
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/pip install -q --disable-pip-version-check -e "$spec" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import focus_attention, torch; print('focus-attention', focus_attention.__version__, 'torch', torch.__version__)"
