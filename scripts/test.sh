#!/usr/bin/env bash
# README's test command: set up .venv, prepare the real assets (idempotent, offline after the
# first run), then lint, build the documentation site with warnings as errors, and run the whole
# test suite: every tier, the tests marked `slow` and `assets` included (plain `pytest` runs the
# fast tier only, pyproject.toml's addopts). A `-m` among the arguments replaces the selection.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh "test,assets,bench,ruler,baselines,instruct,docs,serve"
.venv/bin/focus setup --model smollm2-135m --corpus austen --benchmarks
.venv/bin/ruff check .
.venv/bin/ruff format --check .
site_dir="$(mktemp -d)"  # the docs site: broken links and anchors between its pages fail here
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
set +e
.venv/bin/python -m pytest -q -m "slow or not slow" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treated as a failure" >&2
  exit 1
fi
exit "$rc"
