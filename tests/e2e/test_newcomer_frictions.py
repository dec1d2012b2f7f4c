"""Frictions of a first run: the command line wins over the YAML's model source, a bad override value names the
override, other tools' key names get our key, relative paths name their directory, sequences longer than the
model's positions are a warning, stats.png and loss.png say what they show."""
from __future__ import annotations

import logging
import os

import numpy as np
import orjson
import pytest

from common.config import ConfigError
from tests._train_helpers import VOCAB, random_rows, save_tiny_model, write_config, write_packed
from tests.conftest import ROOT
from train.config.sections import load_config
from train.preflight import preflight


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frictions")
    data = write_packed(tmp / "data", random_rows(0, 2, min_len=20, max_len=24))
    model = save_tiny_model(tmp / "model")
    return tmp, data, model


def _model_config(path, max_positions: int):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=max_positions).to_json_file(path)
    return path


def test_a_model_source_on_the_command_line_replaces_the_yaml_one(setup, tmp_path, caplog):
    tmp, data, model = setup
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_config=str(_model_config(
        tmp_path / "m.json", 512)), output_dir=str(tmp_path / "out"))
    with caplog.at_level(logging.INFO, logger="train.config.sections"):
        cfg = load_config(config, [f"model_path={model}"])
    assert cfg.model.model_path == str(model) and cfg.model.model_config is None
    preflight(cfg)
    assert [r.getMessage() for r in caplog.records] == [
        f"override 'model_path={model}' replaces model_config: {tmp_path / 'm.json'} of config file {config}"]
    both = write_config(tmp_path / "both.yaml", data_path=str(data), model_path=str(model),
                        model_config=str(tmp_path / "m.json"), output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=f"exactly one of model_path .* must be set; config file {both} sets both"):
        load_config(both)


def test_a_bad_override_value_names_the_override_and_file_values_the_file(setup, tmp_path):
    tmp, data, model = setup
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model),
                          output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"^override 'loss_reduction=avg': loss_reduction: 'avg' is not one of \['token'"):
        load_config(config, ["loss_reduction=avg"])
    with pytest.raises(ConfigError, match=r"^override 'deepspeed.stage=4': deepspeed.stage: 4 is not one of"):
        load_config(config, ["deepspeed.stage=4"])
    bad = write_config(tmp_path / "bad.yaml", data_path=str(data), model_path=str(model),
                       output_dir=str(tmp_path / "out"), loss_reduction="avg")
    with pytest.raises(ConfigError, match=rf"^{bad}.loss_reduction: 'avg' is not one of"):
        load_config(bad)


def test_other_tools_key_names_suggest_ours(setup, tmp_path):
    tmp, data, model = setup
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model),
                          output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"override 'learning_rate=1e-4': unknown key 'learning_rate'; did you mean "
                                          r"'lr'\?"):
        load_config(config, ["learning_rate=1e-4"])
    with pytest.raises(ConfigError, match=r"unknown key 'gradient_accumulation_steps'; did you mean 'grad_accum'"):
        load_config(config, ["gradient_accumulation_steps=4"])

    from data.config import load_config as load_data_config

    data_config = tmp_path / "d.json"
    data_config.write_bytes(orjson.dumps({"inputs": [{"path": "x.jsonl"}], "output_dir": "o", "tokenizer_path": "t",
                                          "max_seq_length": 4096}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_seq_length'\]; did you mean 'max_length'\?"):
        load_data_config(data_config)
    data_config.write_bytes(orjson.dumps({"inputs": [{"path": "x.jsonl"}], "output_dir": "o", "tokenizer_path": "t"}))
    with pytest.raises(ConfigError, match=r"^override 'merge.probabilty=0.5': unknown key 'merge.probabilty'; did you "
                                          r"mean 'merge.probability'\?"):
        load_data_config(data_config, ["merge.probabilty=0.5"])
    with pytest.raises(ConfigError, match=r"^override 'seed=abc': seed: expected an integer, got 'abc'"):
        load_data_config(data_config, ["seed=abc"])


def test_relative_paths_in_errors_name_the_directory_they_were_resolved_against(setup, tmp_path, monkeypatch):
    tmp, data, model = setup
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path / "c.yaml", data_path="outputs/packed", model_path=str(model),
                          output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=f"data_path: outputs/packed is not a directory .*\\(outputs/packed is "
                                          f"relative to the current directory {tmp_path}\\)"):
        preflight(load_config(config))
    with pytest.raises(ConfigError, match=f"config file nope.yaml does not exist \\(nope.yaml is relative to the "
                                          f"current directory {tmp_path}\\)"):
        load_config("nope.yaml")
    from data.config import load_config as load_data_config

    data_config = tmp_path / "d.json"
    data_config.write_bytes(orjson.dumps({"inputs": [{"path": "raw/*.jsonl"}], "output_dir": "o",
                                          "tokenizer_path": str(ROOT / "data/example/tokenizer")}))
    with pytest.raises(ConfigError, match=f"inputs\\[0\\].path: no file matches 'raw/\\*.jsonl' \\(raw/\\*.jsonl is "
                                          f"relative to the current directory {tmp_path}\\)"):
        load_data_config(data_config).validate()
    assert os.getcwd() == str(tmp_path)


def test_sequences_longer_than_the_model_positions_are_a_warning(setup, tmp_path, caplog):
    tmp, data, _ = setup
    longest = int(max(len(seq["input_ids"]) for row in random_rows(0, 2, min_len=20, max_len=24) for seq in row))
    for max_positions, warned in ((512, False), (16, True)):
        config = write_config(tmp_path / "c.yaml", data_path=str(data), output_dir=str(tmp_path / "out"),
                              model_config=str(_model_config(tmp_path / f"m{max_positions}.json", max_positions)))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="train.config.sections"):
            preflight(load_config(config))
        messages = [r.getMessage() for r in caplog.records]
        assert bool(messages) == warned
    assert messages[0].startswith(f"data_path: the longest sequence of {data} has {longest} tokens, more than "
                                  "max_position_embeddings=16 of model_config=")


def test_stats_png_shows_lengths_per_category_and_what_tokenize_dropped(tmp_path):
    from data.stats import Counts, category_counts, pack_statistics, stats_figure

    lengths = category_counts(np.array([5, 7, 9, 40]), np.array([1, 1, 3, 3]))
    rows = Counts.of([12, 9, 40])
    stats = pack_statistics(lengths, rows, Counts.of([2, 1, 1]), 64, {1: 12, 3: 49}, {1: 3, 3: 6},
                            {1: "math", 3: "chat"})
    assert stats["categories"][3]["sequence_length"] == {"min": 9, "mean": 24.5, "median": 24.5, "max": 40}
    fig = stats_figure(lengths, rows, 64, stats["categories"],
                       {"dropped": {"overlong": 3, "bad_label": 1}, "truncated": 2})
    lengths_ax = fig.axes[0]
    assert lengths_ax.get_title() == "4 sequences\ndropped in tokenize: overlong 3, bad_label 1; truncated 2"
    assert [t.get_text() for t in lengths_ax.get_legend().get_texts()] == ["all", "1:math", "3:chat", "max_length 64"]


def test_pack_writes_per_category_lengths_and_tokenize_losses_to_stats(tmp_path):
    from data import pipeline

    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    for spec in raw["inputs"]:
        spec["path"] = str(ROOT / spec["path"])
    raw.update(output_dir=str(tmp_path / "out"), tokenizer_path=str(ROOT / raw["tokenizer_path"]),
               ratio_path=str(tmp_path / "ratios.json"), num_workers=1, max_length=200, overlong="truncate",
               merge={"probability": 0.0})
    (tmp_path / "c.json").write_bytes(orjson.dumps(raw))
    pipeline.main([str(tmp_path / "c.json")])
    stats = orjson.loads((tmp_path / "out" / "packed" / "stats.json").read_bytes())
    tokenize = orjson.loads((tmp_path / "out" / "report.json").read_bytes())["tokenize"]
    assert stats["tokenize"] == {"dropped": tokenize["dropped"], "truncated": tokenize["truncated"]}
    assert stats["tokenize"]["truncated"] > 0
    assert {c["name"] for c in stats["categories"].values() if c["sequence_length"]["max"] > 0} == \
        {"math", "code", "chat", "tools"}


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


def _hub_snapshot(cache, repo: str, source_dir) -> None:
    """A Hugging Face cache entry of `repo` (models--org--name/snapshots/<rev>, refs/main) holding the files of
    `source_dir`, as `hf download` leaves it."""
    import shutil

    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / "0"
    snapshot.mkdir(parents=True)
    for f in source_dir.iterdir():
        shutil.copy(f, snapshot / f.name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0")


def test_data_tokenizer_path_takes_a_hub_id_from_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from common.config import pretrained_dir
    from data.config import check_tokenizer_dir

    pretrained_dir.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _hub_snapshot(tmp_path / "hub", "example-org/example-tokenizer", ROOT / "data" / "example" / "tokenizer")
    resolved = check_tokenizer_dir("example-org/example-tokenizer")
    assert resolved.is_dir() and (resolved / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match=r"unreachable \(HF_HUB_OFFLINE=1\).*hf download example-org/missing"):
        check_tokenizer_dir("example-org/missing")
    pretrained_dir.cache_clear()
