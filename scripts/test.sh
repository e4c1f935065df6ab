#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this): ruff check and ruff format
# --check, then the pytest suite on each fully tested Megatron line (FULL_LINES: 0.19.2, the
# current release, and 0.16.1, the line slime and miles run), and the line checks, the
# composition matrix and the demo on the lines between (SOME_LINES: 0.17.1 and 0.18.2). Each line
# has its own venv (scripts/megatron_line.sh). Each test runs where it can fail differently: a
# test marked ``line_independent`` imports no megatron and starts no process that does (checked
# on every run, titan_plugins/testing/line_guard.py), so the Megatron line cannot change its
# outcome, but the interpreter and what the venv compiled for it can (trace_analysis' C reader):
# it runs on the first full line of each Python (0.19.2 for 3.12, 0.16.1 for 3.11); every other
# test runs on every full line.
# With MEGATRON_CORE set, only that line runs, with the pytest arguments given (e.g.
# MEGATRON_CORE=0.18.2 ./scripts/test.sh -q tests/test_demo.py).
# --quick: the inner loop (at most 5 minutes on 2 cores): lint, then on the default line the
# activation, settings, line and architecture checks and one patched Megatron training run per
# plugin (the composition matrix; QUICK_TESTS below), then every test marked line_independent.
# The SGLang legs: the tests marked ``sglang`` (CPU SGLang engines started from the SGLang venv of
# 0.5.23 and of 0.5.15.post1, scripts/sglang_env.sh; the trainer side in the default line's venv)
# run once per release, after the lines. While the first leg's tests run, the later legs' venvs
# get their pinned packages in the background (prepare_later_venvs below). Each leg ends with its
# 25 slowest tests; the run closes with each leg's pytest and wall time and one summed line.
set -euo pipefail
cd "$(dirname "$0")/.."
FULL_LINES=${FULL_LINES:-0.19.2 0.16.1}
SOME_LINES=${SOME_LINES:-0.17.1 0.18.2}
SOME_TESTS=(
  tests/test_megatron_lines.py
  tests/test_compose_matrix.py
  tests/test_demo.py::test_default_demo_writes_a_strict_json_report_with_every_plugins_work
  # MLA trains on CPU on every served line (the core attention and the Kimi-shaped model)
  tests/test_harness_mla.py::test_the_mla_core_attention_computes_the_attention_formula
  tests/test_harness_mla.py::test_the_kimi_shaped_model_trains_on_cpu
)

QUICK_TESTS=(
  tests/test_core_activation.py
  tests/test_core_switches.py
  tests/test_core_settings_values.py
  tests/test_core_strict.py
  tests/test_architecture_rules.py
  tests/test_line_guard.py
  tests/test_megatron_lines.py
  tests/test_compose_matrix.py
)

if [ "${1:-}" = --quick ]; then
  shift
  . scripts/megatron_line.sh
  ./scripts/bootstrap.sh
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  "$VENV/bin/python" -m pytest --durations=10 "$@" "${QUICK_TESTS[@]}"
  # and every plugin's and the core's unit tests that need no megatron (seconds each)
  exec "$VENV/bin/python" -m pytest --durations=10 -m "line_independent and not sglang" "$@"
fi

if [ -n "${MEGATRON_CORE:-}" ]; then
  . scripts/megatron_line.sh
  ./scripts/bootstrap.sh
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  exec "$VENV/bin/python" -m pytest "$@"
fi

results=$(mktemp -d)
prepare_pid=
# (the preparation has usually ended by then: a failing kill must not become the run's status)
trap '[ -z "$prepare_pid" ] || kill "$prepare_pid" 2>/dev/null || true; rm -rf "$results"' EXIT
# The later legs' venvs get their pinned packages (torch and its libraries: ~3 min a venv on 2
# cores, ~15 min in all) at the lowest priority while the first leg's tests run; each leg waits
# for its own venv's preparation, then bootstraps in the foreground (the editable installs, and
# anything the preparation failed to do, with its error shown there).
prepare_later_venvs() {
  local line release
  set -- $FULL_LINES $SOME_LINES
  shift # the first leg's venv is bootstrapped before this starts
  for line in "$@"; do
    MEGATRON_CORE=$line BOOTSTRAP_DEPS_ONLY=1 nice -n 19 ./scripts/bootstrap.sh || true
    touch "$results/prepared-$line"
  done
  if [ "${SGLANG_LEG:-1}" = 1 ]; then
    for release in $SGLANG_RELEASES; do
      SGLANG_VENV= SGLANG_RELEASE=$release SGLANG_DEPS_ONLY=1 nice -n 19 ./scripts/sglang_env.sh || true
      touch "$results/prepared-sglang-$release"
    done
  fi
}
wait_prepared() { # NAME: until the background preparation has done that venv, or has ended
  while [ ! -e "$results/prepared-$1" ] && kill -0 "$prepare_pid" 2>/dev/null; do sleep 2; done
}
SGLANG_RELEASES="0.5.23 0.5.15.post1" # 0.5.23 and slime's pin (weight_sync's engine side has a record for each)
status=0
first=1
pythons_run= # the Pythons whose line_independent tests have run
for line in $FULL_LINES $SOME_LINES; do
  leg_start=$SECONDS
  [ "$first" = 1 ] || wait_prepared "$line"
  MEGATRON_CORE=$line ./scripts/bootstrap.sh
  venv=$(MEGATRON_CORE=$line bash -c '. scripts/megatron_line.sh; echo "$VENV"')
  if [ "$first" = 1 ]; then
    # after the first venv's bootstrap, which installs the system libraries the venvs share
    prepare_later_venvs >"$results/prepare.log" 2>&1 &
    prepare_pid=$!
    # lint once: the same sources and the same pinned ruff on every line
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    first=0
  fi
  # a full line runs every test, less the line_independent ones where an earlier full line
  # ran them with the same Python (they cannot fail differently there)
  python=$(MEGATRON_CORE=$line bash -c '. scripts/megatron_line.sh; echo "$LINE_PYTHON"')
  case " $FULL_LINES " in
    *" $line "*)
      case " $pythons_run " in
        *" $python "*) tests=(-m "not sglang and not line_independent" "$@") ;;
        *) tests=(-m "not sglang" "$@") ;;
      esac
      pythons_run="$pythons_run $python"
      ;;
    *) tests=("$@" "${SOME_TESTS[@]}") ;;
  esac
  echo "== megatron-core $line ($venv): pytest ${tests[*]:-(the whole suite)}" >&2
  # MEGATRON_CORE tells what the tests start (scripts/demo.sh) which line this leg is.
  MEGATRON_CORE=$line "$venv/bin/python" -m pytest --durations=25 --junitxml="$results/$line.xml" "${tests[@]}" || status=$?
  echo "$line $((SECONDS - leg_start))" >>"$results/walls"
done
if [ "${SGLANG_LEG:-1}" = 1 ]; then
  venv=$(bash -c '. scripts/megatron_line.sh; echo "$VENV"')
  for release in $SGLANG_RELEASES; do
    leg_start=$SECONDS
    wait_prepared "sglang-$release"
    # each release's own venv (a SGLANG_VENV from the caller would hold one release only)
    if ! SGLANG_VENV= SGLANG_RELEASE=$release ./scripts/sglang_env.sh; then
      status=1
      continue
    fi
    sglang_venv=$(SGLANG_VENV= SGLANG_RELEASE=$release bash -c '. scripts/sglang_release.sh; echo "$SGLANG_VENV"')
    echo "== SGLang $release ($sglang_venv) with megatron-core $(bash -c '. scripts/megatron_line.sh; echo "$MEGATRON_CORE"') trainers: pytest -m sglang" >&2
    # absolute: the benchmark test runs its script from benchmarks/
    TITAN_SGLANG_PYTHON=$(cd "$sglang_venv" && pwd)/bin/python "$venv/bin/python" -m pytest \
      --durations=25 --junitxml="$results/sglang-$release.xml" -m sglang "$@" || status=$?
    echo "sglang-$release $((SECONDS - leg_start))" >>"$results/walls"
  done
fi
# One closing line for the whole run, summed over every line's pytest.
# Each leg's pytest and wall time (its venv's wait and bootstrap included) and the whole run's
# wall time: all legs together must stay under 40 minutes on CI's 2 cores.
python3 - "$results" "$SECONDS" <<'PY'
import pathlib, sys, xml.etree.ElementTree as ET
total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
pytest_s = 0.0
walls_file = pathlib.Path(sys.argv[1]) / "walls"
walls = dict(line.split() for line in walls_file.read_text().splitlines()) if walls_file.exists() else {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in total:
            total[key] += int(suite.get(key, 0))
        name = path.stem
        leg = f"SGLang {name[7:]}" if name.startswith("sglang-") else f"megatron-core {name}"
        seconds = float(suite.get("time", 0))
        pytest_s += seconds
        wall = f", {walls[name]} s wall" if name in walls else ""
        print(f"{leg}: {suite.get('tests')} tests, {suite.get('failures')} failed, "
              f"{suite.get('errors')} errors, {suite.get('skipped')} skipped in {seconds:.0f} s{wall}")
failed = total["failures"] + total["errors"]
passed = total["tests"] - failed - total["skipped"]
print(f"total: {passed} passed, {failed} failed, {total['skipped']} skipped; "
      f"{sys.argv[2]} s wall, {pytest_s:.0f} s in pytest, the rest venv set-up and lint")
PY
exit "$status"
