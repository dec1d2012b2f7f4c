"""Evaluation: the data pipeline's eval split beside data_path is evaluated by default (after the last step, and
every eval_steps), overall and per category, on the console, in log.jsonl, TensorBoard and loss.png."""
from __future__ import annotations

import pytest

from common.config import ConfigError
from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.config.sections import load_config
from train.preflight import eval_path, preflight
from train.metrics import loss_curves, read_log, step_progress


@pytest.fixture(scope="module")
def pipeline_output(tmp_path_factory):
    """`<out>/packed` and `<out>/eval/packed`, as sh data_process.sh with eval_size writes them."""
    out = tmp_path_factory.mktemp("eval") / "out"
    write_packed(out / "packed", random_rows(0, 6, seqs_per_row=2))
    write_packed(out / "eval" / "packed", random_rows(1, 3, seqs_per_row=2))
    return out


def _config(tmp_path, pipeline_output, **values):
    model = save_tiny_model(tmp_path / "model")
    return write_config(tmp_path / "c.yaml", data_path=str(pipeline_output / "packed"), model_path=str(model),
                        output_dir=str(tmp_path / "run"), lr=1e-3, loss_chunk_size=16, **values)


def test_eval_split_beside_data_path_is_found_and_can_be_turned_off(tmp_path, pipeline_output):
    config = _config(tmp_path, pipeline_output)
    assert eval_path(load_config(config)) == str(pipeline_output / "eval" / "packed")
    assert eval_path(load_config(config, ["eval_data_path=none"])) is None
    own = str(pipeline_output / "packed")
    assert eval_path(load_config(config, [f"eval_data_path={own}"])) == own
    alone = write_packed(tmp_path / "alone" / "packed", random_rows(2, 2))
    cfg = load_config(config, [f"data_path={alone}", "eval_steps=2"])
    assert eval_path(cfg) is None
    with pytest.raises(ConfigError, match="no eval split beside data_path .*alone/eval/packed.*eval_size"):
        preflight(cfg)


def test_trainer_evaluates_every_eval_steps_and_after_the_last_step(tmp_path, pipeline_output, one_thread):
    from train.trainer import Trainer

    config = _config(tmp_path, pipeline_output, max_steps=3, eval_steps=2, log_backends=["tensorboard"])
    lines = []
    trainer = Trainer(load_config(config), console=lines.append)
    records = trainer.train()
    assert [("eval_loss" in r) for r in records] == [False, True, True]  # step 2 (eval_steps), step 3 (the end)
    for record in records[1:]:
        assert 0 < record["eval_loss"] < 10
        assert set(record["eval_category_loss"]) == {"math", "chat"}
    assert read_log(tmp_path / "run")[-1]["eval_category_loss"] == records[-1]["eval_category_loss"]
    assert any(line.startswith(f"evaluating {pipeline_output / 'eval' / 'packed'} after step 3 and every 2 steps")
               for line in lines)
    step_lines = [line for line in lines if line.startswith("step=")]
    assert "eval_loss=" in step_lines[1] and "eval_category_loss={" in step_lines[1]
    # not a terminal: each step line ends with step/total, elapsed and ETA
    assert step_lines[0].endswith("]") and "[1/3, elapsed 0:00:" in step_lines[0] and ", eta 0:" in step_lines[0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert {"eval_loss", "eval_category_loss/math"} <= set(events.Tags()["scalars"])
    curves = loss_curves(read_log(tmp_path / "run"))
    assert curves["eval_loss"][0] == [2, 3] and curves["eval_category"]["math"][0] == [2, 3]
    assert curves["tokens_seen"][1][-1] == sum(r["tokens"] for r in records)


def test_eval_set_removed_during_the_run_is_still_evaluated(tmp_path, pipeline_output, one_thread):
    """The eval set is opened and checked at start and held: deleting its folder after step 1 changes nothing,
    every announced evaluation runs on the rows checked at start (the same losses as an undisturbed run)."""
    import shutil

    from train.trainer import Trainer

    out = tmp_path / "out"
    shutil.copytree(pipeline_output, out)
    config = _config(tmp_path, out, max_steps=2, eval_steps=1)
    undisturbed = Trainer(load_config(config, [f"output_dir={tmp_path / 'undisturbed'}"]), console=lambda *_: None)
    expected = [r["eval_loss"] for r in undisturbed.train()]

    lines = []
    trainer = Trainer(load_config(config), console=lines.append)
    trainer.grad_hook = lambda _: shutil.rmtree(out / "eval", ignore_errors=True)  # gone before step 1 evaluates
    records = trainer.train()
    assert not (out / "eval").exists()
    assert any(line.startswith(f"evaluating {out / 'eval' / 'packed'} after step 2 and every 1 steps")
               for line in lines)
    assert [r.get("eval_loss") for r in records] == expected
    assert [r.get("eval_loss") for r in read_log(tmp_path / "run")] == expected


def test_step_progress_text():
    assert step_progress(3, 10, 0, 30.0) == "[3/10, elapsed 0:00:30, eta 0:01:10]"
    assert step_progress(12, 20, 10, 4000.0) == "[12/20, elapsed 1:06:40, eta 4:26:40]"  # resumed at step 10


def test_evaluation_shows_its_progress(tmp_path, pipeline_output, one_thread, monkeypatch):
    """A pass over the eval set takes minutes on a large one: a line when it starts, then one every
    EVAL_PROGRESS_EVERY_S seconds (0 here: after every row) and at the end."""
    import train.metrics
    from train.trainer import Trainer

    monkeypatch.setattr(train.metrics, "EVAL_PROGRESS_EVERY_S", 0.0)
    config = _config(tmp_path, pipeline_output, max_steps=1)
    lines = []
    Trainer(load_config(config), console=lines.append).train()
    progress = [line for line in lines if line.startswith("evaluating: ")]
    assert [line.split(" [")[0] for line in progress] == [f"evaluating: {n}/3 rows" for n in range(4)]
    assert progress[-1].endswith(", eta 0:00:00]") and "[elapsed 0:00:" in progress[-1]
