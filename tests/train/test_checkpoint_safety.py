"""Checkpoints that are hostile, corrupt, short of disk space or from other data: refused or recovered, never run,
never silently resumed."""
from __future__ import annotations

import logging
import os
import re
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import train.checkpoint as checkpoint
from tests._train_helpers import ROOT, one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.checkpoint import CheckpointError, checkpoint_root, resolve_resume, safe_load, write_manifest
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    data = write_packed(tmp / "data", random_rows(7, 4, seqs_per_row=2))
    other = write_packed(tmp / "other", random_rows(8, 6, seqs_per_row=2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=6, lr=3e-3,
                          grad_accum=1, loss_chunk_size=16, save_steps=2, save_total_limit=3, plot=False,
                          output_dir=str(tmp / "unused"))
    return tmp, config, other


def _trainer(config, out, *overrides) -> Trainer:
    return Trainer(load_config(config, [f"output_dir={out}", *overrides]), console=lambda *_: None)


def _run(config, out, *overrides) -> Trainer:
    trainer = _trainer(config, out, *overrides)
    trainer.train()
    return trainer


class _Payload:
    """Unpickling it runs a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_payloads_are_refused(setup, tmp_path):
    _, config, _ = setup
    out = tmp_path / "run"
    _run(config, out, "stop_at_step=2")
    step = checkpoint_root(out) / "step-000002"
    marker = tmp_path / "pwned"
    # the old rng file name and every file PackSFT loads, each re-sealed in the manifest as an attacker would
    for name in ("rng/rank_0.pt", "rng/rank_0.safetensors", "model.pt"):
        torch.save({"state": _Payload(marker)}, step / name)
    write_manifest(step, 2)
    with pytest.raises(CheckpointError, match=re.escape(f"{step / 'model.pt'}: refused to load")):
        _trainer(config, out, "resume=latest")
    with pytest.raises(CheckpointError, match=re.escape(f"{step / 'rng' / 'rank_0.safetensors'}: not a safetensors")):
        checkpoint.load_rng(step, 0)
    with pytest.raises(CheckpointError, match="refused to load"):
        safe_load(step / "rng" / "rank_0.pt")
    assert not marker.exists()


def test_no_other_torch_load_in_the_repo():
    """Every .pt load goes through train.checkpoint.safe_load (weights_only=True)."""
    pattern = re.compile(r"torch\.load\b|from torch import[^\n]*\bload\b|weights_only\s*=\s*False")
    this = Path(__file__).resolve()
    hits = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".venv") for part in path.relative_to(ROOT).parts) or path.resolve() == this:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert [h for h in hits if not h.startswith("train/checkpoint.py:")] == []
    assert len([h for h in hits if "torch.load(" in h]) == 1, hits  # the one inside safe_load


def test_rng_states_round_trip_without_pickle(tmp_path):
    import random

    import numpy as np

    (tmp_path / "rng").mkdir()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    checkpoint.save_rng(tmp_path, 0)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.load_rng(tmp_path, 0)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert sorted(p.name for p in (tmp_path / "rng").iterdir()) == ["rank_0.json", "rank_0.safetensors"]


_Usage = namedtuple("_Usage", "total used free")


def test_full_disk_stops_with_the_directory_and_resume_latest_works(setup, tmp_path, monkeypatch):
    _, config, _ = setup
    out = tmp_path / "run"
    root = checkpoint_root(out)
    monkeypatch.setattr(checkpoint, "disk_usage", lambda path: _Usage(10**12, 10**12 - 1000, 1000))
    trainer = _trainer(config, out, "stop_at_step=4")
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint directory {root}: 0.00 GiB free")):
        trainer.train()  # the first save (step 2): estimated from the model and optimizer size
    assert not list(root.glob(".step-*")) and not list(root.glob("step-*"))

    monkeypatch.undo()
    _run(config, out, "stop_at_step=2", "overwrite_output_dir=true")
    size = checkpoint.checkpoint_bytes(root / "step-000002")
    monkeypatch.setattr(checkpoint, "disk_usage", lambda path: _Usage(10**12, 0, size))  # less than size * margin
    trainer = _trainer(config, out, "resume=latest", "stop_at_step=4")
    with pytest.raises(CheckpointError, match="estimated from the size of step-000002"):
        trainer.train()
    monkeypatch.undo()
    # a save killed mid-write (ENOSPC) leaves a temporary; the next start removes it and resumes at step 2
    (root / ".step-000004.tmp" / "rng").mkdir(parents=True)
    (root / ".step-000004.tmp" / "model.pt").write_bytes(b"")
    resumed = _trainer(config, out, "resume=latest", "stop_at_step=4")
    assert not (root / ".step-000004.tmp").exists()
    assert resumed.step == 2
    resumed.train()
    assert [r["step"] for r in read_log(out)] == [1, 2, 3, 4]


def test_write_error_during_save_names_the_directory(setup, tmp_path, monkeypatch):
    _, config, _ = setup
    out = tmp_path / "run"
    _run(config, out, "stop_at_step=2")

    def disk_full(directory, rank):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_rng", disk_full)
    trainer = _trainer(config, out, "resume=latest", "stop_at_step=3")
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*checkpoints: writing step 3 failed"):
        trainer.train()
    assert not list(checkpoint_root(out).glob(".step-*.tmp"))
    assert resolve_resume("latest", out).name == "step-000002"


@pytest.mark.parametrize("damage,kind", [("empty", "empty (0 bytes"), ("half", "truncated (")])
def test_corrupt_checkpoint_falls_back_or_stops(setup, tmp_path, caplog, damage, kind):
    _, config, _ = setup
    out = tmp_path / "run"
    _run(config, out, "stop_at_step=4")
    bad = checkpoint_root(out) / "step-000004" / "optimizer.pt"
    data = bad.read_bytes()
    bad.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(f"{bad}: {kind}")):
        _trainer(config, out, "resume=latest", "resume_corrupt=error")
    with caplog.at_level(logging.WARNING, logger="packsft.train"):
        trainer = _trainer(config, out, "resume=latest")
    assert trainer.step == 2
    assert f"{bad}: {kind}" in caplog.text and "Falling back to" in caplog.text
    # a damaged file in an explicitly named checkpoint is an error too (nothing to fall back to)
    with pytest.raises(CheckpointError, match="no earlier complete checkpoint"):
        _trainer(config, out, f"resume={bad.parent}")
    with pytest.raises(CheckpointError, match=re.escape(f"{bad}: cannot be read")):
        safe_load(bad)


def test_resume_on_other_data_is_refused_unless_allowed(setup, tmp_path, caplog):
    _, config, other = setup
    out = tmp_path / "run"
    _run(config, out, "stop_at_step=2")
    with pytest.raises(CheckpointError, match="4 rows then, 6 now.*resume_data_mismatch=allow"):
        _trainer(config, out, "resume=latest", f"data_path={other}")
    with caplog.at_level(logging.WARNING, logger="packsft.train"):
        trainer = _trainer(config, out, "resume=latest", f"data_path={other}", "resume_data_mismatch=allow")
    assert trainer.step == 2 and "resume_data_mismatch=allow: continuing" in caplog.text


def test_cli_refuses_a_resume_on_other_data_in_one_line_before_the_model_loads(setup, tmp_path):
    import subprocess
    import sys

    _, config, other = setup
    out = tmp_path / "run"
    _run(config, out, "stop_at_step=2")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "train", str(config), f"output_dir={out}", "resume=latest",
                           f"data_path={other}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # refused by the start-up checks, before any weight loads (before: exit 1 after the model and the self-check)
    assert proc.returncode == 2
    assert f"config error: resume from {checkpoint_root(out) / 'step-000002'}: the checkpoint was trained on" \
        in proc.stderr
    assert "Traceback" not in proc.stderr and "self-check" not in proc.stdout


@pytest.mark.multiprocess
def test_two_processes_fall_back_together(setup, tmp_path):
    """Rank 0 verifies the manifest and every rank gets its verdict: both resume from the previous checkpoint."""
    from tests._train_helpers import run_train

    _, config, _ = setup
    out = tmp_path / "run"
    common = [f"output_dir={out}", "save_steps=1", "max_steps=3", "launch.num_processes=2"]
    run_train(config, [*common, "stop_at_step=2"], nproc=2)
    bad = checkpoint_root(out) / "step-000002" / "rng" / "rank_1.safetensors"
    bad.write_bytes(bad.read_bytes()[:10])
    proc = run_train(config, [*common, "resume=latest"], nproc=2)
    assert f"{bad}: truncated" in proc.stderr and "Falling back to" in proc.stderr
    assert f"resumed from {checkpoint_root(out) / 'step-000001'} at step 1" in proc.stdout
    assert [r["step"] for r in read_log(out)] == [1, 2, 3]


def _partial_then_enospc(path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(b"PK\x03\x04 half of it")
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["torch.save", "manifest"])
def test_disk_full_midway_through_a_save_leaves_nothing_partial(setup, tmp_path, monkeypatch, where):
    """ENOSPC after the free-space check: torch.save reports a short write as a RuntimeError ("unexpected pos"), the
    manifest's write as an OSError. Either way one CheckpointError naming the directory and what to do, and no
    partial directory."""
    _, config, _ = setup
    out = tmp_path / "run"
    _run(config, out, "stop_at_step=2")
    root = checkpoint_root(out)
    if where == "torch.save":
        real_save = torch.save

        def save(obj, path, *args, **kwargs):
            if Path(path).name == "optimizer.pt":
                Path(path).write_bytes(b"PK\x03\x04 half of it")
                raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1088 vs 980")
            return real_save(obj, path, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
    else:
        monkeypatch.setattr(checkpoint, "write_manifest",
                            lambda directory, step: _partial_then_enospc(directory / ".manifest.json.tmp-1"))
    trainer = _trainer(config, out, "resume=latest", "stop_at_step=3")
    with pytest.raises(CheckpointError) as exc:
        trainer.train()
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"checkpoint directory {root}: writing step 3 failed (rank 0: ")
    assert ("unexpected pos" if where == "torch.save" else "No space left on device") in message
    assert message.endswith("free space there (or lower save_total_limit), then resume=latest continues from it")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]
    assert resolve_resume("latest", out).name == "step-000002"


def test_disk_full_during_the_final_export_leaves_no_partial_final(setup, tmp_path, monkeypatch):
    """ENOSPC while the weights are written: one line naming final/ and how to export again, no partial directory;
    resume=latest then exports."""
    import transformers.modeling_utils

    _, config, _ = setup
    out = tmp_path / "run"
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        lambda state, filename, metadata=None: _partial_then_enospc(filename))
    trainer = _trainer(config, out, "max_steps=2")
    with pytest.raises(CheckpointError) as exc:
        trainer.train()
    assert str(exc.value) == (
        f"export directory {out / 'final'}: writing the model failed (OSError: [Errno 28] No space left on device); "
        f"the partial {str(exc.value).split('the partial ')[1].split(' ')[0]} was removed. Free space there, then run "
        "the same command with resume=latest: it resumes at the last step and exports again")
    assert sorted(p.name for p in out.iterdir() if "final" in p.name) == []
    monkeypatch.undo()
    _run(config, out, "max_steps=2", "resume=latest")
    assert (out / "final" / "model.safetensors").is_file()


def test_exported_files_follow_the_umask(setup, tmp_path):
    """final/model.safetensors used to be 0600 (safetensors' own mode) next to 0644 files."""
    _, config, _ = setup
    out = tmp_path / "run"
    _run(config, out, "max_steps=1", f"tokenizer_path={ROOT / 'data/example/tokenizer'}")
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (out / "final").iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_deepspeed_checkpoint_files_run_no_code(setup, tmp_path):
    """DeepSpeed unpickles ds/*.pt without restriction: a pickle planted there, with the manifest
    re-sealed, ran. Its files are read with weights_only=True semantics (plus DeepSpeed's own few classes)."""
    import shutil

    _, config, _ = setup
    out = tmp_path / "run"
    _run(config, out, "stop_at_step=2", "deepspeed.stage=2")
    clean = tmp_path / "clean"
    shutil.copytree(out, clean)
    assert _run(config, clean, "resume=latest", "stop_at_step=3", "deepspeed.stage=2").step == 3  # its own files load
    step = checkpoint_root(out) / "step-000002"
    marker = tmp_path / "pwned"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        state = torch.load(step / "ds" / name, weights_only=False)  # DeepSpeed's own file, just written
        torch.save({**state, "planted": _Payload(marker)}, step / "ds" / name)
    write_manifest(step, 2)
    with pytest.raises(CheckpointError, match=re.escape(f"{step / 'ds' / 'mp_rank_00_model_states.pt'}: refused to load")):
        _trainer(config, out, "resume=latest", "deepspeed.stage=2")
    assert not marker.exists()
