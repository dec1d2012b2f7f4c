#!/usr/bin/env bash
# Creates .venv-vision (once): PyPI's default torch build with torchvision, then requirements.txt and
# requirements-vision.txt. Text users never need it; image, video and audio conversations do (see
# requirements-vision.txt). Sizes measured on Linux x86_64, Python 3.11 (2026-12): 6.1 GB installed in all, of which
# torch's CUDA build 1.2 GB, its nvidia-* libraries 3.2 GB and triton 0.9 GB (PyPI's torchvision loads only next to
# that build; it runs on CPU too), requirements.txt 0.9 GB, PyAV and soundfile (video and audio decoding) 0.11 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-vision/bin/python ]; then
  echo "[setup_vision] creating .venv-vision with $("$PY" --version 2>&1) ($PY)"
  "$PY" -m venv .venv-vision
fi
. .venv-vision/bin/activate
stamp=.venv-vision/.packsft-installed
if [ ! -f "$stamp" ] || [ requirements.txt -nt "$stamp" ] || [ requirements-vision.txt -nt "$stamp" ]; then
  start=$SECONDS
  echo "[setup_vision] upgrading pip"
  python -m pip install -q --upgrade pip
  # the CPU-only torch wheel cannot load torchvision; this pair is PyPI's CUDA build, which also runs on CPU
  echo "[setup_vision] installing torch ${VISION_TORCH_VERSION:-2.14.1} + torchvision ${TORCHVISION_VERSION:-0.29.1}" \
       "(PyPI's CUDA build with its nvidia-* and triton wheels: ~5.3 GB installed)..."
  python -m pip install -q "torch==${VISION_TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}"
  echo "[setup_vision] installing requirements.txt + requirements-vision.txt (~0.9 GB installed)..."
  python -m pip install -q -r requirements.txt -r requirements-vision.txt
  touch "$stamp"
  echo "[setup_vision] .venv-vision ready ($(du -sh .venv-vision 2>/dev/null | cut -f1), $((SECONDS - start)) s)"
fi
