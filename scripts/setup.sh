#!/usr/bin/env bash
# Creates .venv (once) and installs the CPU stack: the pinned local torch wheel first, then requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.packsft-installed
if [ ! -f "$stamp" ] || [ requirements.txt -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # An unpinned torch would pull GBs of CUDA wheels; 2.13.0 resolves to the local CPU wheel.
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  python -m pip install -q -r requirements.txt
  touch "$stamp"
fi
