#!/usr/bin/env bash
# Sets up the environments (idempotent) and runs the test suite. Extra arguments go to pytest.
# Without arguments, three stages:
#   1. in .venv (CPU torch), everything but the image tests and the `serial` ones, over several pytest workers
#      (pytest-xdist; PACKSFT_TEST_WORKERS, default: the CPUs, at most 4; 1 runs them in one process);
#   2. in .venv, the `serial` tests alone, one at a time (they time what they run, send signals, or start
#      machine-wide services such as a Ray cluster: other tests beside them would make them fail);
#   3. the image tests (`-m vision`: the real Qwen2-VL processors need torchvision, which loads only with PyPI's
#      torch build) in .venv-vision (scripts/setup_vision.sh). PACKSFT_VISION_TESTS=0 skips this stage (and its
#      ~3 GB install) for text-only work.
# With arguments: one pytest process in .venv over what they select (then stage 3 over them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
if [ "$#" -eq 0 ]; then
  cpus=$(nproc 2>/dev/null || echo 2)
  workers=${PACKSFT_TEST_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}
  if [ "$workers" -gt 1 ]; then
    # loadscope: a module's (or class's) tests share one worker, so module fixtures run once
    .venv/bin/python -m pytest -q -rs -m "not vision and not serial" -n "$workers" --dist loadscope
    .venv/bin/python -m pytest -q -rs -m "serial and not vision"
  else
    .venv/bin/python -m pytest -q -rs -m "not vision"
  fi
else
  .venv/bin/python -m pytest -q -rs -m "not vision" "$@"
fi
if [ "${PACKSFT_VISION_TESTS:-1}" != "0" ]; then
  bash scripts/setup_vision.sh
  # no arguments: only the files that hold image tests (the others would be collected for nothing, and the
  # optional engines' modules skip at import where they are not installed)
  if [ "$#" -eq 0 ]; then set -- $(grep -l "mark.vision" tests/*/test_*.py); fi
  status=0
  .venv-vision/bin/python -m pytest -q -rs -m vision "$@" || status=$?
  # 5: no image test among the ones asked for (e.g. `scripts/test.sh tests/shards/test_row_plan.py`)
  if [ "$status" != "0" ] && [ "$status" != "5" ]; then exit "$status"; fi
fi
