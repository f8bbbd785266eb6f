#!/usr/bin/env bash
# Set up .venv and run lint + the whole test suite (README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh "test,assets"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treated as a failure" >&2
  exit 1
fi
exit "$rc"
