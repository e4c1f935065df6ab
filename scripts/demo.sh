#!/usr/bin/env bash
# The main job (README): a tiny MoE GPT trained on CPU through megatron-core's schedules with
# every installed Titan plugin active. Extra arguments go to entrypoints/cpu_demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1 PYTHONWARNINGS=ignore
# Mooncake logs through glog before InitGoogleLogging (GLOG_minloglevel is ignored there);
# its own MC_LOG_LEVEL keeps the per-connection INFO and WARNING lines out of the demo output.
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec .venv/bin/torchrun --nproc-per-node "${NPROC:-4}" --master-port "${MASTER_PORT:-29641}" \
  entrypoints/cpu_demo.py "$@"
