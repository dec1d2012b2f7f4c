"""deepspeed.stage 0 trains: DeepSpeed records no gradient norm at stage 0 (fp32, the torch optimizer stepped as it
is), so the engine computes it (float64 sum of squares, as the plain engine) and clips with it. Through
`python -m train` (DeepSpeed needs its process group) == the plain engine in one process: loss and gradient norm
within 1e-6 relative over a few steps with clipping on (max_grad_norm below every step's norm), on one process and
on two (gloo, the same global batch)."""
from __future__ import annotations

import pytest
import torch

from tests._train_helpers import random_rows, run_train, save_tiny_model, write_config, write_packed
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

RTOL = 1e-6
STEPS = 3
CLIP = ["max_grad_norm=0.5"]  # below every step's norm here: each step is clipped


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage0")
    data = write_packed(tmp / "data", random_rows(5, 6))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=STEPS, lr=1e-3,
                          micro_batch_rows=1, grad_accum=2, loss_chunk_size=16, plot=False,
                          output_dir=str(tmp / "unused"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = Trainer(load_config(config, [f"output_dir={tmp / 'plain'}", *CLIP]), console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)
    return config, ref


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_stage0_trains_as_the_plain_engine(setup, tmp_path, processes):
    config, ref = setup
    assert all(r["grad_norm"] > 0.5 for r in ref), "the reference must clip every step"
    out = tmp_path / "stage0"
    grad_accum = 2 // processes  # the same 2 rows a step
    proc = run_train(config, [f"output_dir={out}", "deepspeed.stage=0", *CLIP, f"grad_accum={grad_accum}",
                              f"launch.num_processes={processes}"], nproc=processes)
    assert "deepspeed stage 0" in proc.stdout
    log = read_log(out)
    assert [r["step"] for r in log] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for got, want in zip(log, ref):
        assert _rel(got["loss"], want["loss"]) <= RTOL, (got["step"], got["loss"], want["loss"])
        assert _rel(got["grad_norm"], want["grad_norm"]) <= RTOL, (got["step"], got["grad_norm"], want["grad_norm"])
        assert got["lr"] == pytest.approx(want["lr"])
    assert (out / "final" / "model.safetensors").is_file()
