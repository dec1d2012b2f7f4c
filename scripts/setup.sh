#!/usr/bin/env bash
# Creates .venv (once) and installs the CPU stack: the pinned local torch wheel first, then requirements.txt.
# Sizes measured on Linux x86_64, Python 3.11 (2026-12): torch 2.13.0+cpu is a 192 MB wheel, 0.75 GB installed;
# requirements.txt adds ~70 packages, 0.9 GB installed (1.6 GB for .venv in all). Measured on 2 cores with a warm
# pip cache: 1m27s; downloading the wheels adds their transfer time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version 2>&1) ($PY)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.packsft-installed
if [ ! -f "$stamp" ] || [ requirements.txt -nt "$stamp" ]; then
  start=$SECONDS
  echo "[setup] upgrading pip"
  python -m pip install -q --upgrade pip
  # An unpinned torch would pull GBs of CUDA wheels; 2.13.0 resolves to the local CPU wheel.
  echo "[setup] installing torch ${TORCH_VERSION:-2.13.0} (CPU build: a ~190 MB wheel, ~0.75 GB installed)..."
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  echo "[setup] installing requirements.txt (transformers, accelerate, deepspeed, pyarrow, pandas, pytest, ...:" \
       "~70 packages, ~0.9 GB installed)..."
  python -m pip install -q -r requirements.txt
  touch "$stamp"
  echo "[setup] .venv ready ($(du -sh .venv 2>/dev/null | cut -f1), $((SECONDS - start)) s)"
fi
