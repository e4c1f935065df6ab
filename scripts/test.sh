#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this): lint, format check, all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
