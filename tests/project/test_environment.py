"""A fresh clone run without its environment (no .venv, a Python without the requirements): `sh train.sh`,
`sh data_process.sh` and `python -m train.chat` each say to run `bash scripts/setup.sh` (or activate .venv), exit
2, no traceback. Before: "log_backends: tensorboard is not installed" and two tracebacks."""
from __future__ import annotations

import os
import subprocess
import sys
import venv

import pytest

from tests._train_helpers import ROOT


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A virtual environment with nothing installed (no pip either): what a fresh machine's python3 offers."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    return where / "bin"


@pytest.mark.parametrize("command", [["sh", "train.sh"], ["sh", "data_process.sh"],
                                     ["python", "-m", "train.chat", "outputs/example/train/final"]],
                         ids=["train.sh", "data_process.sh", "train.chat"])
def test_without_the_requirements_each_command_says_how_to_set_them_up(bare_python, command):
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{bare_python}{os.pathsep}{env.get('PATH', '')}", PACKSFT_VENV=str(bare_python.parent / "none"))
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: PackSFT's requirements are not installed in this Python "
                                  f"({bare_python / 'python'}): "), proc.stderr
    assert "Run `bash scripts/setup.sh` (it creates .venv, which sh train.sh and sh data_process.sh use)" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "torch" in proc.stderr.split(" are missing")[0] or command[1] == "data_process.sh"


def test_a_python_with_the_requirements_is_not_stopped():
    proc = subprocess.run([sys.executable, "-m", "train.chat", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "usage: python -m train.chat" in proc.stdout, proc.stderr
