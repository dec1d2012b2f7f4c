"""What output_dir already holds: starting over removes only PackSFT's own checkpoints, links are never followed,
and a log.jsonl that is not PackSFT's log is refused, never overwritten."""
from __future__ import annotations

import os
import re

import pytest

from common.config import ConfigError
from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.checkpoint import checkpoint_root
from train.config.sections import load_config
from train.preflight import preflight
from train.metrics import read_log
from train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outdir")
    data = write_packed(tmp / "data", random_rows(5, 4, seqs_per_row=2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=2, lr=1e-3,
                          loss_chunk_size=16, save_steps=1, save_total_limit=2, plot=False,
                          output_dir=str(tmp / "unused"))
    return tmp, config


def _train(config, out, *overrides) -> Trainer:
    trainer = Trainer(load_config(config, [f"output_dir={out}", *overrides]), console=lambda *_: None)
    trainer.train()
    return trainer


def test_overwrite_output_dir_removes_only_packsft_checkpoints(setup, tmp_path):
    _, config = setup
    out = tmp_path / "run"
    _train(config, out)
    root = checkpoint_root(out)
    foreign = root / "other_project" / "model.bin"
    foreign.parent.mkdir()
    foreign.write_bytes(b"weights of another project")
    notes = root / "notes.txt"
    notes.write_text("mine")

    _train(config, out, "max_steps=1", "overwrite_output_dir=true")
    assert foreign.read_bytes() == b"weights of another project" and notes.read_text() == "mine"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000001"]  # the new run's only
    assert (root / "latest").read_text() == "step-000001"
    assert [r["step"] for r in read_log(out)] == [1]


def test_overwrite_refuses_a_step_directory_that_packsft_did_not_write(setup, tmp_path):
    """A `step-N/` without PackSFT's manifest, or with files its manifest does not list, is not removed (and not
    silently replaced by the new run's step N): the run stops naming it."""
    _, config = setup
    out = tmp_path / "run"
    _train(config, out)
    root = checkpoint_root(out)
    extra = root / "step-000002" / "my_eval.json"
    extra.write_text("{}")
    cfg = load_config(config, [f"output_dir={out}", "overwrite_output_dir=true"])
    with pytest.raises(ConfigError, match=re.escape(f"{root / 'step-000002'} is not a checkpoint PackSFT wrote "
                                                    "(my_eval.json is not in its manifest.json)")):
        preflight(cfg)
    hand_made = root / "step-000007"
    hand_made.mkdir()
    (hand_made / "model.bin").write_bytes(b"x")
    extra.unlink()
    with pytest.raises(ConfigError, match=re.escape(f"{hand_made} is not a checkpoint PackSFT wrote (no "
                                                    "manifest.json)")):
        preflight(cfg)
    assert (hand_made / "model.bin").read_bytes() == b"x" and (root / "step-000002").is_dir()


@pytest.mark.parametrize("name", ["checkpoints", "tensorboard", "final"])
def test_an_output_subfolder_that_is_a_link_is_refused_naming_it(setup, tmp_path, name):
    _, config = setup
    out = tmp_path / "run"
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "data.bin").write_bytes(b"precious")
    out.mkdir()
    os.symlink(outside, out / name)
    for overrides in ([], ["overwrite_output_dir=true"]):
        cfg = load_config(config, [f"output_dir={out}", *overrides])
        with pytest.raises(ConfigError, match=re.escape(f"output_dir: {out / name} is a symbolic link to {outside}")):
            preflight(cfg)
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    assert (outside / "keep" / "data.bin").read_bytes() == b"precious"


def test_a_link_inside_checkpoints_is_refused_naming_it(setup, tmp_path):
    _, config = setup
    out = tmp_path / "run"
    _train(config, out)
    root = checkpoint_root(out)
    outside = tmp_path / "elsewhere"
    (root / "step-000002").rename(outside)
    os.symlink(outside, root / "step-000002")
    cfg = load_config(config, [f"output_dir={out}", "resume=latest", "max_steps=3"])
    with pytest.raises(ConfigError, match=re.escape(f"output_dir: {root / 'step-000002'} is a symbolic link to "
                                                    f"{outside}")):
        preflight(cfg)


def test_a_log_jsonl_that_is_not_json_is_refused_naming_the_file_and_line(setup, tmp_path):
    _, config = setup
    out = tmp_path / "run"
    out.mkdir()
    log = out / "log.jsonl"
    content = b'{"step": 1}\nthis is my lab notebook\n'
    log.write_bytes(content)
    cfg = load_config(config, [f"output_dir={out}"])
    with pytest.raises(ConfigError, match=re.escape(f"{log}:2: not a JSON object") + ".*move it out of output_dir"):
        preflight(cfg)
    with pytest.raises(ConfigError, match=re.escape(f"{log}:2: not a JSON object")):
        read_log(out)
    assert log.read_bytes() == content  # nothing lost


def test_a_torn_last_log_line_of_a_killed_run_is_dropped_with_a_warning(tmp_path, caplog):
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # killed in the middle of writing step 2
    with caplog.at_level("WARNING"):
        assert read_log(tmp_path) == [{"step": 1, "loss": 2.0}]
    assert f"{log}:2: an incomplete last line" in caplog.text


def test_rotation_removes_only_packsft_checkpoints(setup, tmp_path):
    """save_total_limit prunes the oldest checkpoints: a `step-N/` PackSFT did not write is not one of them."""
    _, config = setup
    out = tmp_path / "run"
    _train(config, out, "max_steps=3", "stop_at_step=2")
    root = checkpoint_root(out)
    foreign = root / "step-000000" / "notes.txt"
    foreign.parent.mkdir()
    foreign.write_text("mine")
    _train(config, out, "max_steps=3", "resume=latest")
    assert foreign.read_text() == "mine"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000", "step-000002", "step-000003"]
