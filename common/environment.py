"""Are PackSFT's requirements installed in this Python? Checked (standard library only, nothing imported) when a
program of the project starts, so that a fresh clone run without its environment says how to set it up instead of
failing on the first import with a traceback (or on a later check that names one optional package).

`train/__init__.py` and `data/__init__.py` call `require_when_run(package)` while Python looks up a `-m` module of
theirs (`python -m train`, `python -m train.chat`, `python -m data.pipeline`, ...: sys.argv[0] is then "-m"); an
import from other code is never stopped.
"""
from __future__ import annotations

import importlib.util
import sys

# the modules each package's programs import (module name: pip name), from requirements.txt; optional ones
# (tensorboard, wandb, Ray, torchvision, flash-attn) are checked by the feature that needs them
REQUIRED = {
    "data": {"numpy": "numpy", "orjson": "orjson", "pyarrow": "pyarrow", "tokenizers": "tokenizers",
             "transformers": "transformers", "tqdm": "tqdm", "matplotlib": "matplotlib"},
    "train": {"torch": "torch", "numpy": "numpy", "orjson": "orjson", "yaml": "pyyaml",
              "transformers": "transformers", "accelerate": "accelerate", "deepspeed": "deepspeed", "peft": "peft",
              "safetensors": "safetensors", "psutil": "psutil", "tqdm": "tqdm", "matplotlib": "matplotlib"},
}
EXIT_STATUS = 2  # as a config error: nothing ran


def missing_packages(package: str) -> list[str]:
    """The pip names of the required modules of `package` ("data" or "train") this Python cannot import."""
    return [pip for module, pip in REQUIRED[package].items() if importlib.util.find_spec(module) is None]


def setup_message(missing: list[str]) -> str:
    return (f"error: PackSFT's requirements are not installed in this Python ({sys.executable}): "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing. Run `bash scripts/setup.sh` (it "
            "creates .venv, which sh train.sh and sh data_process.sh use), then `. .venv/bin/activate` for python "
            "-m commands; or activate the environment where you installed them (pip install torch==2.13.0, then "
            "pip install -r requirements.txt)")


def require_when_run(package: str) -> None:
    """Exit with the set-up message when a `python -m` program of `package` starts without its requirements."""
    if sys.argv[:1] != ["-m"]:
        return
    missing = missing_packages(package)
    if missing:
        print(setup_message(missing), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STATUS)
