"""The data pipeline: `sh data_process.sh` / `python -m data.pipeline`, `python -m data.<stage>`."""
from common.environment import require_when_run

require_when_run("data")  # `python -m data…` without the project's requirements: how to set them up, no traceback
