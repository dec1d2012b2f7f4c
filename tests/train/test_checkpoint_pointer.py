"""The `checkpoints/latest` pointer and the manifest as a hostile or careless hand leaves them: a pointer that names a
path outside this run's checkpoints/ is refused before anything loads; an empty, mistyped or FIFO pointer is warned
about and resume=latest falls back to the newest complete checkpoint; a manifest entry of the wrong shape is one
`checkpoint error:` line naming the file."""
from __future__ import annotations

import logging
import os
import shutil
import threading

import orjson
import pytest

from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.__main__ import main
import train.checkpoint as checkpoint
from train.checkpoint import CheckpointError, checkpoint_root
from train.config.sections import load_config
from train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 8 steps saving every 2 (step-000004, -06, -08 kept), and its config."""
    import torch

    tmp = tmp_path_factory.mktemp("pointer")
    data = write_packed(tmp / "data", random_rows(3, 8, seqs_per_row=2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=8, lr=3e-3,
                          grad_accum=1, loss_chunk_size=16, save_steps=2, save_total_limit=3, plot=False,
                          self_check=False, log_backends=[], output_dir=str(tmp / "unused"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp / "run"
    Trainer(load_config(config, [f"output_dir={run}"]), console=lambda *_: None).train()
    torch.set_num_threads(before)
    return config, run


def _copy(run, tmp_path, name="run"):
    out = tmp_path / name
    shutil.copytree(run, out)
    return out


def _resumed_step(config, out) -> int:
    return Trainer(load_config(config, [f"output_dir={out}", "resume=latest"]), console=lambda *_: None).step


@pytest.mark.parametrize("text", ["../../../other/checkpoints/step-000008", "ABSOLUTE"])
def test_a_pointer_to_another_runs_checkpoint_is_refused_before_anything_loads(trained, tmp_path, capsys, text):
    config, run = trained
    other = _copy(run, tmp_path / "a" / "b", "other")  # another run's complete checkpoints
    out = _copy(run, tmp_path / "a" / "b" / "c", "run")
    pointer = checkpoint_root(out) / "latest"
    target = str(checkpoint_root(other) / "step-000008") if text == "ABSOLUTE" else text
    pointer.write_text(target)
    assert (pointer.parent / target).resolve() == (checkpoint_root(other) / "step-000008").resolve()
    # what `sh train.sh` runs first (load_config + preflight, before accelerate starts a process)
    assert main(["--launch", str(config), f"output_dir={out}", "resume=latest"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: resume=latest: {pointer} names {target!r}, a path, not a checkpoint of "
                          "this run"), err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="a path, not a checkpoint of this run"):
        checkpoint.latest_pointer(checkpoint_root(out))


def _fifo(pointer):
    pointer.unlink()
    os.mkfifo(pointer)


@pytest.mark.parametrize("damage,problem", [
    (lambda p: p.write_text(""), "empty"),
    (lambda p: p.write_text("step-6\n"), "names step-6, which is not a checkpoint directory in"),
    (lambda p: p.write_text("the newest"), "names 'the newest', which is not a checkpoint name (step-NNNNNN)"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "not text"),
    (_fifo, "not a regular file (a FIFO"),
], ids=["empty", "mistyped", "words", "binary", "fifo"])
def test_an_unusable_pointer_falls_back_to_the_newest_complete_checkpoint(trained, tmp_path, caplog, damage,
                                                                          problem):
    config, run = trained
    out = _copy(run, tmp_path)
    root = checkpoint_root(out)
    damage(root / "latest")
    result = {}
    worker = threading.Thread(target=lambda: result.update(step=_resumed_step(config, out)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="packsft.train"):
        worker.start()
        worker.join(timeout=300)
    if worker.is_alive():
        try:  # let a reader stuck on the FIFO go, then fail
            os.close(os.open(root / "latest", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        pytest.fail("resume=latest blocked on the pointer")
    assert result.get("step") == 8, caplog.text
    assert f"{root / 'latest'}" in caplog.text and problem in caplog.text, caplog.text
    assert "resuming from the newest complete checkpoint, step-000008" in caplog.text


@pytest.mark.parametrize("entry", [None, {"size": "big", "blake2b": "00"}, [1, 2], {"blake2b": "00"}],
                         ids=["null", "size-big", "list", "no-size"])
def test_a_malformed_manifest_entry_is_one_checkpoint_error_naming_the_file(trained, tmp_path, entry):
    config, run = trained
    out = _copy(run, tmp_path)
    step = checkpoint_root(out) / "step-000008"
    manifest = step / "manifest.json"
    data = orjson.loads(manifest.read_bytes())
    data["files"]["trainer_state.json"] = entry
    manifest.write_bytes(orjson.dumps(data))
    with pytest.raises(CheckpointError) as caught:
        Trainer(load_config(config, [f"output_dir={out}", "resume=latest", "resume_corrupt=error"]),
                console=lambda *_: None)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {step} is not usable: {manifest}: the entry of 'trainer_state.json' "
                              f"is {orjson.dumps(entry).decode()}, not "), message
    # the default (resume_corrupt=fallback) resumes from the checkpoint before it
    assert _resumed_step(config, out) == 6


@pytest.mark.parametrize("override, needle", [
    ("grad_accum=2", "the global batch is 2 rows per step here (dp 1 x grad_accum 2 x micro_batch_rows 1), but the "
                     "checkpoint was saved with 1 rows per step"),
    ("max_steps=10", "max_steps=10 (10 steps), but the checkpoint was saved with max_steps=8 (8 steps; another lr "
                     "schedule)"),
    ("lora_rank=4", "the model is not the one the checkpoint was trained as"),
], ids=["global-batch", "steps", "lora"])
def test_a_resume_the_checkpoint_refuses_is_refused_by_the_launcher(trained, tmp_path, capsys, override, needle):
    """`sh train.sh … resume=latest` with another global batch, step count or model than the checkpoint's: the
    launcher's start-up checks read its trainer_state.json and refuse before any process starts. Before: a
    `checkpoint error:` after the model had loaded and the self-check had run (28 s on a loaded 2-core machine)."""
    config, run = trained
    out = _copy(run, tmp_path)
    assert main(["--launch", str(config), f"output_dir={out}", "resume=latest", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: resume from {checkpoint_root(out) / 'step-000008'}: ") and needle in err, err
    assert len(err.strip().splitlines()) == 1
