#!/bin/sh
# Training: sh train.sh [config.yaml] [key=value ...]   (default config: configs/train/example.yaml)
# sh train.sh --help lists every config key with its type, default and meaning.
# Launches `python -m train` through `accelerate launch` with the processes / machines of the config's `launch`
# section (several machines: run it on every machine with launch.machine_rank=<i>, or scripts/slurm/train.sbatch;
# docs/TRAINING.md §3).
set -e
ROOT="$(cd "$(dirname "$0")" && pwd)"
# PACKSFT_VENV=.venv-vision for image conversations (torchvision + Pillow: scripts/setup_vision.sh)
VENV="${PACKSFT_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
if [ -f "$VENV/bin/activate" ]; then
    . "$VENV/bin/activate"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
CONFIG="configs/train/example.yaml"
if [ $# -gt 0 ]; then
    case "$1" in
        -h|--help) exec python -m train --help ;;  # every key with its type, default and help
        *=*) ;;
        *) CONFIG="$1"; shift ;;
    esac
fi
# checks the config, takes the output directory's lock and runs `accelerate launch … -m train CONFIG …` in a process
# group of its own, to which it forwards SIGTERM / SIGINT / SIGHUP (train/launch.py)
exec python -m train --launch "$CONFIG" "$@"
