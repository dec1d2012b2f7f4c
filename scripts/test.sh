#!/usr/bin/env bash
# Sets up the environments (idempotent) and runs the test suite. Extra arguments go to pytest.
# Two stages: everything but the image tests in .venv (CPU torch); the image tests (`-m vision`: the real Qwen2-VL
# processors need torchvision, which loads only with PyPI's torch build) in .venv-vision (scripts/setup_vision.sh).
# PACKSFT_VISION_TESTS=0 skips the second stage (and its ~3 GB install) for text-only work.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
.venv/bin/python -m pytest -q -rs -m "not vision" "$@"
if [ "${PACKSFT_VISION_TESTS:-1}" != "0" ]; then
  bash scripts/setup_vision.sh
  # no arguments: only the files that hold image tests (the others would be collected for nothing, and the
  # optional engines' modules skip at import where they are not installed)
  if [ "$#" -eq 0 ]; then set -- $(grep -l "mark.vision" tests/test_*.py); fi
  status=0
  .venv-vision/bin/python -m pytest -q -rs -m vision "$@" || status=$?
  # 5: no image test among the ones asked for (e.g. `scripts/test.sh tests/test_pack_plan.py`)
  if [ "$status" != "0" ] && [ "$status" != "5" ]; then exit "$status"; fi
fi
