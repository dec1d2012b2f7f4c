#!/usr/bin/env bash
# Sets up the environment (idempotent), packs the embedded example and trains a tiny model on it (CPU).
# Arguments go to `sh train.sh` (e.g. overwrite_output_dir=true to start the training over, resume=latest).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
echo "[quickstart] 1/3 setup: .venv (bash scripts/setup.sh)"
bash scripts/setup.sh
. .venv/bin/activate
echo "[quickstart] 2/3 packing the example: sh data_process.sh ($((SECONDS - start)) s so far)"
sh data_process.sh
echo "[quickstart] 3/3 training: sh train.sh $* ($((SECONDS - start)) s so far)"
sh train.sh "$@"
echo "[quickstart] done in $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s"
