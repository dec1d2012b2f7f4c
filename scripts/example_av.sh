#!/usr/bin/env bash
# Video and audio conversations in one command: sets up .venv-vision (idempotent: torchvision, Pillow, PyAV,
# soundfile; bash scripts/setup_vision.sh), writes the Qwen2.5-Omni processor directory (once, offline: python -m
# data.processors), packs configs/data/example_av.json (the video / audio demo records of ../shared/fixtures/
# multimodal/) and trains a tiny random-init Qwen2.5-Omni thinker on them (configs/train/example_av.yaml, CPU).
# Arguments go to `sh train.sh` (e.g. overwrite_output_dir=true to start the training over).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PROCESSOR=outputs/processors/qwen2_5_omni
echo "[example_av] 1/4 setup: .venv-vision (bash scripts/setup_vision.sh)"
bash scripts/setup_vision.sh
if [ ! -f "$PROCESSOR/preprocessor_config.json" ]; then
  echo "[example_av] 2/4 writing the Qwen2.5-Omni processor to $PROCESSOR (python -m data.processors)"
  PYTHONPATH=. .venv-vision/bin/python -m data.processors qwen2_5_omni "$PROCESSOR"
else
  echo "[example_av] 2/4 the Qwen2.5-Omni processor is in $PROCESSOR"
fi
echo "[example_av] 3/4 packing: sh data_process.sh configs/data/example_av.json ($((SECONDS - start)) s so far)"
PACKSFT_VENV=.venv-vision sh data_process.sh configs/data/example_av.json
echo "[example_av] 4/4 training: sh train.sh configs/train/example_av.yaml $* ($((SECONDS - start)) s so far)"
PACKSFT_VENV=.venv-vision sh train.sh configs/train/example_av.yaml "$@"
echo "[example_av] done in $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s"
