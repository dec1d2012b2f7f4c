"""Multi-process CPU runs (gloo) against one process: data parallel == gradient accumulation == one micro-batch,
DeepSpeed ZeRO-2 / ZeRO-3 (the latter stopped and resumed) == no DeepSpeed, sequence parallel == no sequence
parallel; data and sequence parallel with the long-row options (tiled MLP, activation offload) == the plain single
process.

The first DeepSpeed run on a machine JIT-builds its CPU comm op (about 2 minutes, cached afterwards)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    ROOT,
    free_port,
    one_thread,
    random_rows,
    run_train,
    save_tiny_model,
    write_config,
    write_packed,
)
from train.checkpoint import safe_load
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

RTOL = 1e-5
STEPS = 3
# tiled MLP in 5-token tiles (rows of ~45 tokens: several tiles per layer) and the checkpointed inputs offloaded
LONG_ROW_OPTIONS = ["tiled_mlp=true", "tiled_mlp_tile=5", "gradient_checkpointing=true", "activation_offload=true"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    data = write_packed(tmp / "data", random_rows(11, 6))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=STEPS, lr=1e-3,
                          max_grad_norm=0.0, loss_chunk_size=16, plot=False, output_dir=str(tmp / "unused"))
    return tmp, config


def _in_process(config, out, *overrides):
    """(log records, per-step summed gradients) of a single-process run without DeepSpeed."""
    trainer = Trainer(load_config(config, [f"output_dir={out}", *overrides]), console=lambda *_: None)
    grads = []
    trainer.grad_hook = lambda tr: grads.append(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    )
    return trainer.train(), grads


@pytest.fixture(scope="module")
def reference(setup):
    """Two rows per step in one process, as 2 micro-batches of 1 row (gradient accumulation)."""
    tmp, config = setup
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _in_process(config, tmp / "ref", "grad_accum=2")
    torch.set_num_threads(before)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same_grads(got: dict, ref: dict, what: str):
    assert got.keys() == ref.keys()
    for name in ref:
        err = float((got[name] - ref[name]).abs().max()) / max(float(ref[name].abs().max()), 1e-12)
        assert err <= RTOL, f"{what}: {name} relative error {err:.2e}"


def test_one_micro_batch_equals_accumulation(setup, reference, one_thread):
    tmp, config = setup
    ref_log, ref_grads = reference
    log, grads = _in_process(config, tmp / "joined", "micro_batch_rows=2")
    assert len(log) == len(ref_log) == len(grads) == len(ref_grads) == STEPS
    for step in range(STEPS):
        assert _rel(log[step]["loss"], ref_log[step]["loss"]) <= RTOL
        _assert_same_grads(grads[step], ref_grads[step], f"step {step + 1}")


@pytest.mark.parametrize("options", [[], LONG_ROW_OPTIONS], ids=["plain", "long_row_options"])
def test_data_parallel_equals_accumulation(setup, reference, tmp_path, options):
    _, config = setup
    ref_log, ref_grads = reference
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_train_worker.py"), str(config), str(tmp_path / "grads"), f"output_dir={out}",
           "balance_dp=true", *options]  # rows assigned to ranks by cost: a different split, the same step
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    for step in range(STEPS):
        assert _rel(log[step]["loss"], ref_log[step]["loss"]) <= RTOL
        assert log[step]["category_loss"] == pytest.approx(ref_log[step]["category_loss"], rel=RTOL)
        grads = safe_load(tmp_path / "grads" / f"step_{step + 1}.pt")
        _assert_same_grads(grads, ref_grads[step], f"step {step + 1}")


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_single_process(setup, reference, tmp_path, stage, one_thread, monkeypatch):
    """Also: DeepSpeed's CPU runs build no C++ op (its shared-memory all-reduce, inference only, is skipped)."""
    tmp, config = setup
    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    overrides = [f"output_dir={tmp_path / f'zero{stage}'}", f"deepspeed.stage={stage}", "launch.num_processes=2"]
    if stage == 2:  # DeepSpeed's own accumulation (2 micro-batches per rank; the 2nd step ends with fillers)
        ref_log, _ = _in_process(config, tmp_path / "ref4", "grad_accum=4")
        overrides.append("grad_accum=2")
    else:
        ref_log, _ = reference
    out = tmp_path / f"zero{stage}"
    if stage == 3:  # also exact resume through DeepSpeed's own checkpoint: stop after step 2, resume to the end
        run_train(config, [*overrides, "stop_at_step=2"], nproc=2)
        assert len(read_log(out)) == 2
        overrides.append("resume=latest")
    run_train(config, overrides, nproc=2)
    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [r["step"] for r in ref_log] == list(range(1, STEPS + 1))
    for got, ref in zip(log, ref_log):
        assert _rel(got["loss"], ref["loss"]) <= RTOL, (stage, got["step"])
        # the gradient norm is scale-sensitive (Adam is not): it proves the gradient is the exact step gradient
        assert _rel(got["grad_norm"], ref["grad_norm"]) <= RTOL, (stage, got["step"])
        assert got["lr"] == pytest.approx(ref["lr"])
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")
    assert not extensions.exists()  # nothing compiled (27 s a build on 2 cores)


@pytest.mark.parametrize("options", [[], LONG_ROW_OPTIONS], ids=["plain", "long_row_options"])
def test_sequence_parallel_matches_single_process(setup, tmp_path, one_thread, options):
    pytest.importorskip("train.attention.sequence_parallel")
    _, config = setup
    ref_log, ref_grads = _in_process(config, tmp_path / "sp_ref")  # one row per step, one process, plain
    out = tmp_path / "sp"
    run_train(config, [f"output_dir={out}", "sequence_parallel_size=2", "launch.num_processes=2", *options],
              nproc=2)
    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [r["step"] for r in ref_log] == list(range(1, STEPS + 1))
    for got, ref in zip(log, ref_log):
        assert _rel(got["loss"], ref["loss"]) <= RTOL, got["step"]
        assert _rel(got["grad_norm"], ref["grad_norm"]) <= RTOL, got["step"]
