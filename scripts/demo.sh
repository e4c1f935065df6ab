#!/usr/bin/env bash
# The main job (README): a tiny MoE GPT trained on CPU through megatron-core's schedules with
# every installed Titan plugin active. Extra arguments go to entrypoints/cpu_demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1 PYTHONWARNINGS=ignore
# Mooncake logs through glog; keep its per-connection INFO lines out of the demo output.
export GLOG_minloglevel=${GLOG_minloglevel:-2}
exec .venv/bin/torchrun --nproc-per-node "${NPROC:-4}" --master-port "${MASTER_PORT:-29641}" \
  entrypoints/cpu_demo.py "$@"
