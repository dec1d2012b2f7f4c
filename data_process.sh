#!/bin/sh
# Data pipeline: raw conversations -> canonical -> sampled -> merged -> tokenized -> packed.
# Usage: sh data_process.sh [config.json] [--stages tokenize,pack] [key=value ...]
# (default config: configs/data/example.json). The last line printed names the packed output directory.
# Paths in the config and arguments are relative to the current directory.
set -e
ROOT="$(cd "$(dirname "$0")" && pwd)"
# PACKSFT_VENV=.venv-vision for image conversations (torchvision + Pillow: scripts/setup_vision.sh)
VENV="${PACKSFT_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
if [ -f "$VENV/bin/activate" ]; then
    . "$VENV/bin/activate"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec python -m data.pipeline "$@"
