"""Crafted FSDP2 (torch DCP) checkpoints: `.metadata` storage entries re-pointed at an absolute path, `../`, a link
leading outside, a FIFO, a file the manifest does not list, or bytes past a file's end are refused with one error
naming the path, before the path is opened (a FIFO would block the open: the tests hold an alarm). Through the CLI
(`python -m train`, as train.sh starts it), a crafted checkpoint is one line on stderr and exit code 1."""
from __future__ import annotations

import os
import pickle
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
import torch

from tests._train_helpers import random_rows, run_train, save_tiny_model, write_config, write_packed
from train.engines import dcp as dcp_checkpoint
from train.checkpoint import MANIFEST, CheckpointError, write_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process without a group

STATE = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)},
         "optimizer": {"param_groups": [{"lr": 0.5}]}}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(4)}, "optimizer": {"param_groups": [{"lr": 0.0}]}}


def _checkpoint(root: Path) -> Path:
    """A checkpoint directory as the FSDP2 engine writes it: dcp/ + manifest.json."""
    dcp_checkpoint.save(STATE, root / "dcp")
    write_manifest(root, 0)
    return root


def _repoint(root: Path, name: str, relist: bool = True) -> None:
    """Point every storage entry of root/dcp/.metadata at `name`; `relist`: rewrite the manifest too (a crafter
    can: the manifest is a checksum list, not a signature), so only the path checks stand in the way."""
    metadata = dcp_checkpoint.read_metadata(root / "dcp" / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = name
    (root / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    if relist:
        (root / MANIFEST).unlink()
        write_manifest(root, 0)


def _list(root: Path, name: str) -> None:
    """Add `name` to root's manifest (write_manifest lists regular files only)."""
    manifest = orjson.loads((root / MANIFEST).read_bytes())
    manifest["files"][name] = {"size": 0, "blake2b": "0" * 64}
    (root / MANIFEST).write_bytes(orjson.dumps(manifest))


@contextmanager
def _no_hang(seconds: int = 20):
    """An open() blocked on a FIFO raises here instead of hanging the test run."""
    def expire(*_):
        raise TimeoutError("the load blocked (it opened a FIFO)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _refused(root: Path, pattern: str) -> str:
    loaded = _empty()
    with _no_hang(), pytest.raises(CheckpointError, match=pattern) as info:
        dcp_checkpoint.load(loaded, root / "dcp")
    assert torch.equal(loaded["model"]["w"], torch.zeros(2, 3)), "weights were read before the refusal"
    message = str(info.value)
    assert "\n" not in message
    return message


def test_an_untouched_checkpoint_loads(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    loaded = _empty()
    dcp_checkpoint.load(loaded, root / "dcp")
    assert torch.equal(loaded["model"]["w"], STATE["model"]["w"])
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.5


def test_absolute_storage_path_is_refused(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    outside = tmp_path / "elsewhere" / "weights.distcp"
    outside.parent.mkdir()
    shutil.copy(root / "dcp" / "__0_0.distcp", outside)  # loadable weights no manifest covers
    _repoint(root, str(outside))
    message = _refused(root, "an absolute path")
    assert str(outside) in message


def test_absolute_fifo_is_refused_without_opening_it(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _repoint(root, str(fifo))
    assert str(fifo) in _refused(root, "an absolute path")


def test_parent_storage_path_is_refused(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    shutil.copy(root / "dcp" / "__0_0.distcp", tmp_path / "up.distcp")
    _repoint(root, "../../up.distcp")
    assert "../../up.distcp" in _refused(root, "leaves the checkpoint directory")


def test_link_leading_outside_is_refused(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(root / "dcp" / "__0_0.distcp", outside / "w.distcp")
    (root / "dcp" / "link.distcp").symlink_to(outside / "w.distcp")
    _repoint(root, "link.distcp")  # write_manifest follows the link: the manifest lists it
    assert "link.distcp" in _refused(root, "symbolic link")

    (root / "dcp" / "sub").symlink_to(outside, target_is_directory=True)  # a linked directory on the way
    _repoint(root, "sub/w.distcp")
    _list(root, "dcp/sub/w.distcp")
    assert str(root / "dcp" / "sub") in _refused(root, "symbolic link")


def test_fifo_inside_is_refused_without_opening_it(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    os.mkfifo(root / "dcp" / "pipe.distcp")
    _repoint(root, "pipe.distcp")
    _list(root, "dcp/pipe.distcp")  # even when the manifest lists it
    assert str(root / "dcp" / "pipe.distcp") in _refused(root, "not a regular file")


def test_file_the_manifest_does_not_list_is_refused(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    _repoint(root, "extra.distcp")
    shutil.copy(root / "dcp" / "__0_0.distcp", root / "dcp" / "extra.distcp")  # added after the manifest
    assert str(root / "dcp" / "extra.distcp") in _refused(root, "does not list")

    (root / MANIFEST).unlink()
    _refused(root, f"{MANIFEST}: missing")


def test_piece_past_the_end_of_its_file_is_refused(tmp_path):
    root = _checkpoint(tmp_path / "ck")
    metadata = dcp_checkpoint.read_metadata(root / "dcp" / ".metadata")
    info = next(iter(metadata.storage_data.values()))
    info.length = 1 << 40
    (root / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    _refused(root, "a file of")


def test_manifest_naming_files_outside_is_not_usable(tmp_path):
    """The trainer checks a checkpoint against its manifest first: names outside it are problems, not reads."""
    from train.checkpoint import verify_checkpoint

    root = _checkpoint(tmp_path / "ck")
    (tmp_path / "secret").write_text("x")
    manifest = orjson.loads((root / MANIFEST).read_bytes())
    manifest["files"][str(tmp_path / "secret")] = {"size": 1, "blake2b": "0" * 64}
    manifest["files"]["../secret"] = {"size": 1, "blake2b": "0" * 64}
    (root / MANIFEST).write_bytes(orjson.dumps(manifest))
    problems = verify_checkpoint(root)
    assert len(problems) == 2 and all("not a path inside" in p for p in problems), problems


def test_fifo_or_link_the_manifest_does_not_list_makes_a_checkpoint_unusable(tmp_path):
    """The trainer reads scheduler.pt, trainer_state.json, rng/ by name: a FIFO there (not listed, so not hashed)
    would block the resume's open; a link may lead outside. choose_checkpoint refuses both, naming them."""
    from train.checkpoint import choose_checkpoint, verify_checkpoint

    root = _checkpoint(tmp_path / "ck")
    assert verify_checkpoint(root) == []
    os.mkfifo(root / "scheduler.pt")
    (root / "trainer_state.json").symlink_to(tmp_path / "elsewhere.json")
    with _no_hang():
        assert sorted(verify_checkpoint(root)) == [
            f"{root / 'scheduler.pt'}: not a regular file (a FIFO, socket or device; PackSFT writes none)",
            f"{root / 'trainer_state.json'}: a symbolic link (PackSFT writes none; it may lead outside the checkpoint)"]
        with pytest.raises(CheckpointError, match="scheduler.pt: not a regular file"):
            choose_checkpoint([root], "error")


# ---------------------------------------------------------------------------------------------- through the CLI
@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory):
    """One FSDP2 step in one process through `python -m train`, saved: (config, checkpoint directory)."""
    tmp = tmp_path_factory.mktemp("dcp_cli")
    data = write_packed(tmp / "data", random_rows(3, 2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=1, lr=1e-3,
                          plot=False, output_dir=str(tmp / "run"), distributed_backend="fsdp2", save_steps=1)
    run_train(config, [])
    return config, tmp / "run" / "checkpoints" / "step-000001"


def _cli_refusal(config: Path, checkpoint: Path, out: Path) -> str:
    with pytest.raises(AssertionError) as info:
        run_train(config, [f"output_dir={out}", f"resume={checkpoint}"])
    text = str(info.value)
    assert "failed (1)" in text, text
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("checkpoint error:")]
    assert len(errors) == 1, text
    assert not (out / "final").exists()
    return errors[0]


def test_cli_refuses_crafted_checkpoints_in_one_line(fsdp2_checkpoint, tmp_path):
    """An absolute storage path (weights from a file no manifest covers), then a pickle payload in .metadata:
    each `checkpoint error: <path>: ...`, one line, rc 1, nothing exported and the payload not run."""
    config, saved = fsdp2_checkpoint
    crafted = tmp_path / "step-000001"
    shutil.copytree(saved, crafted)
    outside = tmp_path / "weights.distcp"
    shutil.copy(crafted / "dcp" / "__0_0.distcp", outside)
    _repoint(crafted, str(outside))
    line = _cli_refusal(config, crafted, tmp_path / "out1")
    assert str(outside) in line and "an absolute path" in line, line

    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (crafted / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted()))
    (crafted / MANIFEST).unlink()
    write_manifest(crafted, 1)
    line = _cli_refusal(config, crafted, tmp_path / "out2")
    assert f"{crafted / 'dcp' / '.metadata'}: refused to load" in line, line
    assert not marker.exists()
