#!/usr/bin/env bash
# README's test command: set up .venv, prepare the real assets (idempotent, offline after the
# first run), then lint and run the whole test suite, including the tests marked `assets`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh "test,assets,bench,baselines,instruct"
.venv/bin/focus setup --model smollm2-135m --corpus austen --benchmarks
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
