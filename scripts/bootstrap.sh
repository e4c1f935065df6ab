#!/usr/bin/env bash
# Create (or update) .venv with the pinned toolchain, the core and every plugin in editable mode.
# Idempotent: a second run only re-checks. Used by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

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
  [ -x .venv/bin/python ] || return 0
  .venv/bin/python -m compileall -q -j 0 titan_plugins plugins/*/titan_* >/dev/null 2>&1 || true
}

stamp=.venv/.titan-bootstrap
want=$(cat requirements/*.txt setup.cfg plugins/*/setup.cfg plugins/*/setup.py plugins/*/titan_*/*.c 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_sources
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
editables=(-e .)
for plugin in plugins/*/; do
  case "$plugin" in plugins/_*) continue ;; esac
  [ -f "$plugin/setup.cfg" ] && editables+=(-e "$plugin")
done
# pip's build warnings would bury the job's own output: keep them in a log, show it on failure.
log=.venv/bootstrap.log
echo "bootstrap: installing the pinned toolchain and every distribution into .venv ($log)" >&2
if ! {
  .venv/bin/python -m pip install -q --upgrade pip &&
    .venv/bin/python -m pip install -q -r requirements/dev.txt &&
    .venv/bin/python -m pip install -q --no-deps "${editables[@]}"
} >"$log" 2>&1; then
  cat "$log" >&2
  echo "bootstrap: pip failed (full log: $log)" >&2
  exit 1
fi
echo "$want" > "$stamp"
compile_sources
