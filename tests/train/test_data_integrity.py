"""verify_data: a corrupt byte in the packed shards stops training with the shard, the row and what to do."""
from __future__ import annotations

import numpy as np
import pytest

from common.config import ConfigError
from data.shards.dataset import PackedDataset, ShardFormatError
from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.config.sections import load_config
from train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "m")


def _corrupt_copy(tmp_path, field: str, row: int = 3):
    """A packed dataset of 6 rows with one bit of `field` flipped in token 2 of `row`."""
    data = write_packed(tmp_path / "data", random_rows(11, 6, seqs_per_row=2))
    ds = PackedDataset(data, verify="off")
    byte = (int(ds._rows[0][row]["token_offset"]) + 2) * ds.dtype.itemsize + ds.dtype.fields[field][1]
    f = data / "shard_00000.tokens.bin"
    raw = bytearray(f.read_bytes())
    raw[byte] ^= 0x01
    f.write_bytes(bytes(raw))
    return data


def _config(tmp_path, data, model, **extra):
    return write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model), num_epochs=1,
                        micro_batch_rows=2, lr=1e-3, plot=False, output_dir=str(tmp_path / "out"), **extra)


@pytest.mark.parametrize("field", ["input_ids", "labels", "turn_ids"])
def test_training_stops_on_a_corrupt_row(tmp_path, model, field):
    config = _config(tmp_path, _corrupt_copy(tmp_path, field), model)
    trainer = Trainer(load_config(config), console=lambda *_: None)  # default verify_data: rows
    assert trainer.dataset.verify == "rows"
    with pytest.raises(ShardFormatError, match=r"shard_00000\.tokens\.bin: row 3 \(row 3 of the shard\) is corrupt: "
                       r"crc32 .*re-create .*--stages pack"):
        trainer.train()


def test_verify_data_full_stops_before_training_and_off_reads_anyway(tmp_path, model):
    data = _corrupt_copy(tmp_path, "labels")
    with pytest.raises(ShardFormatError, match=r"shard_00000\.tokens\.bin: checksum mismatch"):
        Trainer(load_config(_config(tmp_path, data, model), ["verify_data=full"]), console=lambda *_: None)
    trainer = Trainer(load_config(_config(tmp_path, data, model), ["verify_data=off"]), console=lambda *_: None)
    assert trainer.dataset.verify == "off"
    assert np.asarray(trainer.dataset[3]["labels"]).shape[0] == trainer.dataset.row_n_tokens[3]


def test_verify_data_value_is_checked(tmp_path, model):
    with pytest.raises(ConfigError, match=r"verify_data: 'yes' is not one of \['full', 'rows', 'off'\]"):
        load_config(_config(tmp_path, tmp_path, model), ["verify_data=yes"])


def test_packed_data_the_pipeline_marked_stale_is_refused_naming_the_stage_to_re_run(tmp_path, capsys, caplog):
    """`sh data_process.sh` (every stage), then `--stages tokenize` alone: packed/ still holds the rows of the
    tokenized data before it (report.json lists pack under `stale`). Before: `sh train.sh` trained it, rc 0."""
    import logging

    from data import pipeline
    from tests._train_helpers import in_project_root
    from train.__main__ import main
    from train.preflight import preflight

    out = tmp_path / "example"
    common = ["configs/data/example.json", f"output_dir={out}", f"ratio_path={out / 'ratios.json'}"]
    with in_project_root():
        pipeline.main(common)
        pipeline.main([*common, "--stages", "tokenize"])
        capsys.readouterr()
        train = ["configs/train/example.yaml", f"data_path={out / 'packed'}", f"output_dir={tmp_path / 'train'}"]
        assert main(["--launch", *train]) == 2
        err = capsys.readouterr().err
        assert err == (f"config error: data_path: {out / 'packed'} is stale: the data pipeline ran an earlier stage "
                       f"after pack wrote it ({out / 'report.json'} lists pack under `stale`), so it does not hold "
                       "what that run made; re-run sh data_process.sh <your data config> --stages pack, or set "
                       "stale_data=warn to train on it as it is\n")
        with caplog.at_level(logging.WARNING):
            preflight(load_config(train[0], [*train[1:], "stale_data=warn"]))
        assert "(stale_data=warn: training on it as it is)" in caplog.text
        pipeline.main([*common, "--stages", "pack"])  # what it says to run: the data is current again
        preflight(load_config(train[0], train[1:]))
    assert not (tmp_path / "train").exists()
