#!/usr/bin/env bash
# Sets up the environment (idempotent) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec python -m pytest -q -rs "$@"
