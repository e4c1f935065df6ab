#!/usr/bin/env bash
# Create (or update) the venv of one Megatron line (MEGATRON_CORE, scripts/megatron_line.sh: .venv
# for the default line, .venv-<version> for the others) with the pinned toolchain, that line's
# megatron-core, the core and every plugin in editable mode. Idempotent: a second run only
# re-checks. Used by scripts/demo.sh, scripts/test.sh and scripts/gpu_check.sh.
# BOOTSTRAP_DEPS_ONLY=1 installs the pinned requirements only (the slow part: torch and its
# libraries) and leaves the venv unstamped: scripts/test.sh prepares the next legs' venvs that way
# while a leg's tests run, and the editable installs, which write into the source tree that the
# running tests build from, wait for the plain run before the leg.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/megatron_line.sh
. scripts/pip_retry.sh

# Mooncake's non-CUDA wheel links libibverbs (Debian libibverbs1); install it when missing.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 libnuma1 libcurl4) >/dev/null \
      || echo "bootstrap: could not install libibverbs1; pp_rdma falls back to torch.distributed" >&2
  else
    echo "bootstrap: libibverbs1 missing (apt-get install libibverbs1); pp_rdma falls back to torch.distributed" >&2
  fi
fi

# Editable installs get no bytecode from pip (a wheel install compiles at install time), and with
# PYTHONDONTWRITEBYTECODE set (CI, this sandbox) Python never caches it: every process would
# compile the core and plugins from source while megatron imports (~90 ms here). Compile them
# now, as a wheel install does; up-to-date files are skipped.
compile_sources() {
  [ -x "$VENV/bin/python" ] || return 0
  "$VENV/bin/python" -m compileall -q -j 0 titan_plugins plugins/*/titan_* >/dev/null 2>&1 || true
}

requirements=(requirements/dev.txt "requirements/megatron-$MEGATRON_CORE.txt")
stamp=$VENV/.titan-bootstrap
want=$(cat "${requirements[@]}" setup.cfg plugins/*/setup.cfg plugins/*/setup.py plugins/*/titan_*/*.c 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_sources
  exit 0
fi
# A venv of another Python (the default line moved from 0.16/3.11 to 0.19/3.12) is rebuilt.
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$LINE_PYTHON')"; then
  echo "bootstrap: $VENV holds another Python than megatron-core $MEGATRON_CORE needs ($LINE_PYTHON): rebuilding it" >&2
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  PY=$(line_python) || exit 2
  "$PY" -m venv "$VENV"
fi
deps_only=${BOOTSTRAP_DEPS_ONLY:-0}
editables=()
if [ "$deps_only" != 1 ]; then
  editables=(-e .)
  for plugin in plugins/*/; do
    case "$plugin" in plugins/_*) continue ;; esac
    [ -f "$plugin/setup.cfg" ] && editables+=(-e "$plugin")
  done
fi
# pip's build warnings would bury the job's own output: keep them in a log, show it on failure.
log=$VENV/bootstrap.log
what="megatron-core $MEGATRON_CORE, the pinned toolchain"
[ "$deps_only" = 1 ] || what="$what and every distribution"
echo "bootstrap: installing $what into $VENV ($log)" >&2
: >"$log"
if ! {
  pip_retry "$VENV/bin/python" "$log" -q --upgrade pip &&
    pip_retry "$VENV/bin/python" "$log" -q "${requirements[@]/#/-r}" &&
    { [ "$deps_only" = 1 ] || pip_retry "$VENV/bin/python" "$log" -q --no-deps "${editables[@]}"; }
}; then
  cat "$log" >&2
  echo "bootstrap: pip failed (full log: $log)" >&2
  exit 1
fi
[ "$deps_only" = 1 ] && exit 0 # unstamped: the plain run installs the distributions
echo "$want" > "$stamp"
compile_sources
