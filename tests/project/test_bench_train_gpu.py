"""benchmarks/bench_train_gpu.py: the FLOP count, and the smoke mode end to end on CPU (real trainer, example data)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.bench_train_gpu import step_flops
from tests._train_helpers import ROOT
from train.plan.memory import ModelShape


def test_step_flops_formula():
    shape = ModelShape(hidden=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    # matmul params per layer: q 8x8 + k,v 8x4 each + o 8x8 + biases (8 + 4 + 4) + MLP 3*8*16 + norms 2*8; + head 80
    layer = 64 + 32 + 32 + 64 + 16 + 384 + 16
    assert shape.matmul_params == 2 * layer + 80
    seq_lens = [3, 5]
    expected = 6 * (2 * layer + 80) * 8 + 6 * 2 * 2 * 4 * (9 + 25)
    assert step_flops(shape, seq_lens) == expected


@pytest.mark.slow
def test_smoke_mode_runs_the_real_trainer(tmp_path):
    out = tmp_path / "smoke"
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_train_gpu", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {r["backend"]: r for r in report["results"]}
    assert set(rows) == {"sdpa", "torch_varlen", "flex", "flash_varlen"}
    sdpa = rows["sdpa"]
    assert "error" not in sdpa, sdpa
    assert sdpa["tokens_per_s"] > 0 and len(sdpa["first_losses"]) == 3
    assert all(math.isfinite(x) and 5.0 < x < 9.0 for x in sdpa["first_losses"])  # random init: ~ln(2048) = 7.6
    assert sdpa["sequences_per_row"] > 1 and sdpa["peak_gib"] > 0
    if not torch.cuda.is_available():
        for name in ("torch_varlen", "flex", "flash_varlen"):
            assert "CUDA" in rows[name]["skipped"]
    table = out.with_suffix(".md").read_text()
    assert "| example-tiny | 2048 | sdpa |" in table and report["command"] in table
