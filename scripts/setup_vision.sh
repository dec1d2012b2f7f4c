#!/usr/bin/env bash
# Creates .venv-vision (once): PyPI's default torch build with torchvision, then requirements.txt and
# requirements-vision.txt. Text users never need it; image conversations do (see requirements-vision.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-vision/bin/python ]; then
  "$PY" -m venv .venv-vision
fi
. .venv-vision/bin/activate
stamp=.venv-vision/.packsft-installed
if [ ! -f "$stamp" ] || [ requirements.txt -nt "$stamp" ] || [ requirements-vision.txt -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # the CPU-only torch wheel cannot load torchvision; this pair is PyPI's CUDA build, which also runs on CPU
  python -m pip install -q "torch==${VISION_TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}"
  python -m pip install -q -r requirements.txt -r requirements-vision.txt
  touch "$stamp"
fi
