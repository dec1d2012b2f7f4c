"""The trainer: `sh train.sh` / `python -m train`, `python -m train.chat`."""
from common.environment import require_when_run

require_when_run("train")  # `python -m train…` without the project's requirements: how to set them up, no traceback
