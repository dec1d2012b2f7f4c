"""benchmarks/gpu_check.py and scripts/gpu_check.sh: the unattended GPU check, run on the CPU (GPU steps skipped),
and every phase of it in --smoke mode (the example data and tiny model on the CPU, the long-row runs and, with
--legacy, TRL's SFTTrainer included); the second command (--second: trees, moe) on the CPU and its MoE shape and
kernel variants; bench_long_rows' refusals before a run starts."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.bench_long_rows import model_config, not_started
from benchmarks.bench_train_gpu import parse_variant
from benchmarks.gpu_check import QWEN3_30B_A3B, TEST_LINE, XDIST_LINE, gpu_test_files
from tests._train_helpers import ROOT

# Not `serial`: every check below runs with --no-caps (no phase deadline, no per-run timeout but a hang guard), so
# other tests beside it make it slower, never its results different; its processes run one thread each.


# A launcher's variables that an in-process single-process trainer of an earlier test in this pytest worker leaves
# behind (train/engines/build.py sets RANK, LOCAL_RANK, WORLD_SIZE for DeepSpeed): inherited, they make TRL's
# accelerate ask for a torch.distributed rendezvous. The check starts from a clean shell on the GPU machine.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run_check(out, *args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--work", str(out.parent / "work"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def test_gpu_test_files_are_every_file_with_a_gpu_mark_heavy_last():
    files = gpu_test_files(ROOT / "tests")
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    assert sorted(files) == marked and "tests/train/attention/test_varlen_kernels.py" in files
    assert files[-2:] == ["tests/train/attention/test_function_backends.py", "tests/train/model/test_packed_options.py"]


def test_pytest_lines_of_both_formats_are_read():
    plain = "tests/test_a.py::test_b[x-1] PASSED                 [ 12%]"
    xdist = "[gw3] [ 55%] FAILED tests/test_a.py::test_c[flex-window-sinks] "
    assert TEST_LINE.match(plain).groups() == ("tests/test_a.py::test_b[x-1]", "PASSED")
    assert XDIST_LINE.match(xdist).groups() == ("FAILED", "tests/test_a.py::test_c[flex-window-sinks]")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the check")
def test_cpu_check_runs_the_gpu_tests_and_skips_the_gpu_phases(tmp_path):
    report = _run_check(tmp_path / "out", "--no-caps")  # the tests phase's cap is sized for the GPU machine
    tests = report["phases"]["tests"]
    assert tests["counts"].get("SKIPPED", 0) >= 30 and not tests["failed"], tests["counts"]
    assert set(tests["counts"]) == {"SKIPPED"}  # without CUDA every gpu test skips, none errors at collection
    assert list(report["phases"]) == ["tests", "train_32k_large", "long_rows"]  # --legacy adds the rest
    for phase in ("train_32k_large", "long_rows"):
        assert report["phases"][phase] == {"skipped": "no CUDA"}
    assert report["versions"]["torch"] and (tmp_path / "out" / "gpu_tests.log").exists()


@pytest.mark.slow
def test_smoke_check_runs_every_phase_on_the_cpu(tmp_path):
    """--smoke --legacy: the trainer benchmark with and without full checkpointing, each profiled, the long-row
    runs, TRL's SFTTrainer on the same rows, the furthest target's profile: what the GPU run does. --no-caps: the
    phases' deadlines and timeouts are sized for the GPU machine; here every phase runs to its end, so a loaded
    machine makes the check slower, never its results missing. --skip-tests: the tests phase is the test above's."""
    out = tmp_path / "out"
    report = _run_check(out, "--smoke", "--legacy", "--no-caps", "--skip-tests", "--steps", "3")
    assert report["caps"] is False and report["budget_s"] is None
    phases = report["phases"]
    assert list(phases) == ["tests", "train_32k_large", "long_rows", "train_32k_small", "train_128k", "trl", "profile"]
    assert phases["tests"] == {"skipped": "--skip-tests"}  # what test_cpu_check_runs_the_gpu_tests_... runs
    ran = [name for name, phase in phases.items() if "skipped" not in phase]
    assert all(phases[name].get("returncode") == 0 for name in ran if name != "long_rows"), phases
    assert all(run.get("returncode", 0) == 0 for run in phases["long_rows"]["runs"])
    assert phases["train_128k"]["skipped"].startswith("--smoke: bench_train_gpu runs the example's 2K rows")
    large = {r["backend"]: r for r in phases["train_32k_large"]["report"]["results"]}
    assert set(large) == {"sdpa", "sdpa+ckpt"} and large["sdpa+ckpt"]["checkpointing"].startswith("on")
    assert large["sdpa"]["first_losses"] == pytest.approx(large["sdpa+ckpt"]["first_losses"], abs=1e-3)
    runs = phases["long_rows"]["runs"]
    assert [r["lengths"] for r in runs] == ["2048", "1536", "1024"] and runs[1]["skipped"] == "2048 measured"
    matrix = {r["option"]: r for r in runs[2]["results"]}
    assert set(matrix) == {"ckpt", "ckpt+tiled+offload"}
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 and r["trained_params"] > 0 for r in matrix.values())
    # the same row and seed: the options give the loss of plain checkpointing (they are exact)
    assert all(r["loss"] == pytest.approx(matrix["ckpt"]["loss"], rel=1e-5) for r in matrix.values())
    assert "ckpt+tiled+offload tokens/s" in (out / "long_rows.md").read_text()
    rows = {r["backend"]: r for r in phases["train_32k_small"]["report"]["results"]}
    assert rows["sdpa"]["tokens_per_s"] > 0 and len(rows["sdpa"]["first_losses"]) == 3
    assert "CUDA" in rows["torch_varlen"]["skipped"]
    trl = {r["attn"]: r for r in phases["trl"]["report"]["results"]}
    assert set(trl) == {"sdpa"}  # FlexAttention has no backward on the CPU
    assert "error" not in trl["sdpa"], trl["sdpa"]
    assert trl["sdpa"]["tokens_per_s"] > 0 and all(math.isfinite(x) for x in trl["sdpa"]["first_losses"])
    assert trl["sdpa"]["trl"] and trl["sdpa"]["sequences_per_row"] > 1
    # the same rows: TRL's first loss on the same random init is near PackSFT's (both ~ln(vocab) at init)
    assert abs(trl["sdpa"]["first_losses"][0] - rows["sdpa"]["first_losses"][0]) < 0.5
    assert phases["profile"]["target"] == {"shape": "example-tiny", "row_length": 2048, "backend": "sdpa"}
    profiles = (out / "profile.txt").read_text()
    assert profiles.count("one step") == 3 and "2048-token rows, sdpa+ckpt: one step" in profiles
    assert "TRL SFTTrainer" in (out / "gpu_check.md").read_text()


def test_long_rows_refuses_an_offload_the_host_cannot_hold_and_runs_after_the_deadline(monkeypatch):
    import train.plan.memory as memory_plan

    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 120 * 2**30)  # the GPU machine's order
    spec = dict(option="ckpt+tiled+offload", length=524288, shape="llama3-8b", layers=0, sequence=2048, bf16=True,
                device="cuda")
    cfg = model_config("llama3-8b", 0, 2048)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (32, 4096, 8)
    assert not_started(spec, None).startswith(
        "not run: activation_offload: a 524,288-token micro-batch per rank keeps 128.0 GiB of pinned host memory "
        "(32 layers × 4.00 GiB")
    assert "120.0 GiB available, 108.0 GiB usable per rank for its 1 rank" in not_started(spec, None)
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 150 * 2**30)
    assert not_started(spec, None) is None
    assert not_started(dict(spec, length=1024), None) is None  # 256 MiB
    assert not_started(dict(spec, option="ckpt+tiled"), None) is None  # no offload: nothing asked of the host
    assert not_started(dict(spec, length=1024), deadline=0.0) == "not run: the deadline had passed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the check")
def test_second_command_on_the_cpu_records_its_phases_as_skipped(tmp_path):
    report = _run_check(tmp_path / "out", "--second", "--no-caps")
    assert report["command"] == "second" and list(report["phases"]) == ["trees", "moe"]
    assert report["phases"] == {"trees": {"skipped": "no CUDA"}, "moe": {"skipped": "no CUDA"}}


def test_moe_phase_shape_is_qwen3_30b_a3b_and_its_variants_choose_the_experts_kernel():
    from transformers import AutoConfig

    from train.plan.memory import ModelShape

    raw = dict(QWEN3_30B_A3B)
    shape = ModelShape.from_hf_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    # Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated (the input embedding, 0.31B, is no matmul)
    assert round(shape.n_params / 1e9, 1) == 30.5
    assert shape.matmul_params + shape.vocab * shape.hidden == pytest.approx(3.3e9, rel=0.03)
    assert parse_variant("torch_varlen+compile_loss+moe_loop") == ("torch_varlen", {"compile_loss": True,
                                                                                    "moe_kernel": "loop"})
    assert parse_variant("sdpa+moe_grouped_mm") == ("sdpa", {"moe_kernel": "grouped_mm"})
    assert parse_variant("torch_varlen+liger") == ("torch_varlen", {"liger": True})
    with pytest.raises(SystemExit, match="moe_grouped_mm"):
        parse_variant("sdpa+moe_fast")
