#!/usr/bin/env bash
# One command for the GPU check (issue 17): every plugin's GPU section on one GPU, one table,
# gpu_check.json. `--dry-run` runs the same sections tiny on CPU (CI does, so they cannot rot).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/megatron_line.sh
./scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec "$VENV/bin/python" benchmarks/gpu_check.py "$@"
