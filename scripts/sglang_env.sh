#!/usr/bin/env bash
# Create (or update) the SGLang venv of one release on CPU, for the weight_sync / SGLang-host tests
# and the benchmark (engines run there; the trainer runs in the Megatron line's venv).
# SGLANG_RELEASE picks it: 0.5.23 (default, .venv-sglang) or 0.5.15.post1 (slime's pin,
# .venv-sglang-0.5.15.post1). Every package is pinned in requirements/sglang-<release>.txt and
# installed with --no-deps: sglang's own metadata pulls a CUDA torch, torchvision, sgl-kernel and
# flashinfer. The two imports with no CPU build are stubbed by
# tests/sglang_env/titan_sglang_cpu_stubs.py, for this venv only. Then the core and weight_sync,
# editable. Idempotent: a second run only re-checks. SGLANG_DEPS_ONLY=1 installs torch and the
# pinned packages only, unstamped (scripts/test.sh prepares the venv that way while earlier legs
# run; the editable installs write into the source tree, so they wait for the plain run).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/sglang_release.sh # SGLANG_RELEASE, SGLANG_VENV
. scripts/pip_retry.sh
RELEASE=$SGLANG_RELEASE
VENV=$SGLANG_VENV
requirements=requirements/sglang-$RELEASE.txt
stamp=$VENV/.titan-bootstrap
want=$(cat "$requirements" setup.cfg plugins/weight_sync/setup.cfg tests/sglang_env/titan_sglang_cpu_stubs.py scripts/sglang_env.sh scripts/sglang_release.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
PY=${PYTHON311:-python3.11}
if ! command -v "$PY" >/dev/null 2>&1; then
  PY=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11.*/bin/python3.11 2>/dev/null | sort -V | tail -n 1)
fi
if [ -z "$PY" ]; then
  echo "sglang_env: needs Python 3.11 (set PYTHON311=/path/to/python3.11)" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# pip's isolated build environments break with the stubs' sys.path lines: out while pip runs
rm -f "$site/zz_titan_sglang_cpu_stubs.pth"
log=$VENV/bootstrap.log
echo "sglang_env: installing SGLang $RELEASE (CPU), the core and weight_sync into $VENV ($log)" >&2
: >"$log"
if ! {
  pip_retry "$VENV/bin/python" "$log" -q torch==2.13.0 &&
    pip_retry "$VENV/bin/python" "$log" -q --no-deps -r "$requirements" &&
    { [ "${SGLANG_DEPS_ONLY:-0}" = 1 ] || pip_retry "$VENV/bin/python" "$log" -q --no-deps -e . -e plugins/weight_sync; }
}; then
  cat "$log" >&2
  echo "sglang_env: pip failed (full log: $log)" >&2
  exit 1
fi
[ "${SGLANG_DEPS_ONLY:-0}" = 1 ] && exit 0
stubs=$(pwd)/tests/sglang_env
# transformers reads torchvision's version from its metadata: give the stub one
mkdir -p "$stubs/dist"
dist="$stubs/dist/torchvision-0.28.0.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n' >"$dist/METADATA"
# transformers 5.12 finds a distribution's version through its top-level package names
printf 'torchvision\n' >"$dist/top_level.txt"
printf 'import sys; sys.path.insert(0, %s); sys.path.insert(0, %s); import titan_sglang_cpu_stubs\n' \
  "'$stubs/dist'" "'$stubs'" >"$site/zz_titan_sglang_cpu_stubs.pth"
echo "$want" >"$stamp"
