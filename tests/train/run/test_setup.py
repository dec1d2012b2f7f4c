"""The run built from a config (train/run/setup.py): the config stays as the user wrote it while every value chosen at
start lives in the frozen StartupPlan, whose describe() is the start line (LoRA's rank, targets and trainable
parameters included)."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.config.sections import load_config


@pytest.fixture(scope="module")
def data_and_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("setup")
    return write_packed(tmp / "packed", random_rows(0, 6, seqs_per_row=2)), save_tiny_model(tmp / "model")


def _trainer(tmp_path, data_and_model, **values):
    from train.trainer import Trainer

    data, model = data_and_model
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model), max_steps=3,
                          output_dir=str(tmp_path / "run"), lr=1e-3, loss_chunk_size=16, log_backends=[], **values)
    cfg = load_config(config)
    written = copy.deepcopy(cfg.to_dict())
    lines = []
    trainer = Trainer(cfg, console=lines.append)
    return trainer, written, lines


def test_every_auto_is_chosen_in_the_plan_and_the_config_stays_as_written(tmp_path, data_and_model, one_thread):
    trainer, written, _ = _trainer(tmp_path, data_and_model, sequence_parallel_size="auto",
                                   gradient_checkpointing="auto", compile_loss="auto", warmup_steps=None,
                                   warmup_ratio=0.5, moe_kernel="auto")
    trainer.train()
    plan = trainer.plan
    assert trainer.cfg.to_dict() == written  # nothing written into it, before or after the steps
    assert (plan.layout.sp, plan.layout.sp_reason) == (1, "auto: no CUDA device to size the rows against")
    assert plan.schedule.warmup_steps == 1 and plan.schedule.total_steps == 3  # int(0.5 * 3)
    assert plan.loss.compiled is False and plan.memory.checkpointing is False  # CPU: eager chunks; short rows
    assert plan.data.row_length == int(max(trainer.dataset.row_n_tokens)) and plan.data.media_kinds == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.loss = None


def test_the_start_lines_say_what_lora_trains(tmp_path, data_and_model, one_thread):
    trainer, _, _ = _trainer(tmp_path, data_and_model, lora_rank=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"])
    lines = trainer.plan.describe()
    trainable = sum(p.numel() for p in trainer.lm.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.lm.parameters())
    assert lines[0].startswith("attention: ") and lines[1].startswith("training 3 steps: world 1 (dp 1 x sp 1)")
    assert (f"LoRA rank 4 (alpha 8) on q_proj, v_proj: {trainable:,} trainable parameters of {total:,} "
            f"({100 * trainable / total:.2f}%)") in lines[1]
    assert 0 < trainable < total
