# Sourced by bootstrap.sh, demo.sh, test.sh and gpu_check.sh: which Megatron line this run uses,
# its Python and its venv. MEGATRON_CORE picks the line (a pinned release of each supported line);
# the default line lives in .venv, each other line in .venv-<version>.
DEFAULT_MEGATRON_CORE=0.19.2 # the current release
MEGATRON_CORE=${MEGATRON_CORE:-$DEFAULT_MEGATRON_CORE}
case "$MEGATRON_CORE" in
  0.16.1) LINE_PYTHON=3.11 ;;
  0.17.1 | 0.18.2 | 0.19.2) LINE_PYTHON=3.12 ;; # megatron-core >= 0.17 requires Python >= 3.12
  *)
    echo "MEGATRON_CORE=$MEGATRON_CORE: the supported lines are pinned at 0.16.1, 0.17.1, 0.18.2 and 0.19.2" >&2
    exit 2
    ;;
esac
if [ "$MEGATRON_CORE" = "$DEFAULT_MEGATRON_CORE" ]; then VENV=.venv; else VENV=.venv-$MEGATRON_CORE; fi
export MEGATRON_CORE VENV

# The interpreter for the line: $PYTHON if set, else pythonX.Y on PATH, else a pyenv install.
line_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if command -v "python$LINE_PYTHON" >/dev/null 2>&1 && "python$LINE_PYTHON" -V >/dev/null 2>&1; then
    echo "python$LINE_PYTHON"; return
  fi
  local found
  found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$LINE_PYTHON".*/bin/"python$LINE_PYTHON" 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$found" ]; then echo "$found"; return; fi
  echo "megatron-core $MEGATRON_CORE needs Python $LINE_PYTHON: install it (apt-get install python$LINE_PYTHON-venv, or pyenv install $LINE_PYTHON), or set PYTHON=/path/to/python$LINE_PYTHON" >&2
  return 1
}
