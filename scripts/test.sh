#!/usr/bin/env bash
# Sets up the environments (idempotent) and runs the test suite, stage by stage. Extra arguments go to pytest.
#
#   bash scripts/test.sh                 every stage (~20 min on 2 idle cores: main 15, serial 3, images 2)
#   bash scripts/test.sh --quick         the fast unit tests only (no slow, multi-process, serial or image tests,
#                                        nor the longest files: QUICK_SKIP_FILES): a few minutes on 2 idle cores
#   bash scripts/test.sh tests/train/test_row.py one pytest process in .venv over what the arguments select, then the image
#                                        tests among them in .venv-vision
#
# Without arguments, three stages:
#   main    in .venv (CPU torch), everything but the image tests and the `serial` ones, over several pytest workers
#           (pytest-xdist; PACKSFT_TEST_WORKERS, default: the CPUs, at most 4; 1 runs them in one process, serial
#           tests included);
#   serial  in .venv, the `serial` tests alone, one at a time (they time what they run, send signals, or start
#           machine-wide services such as a Ray cluster: other tests beside them would make them fail);
#   vision  the image, video and audio tests (`-m vision`: the real Qwen2-VL processors need torchvision, which loads
#           only with PyPI's torch build; PyAV, soundfile) in .venv-vision (scripts/setup_vision.sh, ~6 GB; the video
#           and audio files alone took 83 s on 2 cores, 2026-12-02). PACKSFT_VISION_TESTS=0 skips this stage
#           for text-only work (under CI=true a stage that does not run is a failure: CI runs them all).
# Every stage runs even when an earlier one fails; each prints its name before it starts and its counts and wall
# time when it ends (after its slowest tests: pytest --durations, so a log shows where the time went), a table of all
# stages closes the run, and the exit status is 1 if any stage failed.
# PACKSFT_SETUP=0 skips scripts/setup*.sh (the environments exist already).
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
QUICK_MARKS="not slow and not multiprocess and not serial and not vision and not gpu"
# --quick also leaves out these files (by name, wherever they sit under tests/): the longest of the suite by
# measurement (each test's duration on 2 cores, 2026-12-01): together ~90% of the time of the tests the markers keep
QUICK_SKIP_FILES=(test_families test_lm_head test_sequence_parallel test_tiled_mlp test_recurrent
                  test_recurrent_kernels test_tokenize test_merge test_function_features test_loss
                  test_pack_partitions test_self_check test_fidelity test_token_bound test_sample test_families_startup)

ci=0
case "${CI:-}" in ""|0|false|False|FALSE|no) ;; *) ci=1 ;; esac
logdir=$(mktemp -d "${TMPDIR:-/tmp}/packsft-test.XXXXXX")
trap 'rm -rf "$logdir"' EXIT
names=() results=() counts=() times=()
failed=0 ran_tests=0

fmt_time() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# record NAME RESULT COUNTS SECONDS
record() {
  names+=("$1") results+=("$2") counts+=("$3") times+=("$4")
  case "$2" in FAILED*) failed=1 ;; esac
}

# not_run NAME WHY: a stage that did not run (a failure under CI)
not_run() {
  if [ "$ci" = 1 ]; then
    echo "==> stage $1: FAILED: did not run ($2); CI runs every stage" >&2
    record "$1" "FAILED: did not run ($2)" "" 0
  else
    echo "==> stage $1: skipped: $2"
    record "$1" "skipped: $2" "" 0
  fi
}

# run_stage NAME WHAT PYTHON PYTEST_ARGS...: runs pytest, prints and records the counts of its summary line
run_stage() {
  local name=$1 what=$2 python=$3
  shift 3
  local log="$logdir/$name.log" start=$SECONDS status summary
  echo
  echo "==> stage $name: $what"
  echo "    $python -m pytest$(printf ' %q' "$@")"
  "$python" -m pytest "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  # pytest's last line: "3 passed, 1 skipped, 2 warnings in 4.56s" (-q) or "=== 3 passed ... in 4.56s ==="
  summary=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)|no tests ran' "$log" \
            | tail -n 1 | sed -E 's/^=+ //; s/ =+$//; s/, [0-9]+ warnings?//; s/ in [0-9.]+s( \([0-9:]+\))?$//')
  local result
  case "$status" in
    0) result="ok" ; ran_tests=1 ;;
    5) result="no tests selected" ;;
    *) result="FAILED (pytest exit $status)" ;;
  esac
  echo "==> stage $name: $result${summary:+: $summary} ($(fmt_time $took))"
  record "$name" "$result" "$summary" "$took"
}

# setup NAME SCRIPT: runs a setup script, printing its name and time; 1 if it failed
setup() {
  [ "${PACKSFT_SETUP:-1}" = "0" ] && return 0
  local start=$SECONDS
  echo "==> setup: bash $2"
  if bash "$2"; then
    echo "==> setup: $2 done ($(fmt_time $((SECONDS - start))))"
    return 0
  fi
  echo "==> setup: bash $2 FAILED ($(fmt_time $((SECONDS - start))))" >&2
  record "$1" "FAILED: bash $2 failed (see above)" "" $((SECONDS - start))
  return 1
}

export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
if ! setup setup scripts/setup.sh; then
  echo "scripts/setup.sh failed: no stage can run" >&2
  exit 1
fi

cpus=$(nproc 2>/dev/null || echo 2)
workers=${PACKSFT_TEST_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}
parallel=()
# loadscope: a module's (or class's) tests share one worker, so module fixtures run once
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadscope); fi

if [ "$quick" = 1 ]; then
  skip_files=()
  for name in "${QUICK_SKIP_FILES[@]}"; do skip_files+=("--ignore-glob=/*/$name.py"); done
  run_stage quick "fast unit tests in .venv (-m \"$QUICK_MARKS\", without ${QUICK_SKIP_FILES[*]})" .venv/bin/python \
    -q -rs -m "$QUICK_MARKS" "${skip_files[@]}" "${parallel[@]}" "$@"
  echo "==> stage vision: skipped: --quick leaves out the image tests"
  record vision "skipped: --quick leaves out the image tests" "" 0
elif [ "$#" -eq 0 ]; then
  if [ "$workers" -gt 1 ]; then
    run_stage main "everything but the serial and image tests, $workers workers, in .venv" .venv/bin/python \
      -q -rs -m "not vision and not serial" --durations=25 "${parallel[@]}"
    run_stage serial "the serial tests, one at a time, in .venv" .venv/bin/python -q -rs -m "serial and not vision" \
      --durations=10
  else
    run_stage main "everything but the image tests, one process, in .venv" .venv/bin/python -q -rs -m "not vision"
  fi
else
  run_stage selected "what the arguments select, in .venv" .venv/bin/python -q -rs -m "not vision" "$@"
fi

if [ "$quick" = 0 ]; then
  if [ "${PACKSFT_VISION_TESTS:-1}" = "0" ]; then
    not_run vision "PACKSFT_VISION_TESTS=0"
  elif setup vision scripts/setup_vision.sh; then
    # no arguments: only the files that hold image tests (the others would be collected for nothing, and the
    # optional engines' modules skip at import where they are not installed)
    if [ "$#" -eq 0 ]; then
      mapfile -t files < <(grep -rl "mark.vision" tests --include='test_*.py' | sort)
      set -- "${files[@]}"
    fi
    if [ ! -x .venv-vision/bin/python ]; then
      not_run vision ".venv-vision does not exist: bash scripts/setup_vision.sh"
    else
      run_stage vision "the image tests, in .venv-vision" .venv-vision/bin/python -q -rs -m vision --durations=5 "$@"
    fi
  fi
fi

echo
echo "==> summary"
for i in "${!names[@]}"; do
  printf '  %-9s %-58s %s\n' "${names[$i]}" "${results[$i]}${counts[$i]:+: ${counts[$i]}}" \
    "$(fmt_time "${times[$i]}")"
done
if [ "$failed" = 1 ]; then
  echo "==> FAILED: a stage failed (above)" >&2
  exit 1
fi
if [ "$ran_tests" = 0 ]; then
  echo "==> FAILED: no test ran (the arguments select none)" >&2
  exit 1
fi
echo "==> all stages passed"
