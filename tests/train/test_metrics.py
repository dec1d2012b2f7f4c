"""What a run shows (train/metrics.py, and the loop's console): redirected output without tqdm fragments, stop_at_step
naming its checkpoint and the exact resume command, loss.png with an lr / grad-norm panel, per-category curves without
gaps, plain titles and a token axis, start lines above the progress bar, and the run summary."""
from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys

import pytest

from tests._train_helpers import ROOT, random_rows, save_tiny_model, write_config, write_packed
from train.metrics import ema_weight, loss_curves, loss_figure, read_log, smoothed


def _python_train(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_stop_at_step_prints_the_checkpoint_and_a_resume_command_that_works(tmp_path):
    data = write_packed(tmp_path / "data", random_rows(3, 4, seqs_per_row=2))
    model = save_tiny_model(tmp_path / "model")
    # stop_at_step in the YAML file: the resume command must turn it off
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model), max_steps=3, lr=1e-3,
                          loss_chunk_size=16, plot=False, stop_at_step=1, output_dir=str(tmp_path / "unused"))
    out = tmp_path / "run"
    proc = _python_train([str(config), f"output_dir={out}", "resume=none"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = out / "checkpoints" / "step-000001"
    assert f"stopped at step 1 of 3 (stop_at_step=1); checkpoint: {checkpoint}" in proc.stdout
    resume_lines = [line for line in proc.stdout.splitlines() if line.startswith("resume with: ")]
    assert resume_lines == [f"resume with: sh train.sh {config} output_dir={out} resume=latest stop_at_step=null"]
    # not a TTY: plain lines, no carriage-return progress fragments, one line per step
    assert "\r" not in proc.stdout + proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("step=")] == ["step=1"]

    command = shlex.split(resume_lines[0].removeprefix("resume with: "))
    assert command[:2] == ["sh", "train.sh"]
    proc = _python_train(command[2:])  # the same arguments, without accelerate's start-up
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {checkpoint} at step 1" in proc.stdout
    assert [r["step"] for r in read_log(out)] == [1, 2, 3] and (out / "final").is_dir()
    assert "resume with" not in proc.stdout


def _records():
    """Steps 1..60; `code` is absent from every third step; eval at 30 and 60."""
    recs = []
    for step in range(1, 61):
        cats = {"math": 3.0 - step / 30 + (0.4 if step % 2 else -0.4)}
        if step % 3:
            cats["code"] = 2.0 + (0.5 if step % 2 else -0.5)
        rec = {"step": step, "loss": 2.5 - step / 60, "lr": 1e-3 * step / 60, "grad_norm": 1.0 + step % 5,
               "category_loss": cats}
        if step % 30 == 0:
            rec["eval_loss"] = 2.4
        recs.append(rec)
    return recs


def test_loss_curves_smoothed_per_category_without_gaps():
    curves = loss_curves(_records())
    steps, raw, smooth = curves["category"]["code"]
    assert steps == [s for s in range(1, 61) if s % 3] and len(raw) == len(smooth) == 40
    assert all(math.isfinite(v) for v in smooth)  # an absent step is no point at all: no NaN, no gap
    assert max(smooth[10:]) - min(smooth[10:]) < 0.5 * (max(raw) - min(raw))  # the ±0.5 zigzag is damped
    assert curves["lr"][1][-1] == pytest.approx(1e-3) and len(curves["grad_norm"][0]) == 60
    assert curves["eval_loss"] == ([30, 60], [2.4, 2.4])
    assert smoothed([1.0, 3.0], 0.0) == [1.0, 3.0]
    assert smoothed([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected from the first point
    assert ema_weight(10) == 0.0 and ema_weight(100) == pytest.approx(0.8)


def test_loss_png_has_loss_category_and_lr_grad_norm_panels(tmp_path):
    import matplotlib.pyplot as plt

    fig = loss_figure(_records())
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    assert titles[0] == "loss" and titles[1].startswith("per-category loss")
    assert "learning rate and gradient norm" in titles
    from train.metrics import plot_losses

    (tmp_path / "log.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in _records()) + "\n")
    png = plot_losses(tmp_path)
    assert png == tmp_path / "loss.png" and png.stat().st_size > 10_000


def test_start_lines_are_written_above_the_progress_bar(tmp_path, monkeypatch):
    """On a terminal the start lines go through the bar (tqdm.write), so the bar is never overwritten by them."""
    import tqdm

    from train.config.sections import load_config
    from train.trainer import Trainer

    written, printed = [], []

    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def write(self, text):
            written.append(text)

        def update(self, n=1):
            pass

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    data = write_packed(tmp_path / "data", random_rows(0, 2))
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(save_tiny_model(tmp_path / "m")),
                          output_dir=str(tmp_path / "out"), max_steps=1, loss_chunk_size=8, plot=False,
                          self_check=False)
    trainer = Trainer(load_config(config), console=printed.append)
    trainer.progress_bar = True
    trainer.train()
    assert any(line.startswith("training 1 steps:") for line in written), (written, printed)
    assert not any(line.startswith("training 1 steps:") for line in printed)


def test_loss_png_titles_are_plain_and_the_loss_panels_have_a_token_axis():
    from train.metrics import loss_figure

    records = [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens": 1000,
                "category_loss": {"math": 2.0}, **({"eval_loss": 2.5, "eval_category_loss": {"math": 2.4}}
                                                   if s % 5 == 0 else {})} for s in range(1, 11)]
    fig = loss_figure(records)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "per-category loss (lines smoothed, dots measured)", "learning rate and gradient norm",
                      ""]  # the last: the grad-norm twin axis
    assert not any("EMA" in t for t in titles)
    token_axes = [child for ax in fig.axes[:2] for child in ax.child_axes]
    assert [a.get_xlabel() for a in token_axes] == ["tokens trained", "tokens trained"]
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == ["math", "math (eval)"]


def test_run_summary_says_time_rate_losses_paths_and_how_to_chat(tmp_path):
    from train.metrics import run_summary

    records = [{"step": 11, "loss": 7.5, "tokens": 4000, "tokens_per_s": 200.0},
               {"step": 12, "loss": 7.25, "tokens": 6000, "tokens_per_s": 300.0, "eval_loss": 7.375}]
    final = tmp_path / "final"
    text = run_summary(records, 99.0, tmp_path / "checkpoints" / "step-000012", final, 75.0)
    assert text.splitlines() == [
        "run summary: steps 11-12 in 0m40s (1m15s in all, start-up and saving included), 250 tokens/s, final loss "
        "7.25, eval loss 7.375 (step 12)",
        f"  checkpoint:  {tmp_path / 'checkpoints' / 'step-000012'}",
        f"  final model: {final}",
        f"  try it:      python -m train.chat {final}   (one user turn per line; with .venv active, from the project "
        "directory)"]
    final.mkdir()
    (final / "adapter_config.json").write_text("{}")
    assert run_summary(records[:1], 20.0, None, final).splitlines()[-1] == (
        "  try it:      the export is a LoRA adapter: set lora_merge_on_save=true to chat with the merged model")
    stopped = run_summary(records, 99.0, tmp_path / "c", None)
    assert "final model" not in stopped and "try it" not in stopped
