"""Exact resume (6 steps == 3 steps + resume to 6), checkpoint rotation and crash-safety of the `latest` pointer."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.checkpoint import checkpoint_root, resolve_resume, safe_load
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    data = write_packed(tmp / "data", random_rows(7, 5, seqs_per_row=2))
    model = save_tiny_model(tmp / "model")
    # 5 rows, 2 rows per step: 3 steps per epoch (the last one with a filler micro-batch), 6 steps = 2 epochs
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=6, lr=3e-3,
                          warmup_steps=1, grad_accum=2, loss_chunk_size=16, save_steps=2, save_total_limit=2,
                          plot=False, output_dir=str(tmp / "unused"))
    return tmp, config


def _train(config, out, *overrides):
    trainer = Trainer(load_config(config, [f"output_dir={out}", *overrides]), console=lambda *_: None)
    trainer.train()
    return trainer


def test_resume_gives_identical_steps(setup):
    tmp, config = setup
    full = tmp / "full"
    _train(config, full)
    split = tmp / "split"
    _train(config, split, "stop_at_step=3")
    assert [r["step"] for r in read_log(split)] == [1, 2, 3]
    assert not (split / "final").exists()
    resumed = _train(config, split, "resume=latest")
    assert resumed.step == 6
    a, b = read_log(full), read_log(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        for key in ("loss", "lr", "grad_norm", "loss_tokens", "category_loss", "epoch"):
            assert ra[key] == rb[key], (ra["step"], key)
    sa = safe_load(checkpoint_root(full) / "step-000006" / "model.pt")
    sb = safe_load(checkpoint_root(split) / "step-000006" / "model.pt")
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    # rotation: only the last 2 checkpoints stay, `latest` names the newest
    kept = sorted(p.name for p in checkpoint_root(full).iterdir() if p.name.startswith("step-"))
    assert kept == ["step-000004", "step-000006"]
    assert resolve_resume("latest", full).name == "step-000006"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(full / "final")


def test_crash_mid_save_keeps_previous_checkpoint(setup):
    tmp, config = setup
    out = tmp / "crash"
    trainer = _train(config, out, "stop_at_step=2")
    root = checkpoint_root(out)
    # a save that died before its rename: a half-written temp dir, `latest` untouched
    half = root / ".step-000004.tmp"
    shutil.copytree(root / "step-000002", half)
    (half / "manifest.json").unlink()
    assert resolve_resume("latest", out).name == "step-000002"
    # resuming removes the leftover at start and continues from step 2
    trainer = Trainer(load_config(config, [f"output_dir={out}", "resume=latest", "stop_at_step=4"]),
                      console=lambda *_: None)
    assert not half.exists()
    trainer.train()
    assert trainer.step == 4
    assert [r["step"] for r in read_log(out)] == [1, 2, 3, 4]


class _Rows:
    """A PackedDataset stand-in for the sampler: only the per-row arrays and len."""

    def __init__(self, n):
        import numpy as np

        self.row_n_loss_tokens = np.arange(n) + 1
        self.row_n_trained_turns = np.ones(n, dtype=int)
        self.row_n_samples = np.ones(n, dtype=int)

    def __len__(self):
        return len(self.row_n_samples)


def test_sampler_is_a_pure_function_of_the_step():
    from train.steps.sampler import StepSampler

    ds = _Rows(11)
    ranks = [StepSampler(ds, dp_size=2, dp_rank=r, grad_accum=2, micro_batch_rows=1, seed=3) for r in range(2)]
    assert ranks[0].steps_per_epoch == 3  # 4 rows per step, 11 rows: the last step has 3 rows and a filler
    for epoch in range(2):
        seen = []
        for step in range(epoch * 3, epoch * 3 + 3):
            plans = [s.plan(step) for s in ranks]
            assert plans[0].totals == plans[1].totals
            real = [r for p in plans for mb in p.micro_batches if not mb.filler for r in mb.rows]
            assert sorted(real) == sorted(plans[0].step_rows.tolist())
            seen += real
        assert sorted(seen) == list(range(11))  # every row exactly once per epoch
    last = ranks[1].plan(2)
    assert [mb.filler for mb in last.micro_batches] == [False, True]
    # a fresh sampler (a resumed run) gives the same plan for any step; another epoch another order
    fresh = StepSampler(ds, dp_size=2, dp_rank=0, grad_accum=2, micro_batch_rows=1, seed=3)
    assert fresh.plan(4).step_rows.tolist() == ranks[0].plan(4).step_rows.tolist()
    assert ranks[0].permutation(0).tolist() != ranks[0].permutation(1).tolist()


class _Killed(Exception):
    pass


def test_crash_between_the_renames_of_a_resave(setup, monkeypatch):
    """Re-saving a step moves the old directory aside, then renames the new one in; a kill in between leaves
    `latest` naming a missing directory: resume=latest uses the moved-aside copy."""
    import orjson

    import train.checkpoint as checkpoint

    tmp, config = setup
    out = tmp / "resave"
    trainer = _train(config, out, "stop_at_step=2")
    root = checkpoint_root(out)

    def killed_mid_swap(src, dst):
        dst.rename(dst.parent / f".{dst.name}.old-killed")
        raise _Killed

    monkeypatch.setattr(checkpoint, "replace_dir", killed_mid_swap)
    with pytest.raises(_Killed):
        trainer.save()
    monkeypatch.undo()
    assert not (root / "step-000002").exists()
    assert resolve_resume("latest", out).name == ".step-000002.old-killed"
    _train(config, out, "resume=latest", "stop_at_step=2")  # stops at once: re-saves step 2 from the copy
    assert resolve_resume("latest", out).name == "step-000002"
    assert not (root / ".step-000002.old-killed").exists()
    resumed = _train(config, out, "resume=latest", "stop_at_step=3")
    assert resumed.step == 3
    assert [r["step"] for r in read_log(out)] == [1, 2, 3]
    assert resolve_resume("latest", out).name == "step-000003"

    # resuming at the step of the checkpoint and stopping there saves nothing again
    saves = []
    monkeypatch.setattr("train.run.resume.save_checkpoint", lambda *a, **k: saves.append(a))
    _train(config, out, "resume=latest", "stop_at_step=3")
    assert saves == []

    # a checkpoint of another world size that predates the global batch record is a clear error
    # (tests/train/run/test_resume_reshard.py resumes current ones on another number of processes)
    state_file = root / "step-000003" / "trainer_state.json"
    old_state = {k: v for k, v in orjson.loads(state_file.read_bytes()).items()
                 if k not in ("rows_per_step", "dp_size", "sp_size")}
    state_file.write_bytes(orjson.dumps({**old_state, "world_size": 2}))
    checkpoint.write_manifest(state_file.parent, 3)  # re-seal: this is about the world size, not corruption
    with pytest.raises(RuntimeError, match="saved by 2 processes, this run has 1, and the checkpoint predates"):
        _train(config, out, "resume=latest")


def test_new_run_into_an_output_dir_with_checkpoints(setup):
    """resume=none where an earlier run left checkpoints is an error (its steps would mix with the new run's);
    overwrite_output_dir=true starts over and leaves only the new run's checkpoints."""
    from common.config import ConfigError

    tmp, config = setup
    out = tmp / "again"
    _train(config, out, "max_steps=4")
    assert [p.name for p in sorted(checkpoint_root(out).glob("step-*"))] == ["step-000002", "step-000004"]
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run \\(step-000004\\); resume=latest"):
        Trainer(load_config(config, [f"output_dir={out}", "max_steps=2"]), console=lambda *_: None)
    _train(config, out, "max_steps=2", "overwrite_output_dir=true")
    assert [p.name for p in sorted(checkpoint_root(out).glob("step-*"))] == ["step-000002"]
    assert [r["step"] for r in read_log(out)] == [1, 2]
    assert resolve_resume("latest", out).name == "step-000002"


@pytest.mark.parametrize("override, message", [
    ("grad_accum=1", r"the global batch is 1 rows per step here \(dp 1 x grad_accum 1 x micro_batch_rows 1\), but "
                     r"the checkpoint was saved with 2 rows per step \(dp 1 x grad_accum 2 x micro_batch_rows 1\)"),
    ("micro_batch_rows=2", r"the global batch is 4 rows per step here \(dp 1 x grad_accum 2 x micro_batch_rows 2\)"),
    ("max_steps=8", r"max_steps=8 \(8 steps\), but the checkpoint was saved with max_steps=6 \(6 steps; another lr"),
])
def test_resume_with_another_step_layout_is_refused(setup, override, message):
    """Another global batch (grad_accum / micro_batch_rows changing the rows per step) or step count would give every
    resumed step other rows (the epoch counter going backwards, rows trained twice or never) or another lr: refused,
    naming both values."""
    from train.checkpoint import CheckpointError

    tmp, config = setup
    out = tmp / f"layout-{override.split('=')[0]}"
    _train(config, out, "stop_at_step=2")
    with pytest.raises(CheckpointError, match=message):
        Trainer(load_config(config, [f"output_dir={out}", "resume=latest", override]), console=lambda *_: None)
    assert _train(config, out, "resume=latest", "stop_at_step=3").step == 3  # the same layout resumes


def _model_copy(source, target, **changes):
    """A copy of the saved tiny model whose config.json has `changes` (dotted keys reach into sections)."""
    import json

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    for key, value in changes.items():
        node, *path = key.split(".")
        holder = config
        while path:
            holder, node = holder[node], path.pop(0)
        holder[node] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


def _hidden_size_config(source, target):
    """A model_config json: the saved model's config.json with a bigger hidden size (every other key equal)."""
    import json

    config = json.loads((source / "config.json").read_text())
    target.write_text(json.dumps({**config, "hidden_size": 96}))
    return target


def test_resume_with_another_model_config_is_refused(setup):
    """A model config that keeps every shape (rope_theta) would resume and export silently with the new config; one
    that changes a shape (hidden size) failed in torch's load_state_dict ("size mismatch for ..."), naming neither
    the checkpoint nor the key. Both are refused before any tensor of the checkpoint loads, naming the checkpoint,
    the key and both values."""
    import re

    from train.checkpoint import CheckpointError

    tmp, config = setup
    out = tmp / "model-config"
    _train(config, out, "stop_at_step=2")
    step = re.escape(str(checkpoint_root(out) / "step-000002"))
    rope = _model_copy(tmp / "model", tmp / "model-rope", **{"rope_parameters.rope_theta": 500000.0})
    with pytest.raises(CheckpointError, match=rf"resume from {step}: .*model_path {re.escape(str(rope))}: "
                                              r"rope_parameters.rope_theta is 500000.0 here, 10000.0 in the checkpoint"
                                              r".*resume with the checkpoint's model"):
        Trainer(load_config(config, [f"output_dir={out}", "resume=latest", f"model_path={rope}"]),
                console=lambda *_: None)
    wide = _hidden_size_config(tmp / "model", tmp / "wide.json")
    with pytest.raises(CheckpointError, match=rf"resume from {step}: .*model_config {re.escape(str(wide))}: "
                                              r"hidden_size is 96 here, 64 in the checkpoint"):
        Trainer(load_config(config, [f"output_dir={out}", "resume=latest", f"model_config={wide}"]),
                console=lambda *_: None)
    assert sorted(p.name for p in checkpoint_root(out).glob("step-*")) == ["step-000002"]  # nothing written


@pytest.mark.parametrize("rank", [4, 0])
def test_resume_with_another_lora_rank_is_refused(setup, rank):
    """LoRA rank 8 -> 4 (other adapter shapes) or 0 (full fine-tuning: other parameters) failed in torch's
    load_state_dict; now refused naming the checkpoint and lora_rank with both values."""
    import re

    from train.checkpoint import CheckpointError

    tmp, config = setup
    out = tmp / f"lora-{rank}"
    _train(config, out, "stop_at_step=2", "lora_rank=8")
    step = re.escape(str(checkpoint_root(out) / "step-000002"))
    with pytest.raises(CheckpointError, match=rf"resume from {step}: .*lora_rank is {rank} here, 8 in the checkpoint"):
        Trainer(load_config(config, [f"output_dir={out}", "resume=latest", f"lora_rank={rank}"]),
                console=lambda *_: None)


def test_resume_may_change_what_does_not_change_the_weights_function(setup):
    """Dropout (the model config's and LoRA's) changes how the run trains, not what the weights compute: a resume
    with another value continues."""
    tmp, config = setup
    out = tmp / "dropout"
    _train(config, out, "stop_at_step=2", "lora_rank=8")
    dropout = _model_copy(tmp / "model", tmp / "model-dropout", attention_dropout=0.1)
    resumed = _train(config, out, "resume=latest", "stop_at_step=3", "lora_rank=8", "lora_dropout=0.1",
                     f"model_path={dropout}")
    assert resumed.step == 3


def test_resume_of_a_checkpoint_without_a_model_record_names_it_when_the_weights_do_not_fit(setup):
    """A checkpoint written before trainer_state.json recorded the model: another hidden size fails in torch's
    load_state_dict; the error names the checkpoint and the keys to look at, not torch's bare "size mismatch"."""
    import re

    import orjson

    from train.checkpoint import CheckpointError, write_manifest

    tmp, config = setup
    out = tmp / "legacy"
    _train(config, out, "stop_at_step=2")
    step_dir = checkpoint_root(out) / "step-000002"
    state = orjson.loads((step_dir / "trainer_state.json").read_bytes())
    state.pop("model")
    (step_dir / "trainer_state.json").write_bytes(orjson.dumps(state))
    write_manifest(step_dir, 2)  # the checkpoint as the older release wrote it: consistent, with no model record
    wide = _hidden_size_config(tmp / "model", tmp / "wide-legacy.json")
    with pytest.raises(CheckpointError, match=rf"resume from {re.escape(str(step_dir))}: its weights do not fit this "
                                              r"model \(model_config / model_path / lora_rank .*size mismatch"):
        Trainer(load_config(config, [f"output_dir={out}", "resume=latest", f"model_config={wide}"]),
                console=lambda *_: None)
