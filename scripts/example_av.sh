#!/usr/bin/env bash
# Video and audio conversations in one command: writes the Qwen2.5-Omni processor directory (once, offline:
# python -m data.processors), then packs configs/data/example_av.json (the video / audio demo records of
# ../shared/fixtures/multimodal/) in .venv-vision (bash scripts/setup_vision.sh builds it: torchvision, PyAV,
# soundfile). Arguments go to `sh data_process.sh` (e.g. --stages tokenize,pack, or key=value overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
PROCESSOR=outputs/processors/qwen2_5_omni
if [ ! -x .venv-vision/bin/python ]; then
  echo "[example_av] .venv-vision is missing: run bash scripts/setup_vision.sh first" >&2
  exit 2
fi
if [ ! -f "$PROCESSOR/preprocessor_config.json" ]; then
  echo "[example_av] writing the Qwen2.5-Omni processor to $PROCESSOR (python -m data.processors)"
  PYTHONPATH=. .venv-vision/bin/python -m data.processors qwen2_5_omni "$PROCESSOR"
fi
PACKSFT_VENV=.venv-vision sh data_process.sh configs/data/example_av.json "$@"
