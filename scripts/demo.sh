#!/usr/bin/env bash
# The main job (README): a tiny MoE GPT trained on CPU through megatron-core's schedules with
# every installed Titan plugin active. Extra arguments go to entrypoints/cpu_demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/megatron_line.sh # MEGATRON_CORE picks the Megatron line (and its venv)
nproc=${NPROC:-4}
# The layout and arguments are checked once, before anything is installed or any worker starts:
# a layout that cannot run on NPROC processes, or a bad argument (demo_args.py), is refused in one
# line (not one Megatron traceback per rank, or a whole run first), and --pp / --ep left out are
# chosen to fit NPROC. demo_layout.py and demo_args.py need only the standard library.
for arg in "$@"; do
  case "$arg" in -h | --help) help=1 ;; --verbose) verbose=1 ;; esac
done
if [ -z "${help:-}" ]; then
  PY=$(line_python) || exit 2
  resolved=$("$PY" entrypoints/demo_layout.py "$nproc" "$@") || exit 2
  eval "set -- $resolved"
  # MASTER_PORT when set (refused in one line if something listens there), else a free port,
  # so two demos at once do not both take one fixed port.
  port=$("$PY" entrypoints/demo_args.py master-port) || exit 2
fi
./scripts/bootstrap.sh
if [ -n "${help:-}" ]; then exec "$VENV/bin/python" entrypoints/cpu_demo.py --help; fi
export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1
if [ -z "${verbose:-}" ]; then # --verbose: every line every library prints
  export PYTHONWARNINGS=ignore
  # Mooncake sets glog's level from its own MC_LOG_LEVEL (GLOG_minloglevel is ignored), which
  # keeps its per-connection INFO and WARNING lines out of the demo output.
  export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
fi
# A plugin that stops the job on purpose (rewind with nothing to roll back to) prints one
# message on rank 0; the workers leave their exit code here instead of failing under torchrun,
# which would add a traceback per worker.
status_dir=$(mktemp -d)
trap 'rm -rf "$status_dir"' EXIT
demo() {
  TITAN_DEMO_STATUS="$status_dir/exit" "$VENV/bin/torchrun" --nproc-per-node "$nproc" \
    --master-port "$port" entrypoints/cpu_demo.py "$@"
}
# Ctrl-C: the job runs in its own process group (set -m), so a terminal's Ctrl-C reaches this
# script alone. torchrun would forward it to every worker (each printing a KeyboardInterrupt
# traceback) and print its own; instead the trap stops the whole tree at once, torchrun's workers
# included (they run in sessions of their own, which a group kill misses), in one line.
stop_tree() { # $1 and every descendant: each frozen as found (it starts no other), then killed
  local pids=("$1") i=0 child
  kill -STOP "$1" 2>/dev/null || true
  while [ "$i" -lt "${#pids[@]}" ]; do
    for child in $(ps -o pid= --ppid "${pids[$i]}"); do
      kill -STOP "$child" 2>/dev/null || true
      pids+=("$child")
    done
    i=$((i + 1))
  done
  # The job's process group first, in one atomic kill (set -m made $1 its leader: the
  # subshells, the filter and torchrun), then the rest (the workers, in sessions of their own).
  # Killed one by one, the leader first, the stopped group was left orphaned, and the kernel
  # wakes such a group with SIGHUP + SIGCONT: torchrun printed "Received 1 death signal,
  # shutting down workers" before its own SIGKILL landed (a full run on 2 loaded cores).
  kill -KILL -- "-$1" 2>/dev/null || true
  kill -KILL "${pids[@]}" 2>/dev/null || true
}
interrupted() { # $1: the exit status (130: Ctrl-C, 143: SIGTERM)
  trap "" INT TERM
  local started=${job:-${!:-}} # $!: a Ctrl-C right after the job started, before job=$!
  if [ -n "$started" ]; then
    stop_tree "$started"
    wait "$started" 2>/dev/null || true
  fi
  echo "demo: interrupted; every worker stopped" >&2
  exit "$1"
}
job=
trap "interrupted 130" INT
trap "interrupted 143" TERM
set -m
if [ -n "${verbose:-}" ]; then
  demo "$@" &
else
  # The workers' stderr, less the native libraries' start-up chatter (each line and why in
  # titan_plugins/native_noise.py); stdout goes straight through (fd 3), torchrun's status counts.
  { demo "$@" 2>&1 1>&3 3>&- | "$VENV/bin/python" entrypoints/demo_noise.py 3>&-; } 3>&1 &
fi
job=$!
set +m
code=0
wait "$job" || code=$?
trap - INT TERM
[ "$code" -eq 0 ] || exit "$code"
code=0
for file in "$status_dir"/exit.*; do
  [ -e "$file" ] && code=$(cat "$file")
done
exit "$code"
