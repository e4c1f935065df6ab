# Sourced by sglang_env.sh and test.sh: which SGLang release a CPU engine venv holds and where it
# lives. SGLANG_RELEASE picks it: 0.5.23 (default, .venv-sglang) or 0.5.15.post1 (slime's pin,
# .venv-sglang-0.5.15.post1); SGLANG_VENV overrides the path.
SGLANG_RELEASE=${SGLANG_RELEASE:-0.5.23}
case "$SGLANG_RELEASE" in
  0.5.23) SGLANG_DEFAULT_VENV=.venv-sglang ;;
  0.5.15.post1) SGLANG_DEFAULT_VENV=.venv-sglang-$SGLANG_RELEASE ;;
  *)
    echo "SGLANG_RELEASE=$SGLANG_RELEASE: the served SGLang releases are 0.5.23 and 0.5.15.post1" >&2
    exit 2
    ;;
esac
SGLANG_VENV=${SGLANG_VENV:-$SGLANG_DEFAULT_VENV}
