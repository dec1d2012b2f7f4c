#!/usr/bin/env bash
# Sets up the environment (idempotent), packs the embedded example and trains a tiny model on it (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
sh data_process.sh
sh train.sh "$@"
