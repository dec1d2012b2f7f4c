"""A loss or gradient that turns inf / nan: the run stops at that step (nonfinite=stop, the default) keeping the
last finite checkpoint, or skips the step's update (nonfinite=skip_step); non-finite weights are never exported."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from common.config import ConfigError
from tests._train_helpers import ROOT, one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.checkpoint import CheckpointError, checkpoint_root, safe_load
from train.config.sections import load_config
from train.metrics import read_log
from train.nonfinite import NonFiniteError
from train.trainer import Trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nonfinite")
    data = write_packed(tmp / "data", random_rows(11, 8, seqs_per_row=2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=8, lr=1e-3,
                          loss_chunk_size=16, save_steps=1, save_total_limit=2, plot=False,
                          output_dir=str(tmp / "unused"))
    return tmp, config


def _trainer(config, out, *overrides) -> Trainer:
    return Trainer(load_config(config, [f"output_dir={out}", *overrides]), console=lambda *_: None)


def _finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def test_a_diverging_run_stops_at_the_first_nonfinite_step_and_keeps_its_finite_checkpoints(setup, tmp_path,
                                                                                           one_thread):
    _, config = setup
    out = tmp_path / "run"
    trainer = _trainer(config, out, "lr=1e9")
    with pytest.raises(NonFiniteError) as exc:
        trainer.train()
    bad = int(re.match(r"step (\d+): ", str(exc.value)).group(1))
    last = checkpoint_root(out) / f"step-{bad - 1:06d}"
    assert f"(nonfinite=stop)" in str(exc.value) and f"last checkpoint, {last}, holds finite weights" in str(exc.value)
    assert "lr" in str(exc.value) and "nonfinite=skip_step" in str(exc.value)
    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, bad)) and all(math.isfinite(r["loss"]) for r in log)
    assert (checkpoint_root(out) / "latest").read_text() == last.name
    for kept in checkpoint_root(out).glob("step-*"):
        assert int(kept.name[5:]) < bad and _finite(safe_load(kept / "model.pt")), kept
    assert not (out / "final").exists()


def _poison_gradient_at(step: int):
    """A grad_hook that puts a nan into one gradient of optimizer step `step` (1-based)."""

    def hook(trainer):
        if trainer.step + 1 == step:
            next(p for p in trainer.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")

    return hook


def test_a_nonfinite_gradient_stops_the_run_by_default(setup, tmp_path, one_thread):
    _, config = setup
    out = tmp_path / "run"
    trainer = _trainer(config, out, "max_steps=4")
    trainer.grad_hook = _poison_gradient_at(3)
    with pytest.raises(NonFiniteError, match=r"^step 3: the gradient norm is nan"):
        trainer.train()
    assert [r["step"] for r in read_log(out)] == [1, 2]
    assert _finite(trainer.model.state_dict())  # the bad update was not applied


def test_skip_step_skips_the_update_of_a_nonfinite_step_and_trains_on(setup, tmp_path, one_thread):
    _, config = setup
    out = tmp_path / "run"
    trainer = _trainer(config, out, "max_steps=4", "nonfinite=skip_step")
    before = {}

    def hook(trainer):
        if trainer.step + 1 == 3:
            before.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
        _poison_gradient_at(3)(trainer)

    trainer.grad_hook = hook
    records = trainer.train()
    assert [r.get("skipped") for r in records] == [None, None, "nonfinite", None]
    assert math.isnan(records[2]["grad_norm"]) and math.isfinite(records[3]["grad_norm"])
    after_3 = safe_load(checkpoint_root(out) / "step-000003" / "model.pt")
    assert all(torch.equal(before[k], after_3[k]) for k in before)  # step 3 changed no weight
    assert records[2]["lr"] != records[3]["lr"]  # the schedule keeps counting steps
    assert [r["step"] for r in read_log(out)] == [1, 2, 3, 4] and (out / "final" / "model.safetensors").is_file()


def test_the_export_refuses_nonfinite_weights_naming_the_tensor(setup, tmp_path, one_thread):
    _, config = setup
    trainer = _trainer(config, tmp_path / "run", "max_steps=1")
    with torch.no_grad():
        trainer.lm.model.norm.weight[0] = float("inf")
    final = tmp_path / "run" / "final"
    with pytest.raises(CheckpointError, match=re.escape(f"export directory {final}: refused: 1 of ") +
                       r"\d+ tensors hold inf or nan \(model\.norm\.weight\)"):
        trainer.export(final)
    assert not final.exists() and not list(final.parent.glob(".final*"))


def test_skip_step_with_deepspeed_is_a_config_error(setup):
    _, config = setup
    cfg = load_config(config, ["nonfinite=skip_step", "deepspeed.stage=2"])
    with pytest.raises(ConfigError, match="nonfinite=skip_step needs deepspeed.stage null"):
        cfg.validate()


@pytest.mark.slow
def test_deepspeed_run_stops_at_the_first_nonfinite_step(setup, tmp_path):
    """Under ZeRO-2 (gloo on CPU): the loss is checked before DeepSpeed's update at the accumulation boundary; `python
    -m train` prints one line and exits 1."""
    _, config = setup
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "train", str(config), f"output_dir={out}", "lr=1e9",
                           "deepspeed.stage=2", "grad_accum=2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("training stopped: ")]
    assert len(lines) == 1 and "(nonfinite=stop)" in lines[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    bad = int(re.match(r"training stopped: step (\d+): ", lines[0]).group(1))
    assert [r["step"] for r in read_log(out)] == list(range(1, bad))
    assert not (out / "final").exists()


def test_loss_png_leaves_out_the_nonfinite_values_of_skipped_steps(tmp_path):
    """log.jsonl holds a skipped step's nan loss as null (JSON has no nan): the curves leave it out."""
    from train.metrics import loss_curves, plot_losses

    records = [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 10,
                "category_loss": {"math": 2.0 / s}} for s in (1, 2, 4)]
    records.insert(2, {"step": 3, "loss": None, "lr": 1e-3, "grad_norm": None, "tokens": 10,
                       "category_loss": {"math": None}, "skipped": "nonfinite"})
    (tmp_path / "log.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in records))
    curves = loss_curves(read_log(tmp_path))
    assert curves["loss"][0] == [1, 2, 4] and curves["category"]["math"][0] == [1, 2, 4]
    assert plot_losses(tmp_path).is_file()


def test_gradient_norm_is_the_exact_norm_in_chunks():
    """The logged (and clipping) gradient norm: float64 accumulation over chunks, the exact value of the fp32
    gradients whatever their size or the chunk boundaries; nan and inf pass through (the step's nonfinite check)."""
    from train.nonfinite import gradient_norm

    torch.manual_seed(0)
    grads = [torch.randn(1000, 64) * 1e-3, torch.randn(7), torch.randn(3, 5) * 10]
    exact = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    for chunk in (1 << 24, 7, 64):
        assert gradient_norm(grads, chunk=chunk) == pytest.approx(exact, rel=1e-12)
    assert gradient_norm([]) == 0.0
    assert math.isnan(gradient_norm([torch.tensor([1.0, float("nan")])]))
    assert math.isinf(gradient_norm([torch.tensor([1.0, float("inf")])]))
