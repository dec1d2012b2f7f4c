"""benchmarks/gpu_check.py and scripts/gpu_check.sh: the unattended GPU check, run on the CPU (GPU steps skipped),
and every phase of it in --smoke mode (the example data and tiny model on the CPU, TRL's SFTTrainer included)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_check import TEST_LINE, XDIST_LINE, gpu_test_files
from tests._train_helpers import ROOT


def _run_check(out, *args, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--work", str(out.parent / "work"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def test_gpu_test_files_are_every_file_with_a_gpu_mark_heavy_last():
    files = gpu_test_files(ROOT / "tests")
    marked = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    assert sorted(files) == marked and "tests/test_varlen_kernels.py" in files
    assert files[-2:] == ["tests/test_attention_backends.py", "tests/test_step_options.py"]


def test_pytest_lines_of_both_formats_are_read():
    plain = "tests/test_a.py::test_b[x-1] PASSED                 [ 12%]"
    xdist = "[gw3] [ 55%] FAILED tests/test_a.py::test_c[flex-window-sinks] "
    assert TEST_LINE.match(plain).groups() == ("tests/test_a.py::test_b[x-1]", "PASSED")
    assert XDIST_LINE.match(xdist).groups() == ("FAILED", "tests/test_a.py::test_c[flex-window-sinks]")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the check")
def test_cpu_check_runs_the_gpu_tests_and_skips_the_gpu_phases(tmp_path):
    report = _run_check(tmp_path / "out", "--budget", "300")
    tests = report["phases"]["tests"]
    assert tests["counts"].get("SKIPPED", 0) >= 30 and not tests["failed"], tests["counts"]
    assert set(tests["counts"]) == {"SKIPPED"}  # without CUDA every gpu test skips, none errors at collection
    for phase in ("train_32k_small", "train_32k_large", "trl", "train_128k", "profile"):
        assert report["phases"][phase] == {"skipped": "no CUDA"}
    assert report["versions"]["torch"] and (tmp_path / "out" / "gpu_tests.log").exists()


@pytest.mark.slow
def test_smoke_check_runs_every_phase_on_the_cpu(tmp_path):
    """--smoke: the trainer benchmark, TRL's SFTTrainer on the same rows, the profile: what the GPU run does."""
    out = tmp_path / "out"
    report = _run_check(out, "--smoke", "--steps", "3", "--budget", "540")
    phases = report["phases"]
    rows = {r["backend"]: r for r in phases["train_32k_small"]["report"]["results"]}
    assert rows["sdpa"]["tokens_per_s"] > 0 and len(rows["sdpa"]["first_losses"]) == 3
    assert "CUDA" in rows["torch_varlen"]["skipped"]
    trl = {r["attn"]: r for r in phases["trl"]["report"]["results"]}
    assert trl["sdpa"]["tokens_per_s"] > 0 and all(math.isfinite(x) for x in trl["sdpa"]["first_losses"])
    assert trl["sdpa"]["trl"] and trl["sdpa"]["sequences_per_row"] > 1
    # the same rows: TRL's first loss on the same random init is near PackSFT's (both ~ln(vocab) at init)
    assert abs(trl["sdpa"]["first_losses"][0] - rows["sdpa"]["first_losses"][0]) < 0.5
    assert phases["profile"]["target"] == {"shape": "example-tiny", "row_length": 2048, "backend": "sdpa"}
    assert "one step" in (out / "profile.txt").read_text()
    assert "TRL SFTTrainer" in (out / "gpu_check.md").read_text()
