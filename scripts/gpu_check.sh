#!/usr/bin/env bash
# The GPU check in one unattended command (benchmarks/gpu_check.py says what it runs): installs the wheels that
# benchmarks/gpu_wheels.sh put in .whl/ (the GPU machine has no internet) into a private target directory, then runs
# every gpu test and the trainer benchmarks within a time budget, writing gpu_check.{json,md,log}, gpu_tests.log and
# profile.txt into OUT. Without CUDA it is the CPU check: the tests phase runs (every gpu test skips), the rest skip.
#   bash scripts/gpu_check.sh OUT [--budget SECONDS] [...]
#   bash scripts/gpu_check.sh OUT2 --second        the second 10-minute command: stepwise trees, the MoE shape
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT [gpu_check options]}
shift
PY=${PYTHON:-python3}
mkdir -p "$out"
# The wheels are cp312 builds for the GPU machine's image; elsewhere the project's own environment has everything.
if compgen -G ".whl/*.whl" >/dev/null && "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  site=${GPU_CHECK_SITE:-/tmp/packsft_gpu_site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    2>&1 | tee -a "$out/gpu_check.log"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check --out "$out" "$@"
