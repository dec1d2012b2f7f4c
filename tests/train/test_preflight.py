"""The start-up checks that read something (train/preflight.py), before any weight loads: the data's token ids
against the model's vocabulary (a hand-edited manifest cannot hide one), data without a loss token, the tokenizer
(its hash, the one exported with a pretrained model, one that does not exist from where training runs), sequences
longer than the model's positions, model and tokenizer given as Hugging Face Hub ids (offline: a clear error; in the
cache: they train), and own data on the example config: the error names the keys to set, and the config it advises
trains on the CPU."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from common.config import ConfigError
from tests._train_helpers import ROOT, random_rows, save_tiny_model, write_config, write_packed
from tests._train_helpers import one_thread  # noqa: F401  (a fixture)
from tests.conftest import fixture_path, tokenizer_dir
from tests.train.config.test_sections import _model_config, data_and_model, setup  # noqa: F401  (fixtures)
from train.config.sections import load_config
from train.preflight import preflight


def test_token_ids_must_fit_the_vocabulary(setup):
    tmp, config = setup
    rows = random_rows(1, 1)
    rows[0][0]["input_ids"][3] = 500  # the tiny model's vocabulary is 97
    write_packed(tmp / "big_ids", rows)
    cfg = load_config(config, [f"data_path={tmp / 'big_ids'}"])
    with pytest.raises(ConfigError, match=r"data_path: token id 500 .* \(vocab_size=97\)"):
        preflight(cfg)


def test_hand_edited_manifest_cannot_hide_token_ids_outside_the_vocabulary(setup):
    """meta.json's max_token_id lowered by hand used to pass the vocabulary check (IndexError at step 1): the
    manifest carries its own checksum, and a manifest without one (an older dataset) is not trusted for the maximum."""
    import orjson

    from data.shards.dataset import MANIFEST_CHECKSUM

    tmp, config = setup
    rows = random_rows(1, 1)
    rows[0][0]["input_ids"][3] = 500  # the tiny model's vocabulary is 97
    data = write_packed(tmp / "edited", rows)
    meta_file = data / "meta.json"
    meta = orjson.loads(meta_file.read_bytes())
    assert meta["max_token_id"] == 500
    meta["max_token_id"] = 96
    meta_file.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    cfg = load_config(config, [f"data_path={data}"])
    with pytest.raises(ConfigError, match=f"{meta_file}: manifest checksum mismatch: meta.json changed after it was "
                                          r"written .* re-create .*--stages pack"):
        preflight(cfg)
    del meta[MANIFEST_CHECKSUM]  # as written before manifests had a checksum: the token arrays decide
    meta_file.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    with pytest.raises(ConfigError, match=r"data_path: token id 500 .* \(vocab_size=97\)"):
        preflight(cfg)


def test_data_without_loss_tokens_is_refused_before_step_1(setup):
    """Packed rows whose labels are all -100 would train steps of loss 0 and export the initial weights, exit 0."""
    from tests._train_helpers import untrained_sequence

    tmp, config = setup
    rng = np.random.default_rng(3)
    data = write_packed(tmp / "no_loss", [[untrained_sequence(rng, 12), untrained_sequence(rng, 7)]])
    cfg = load_config(config, [f"data_path={data}"])
    with pytest.raises(ConfigError, match=f"data_path: {data} has no loss token"):
        preflight(cfg)
    cfg = load_config(config, [f"eval_data_path={data}"])
    with pytest.raises(ConfigError, match=f"eval_data_path: {data} has no loss token"):
        preflight(cfg)


def test_tokenizer_hash_mismatch_error_or_warning(setup, caplog):
    tmp, config = setup
    tok = tmp / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text('{"model": "a"}')
    write_packed(tmp / "hashed", random_rows(2, 1), {"tokenizer": {"path": str(tok), "hash": "0" * 64}})
    cfg = load_config(config, [f"data_path={tmp / 'hashed'}", f"tokenizer_path={tok}"])
    with pytest.raises(ConfigError, match="tokenizer hash"):
        preflight(cfg)
    cfg = load_config(config, [f"data_path={tmp / 'hashed'}", f"tokenizer_path={tok}", "tokenizer_mismatch=warn"])
    with caplog.at_level(logging.WARNING):
        preflight(cfg)
    assert "tokenizer hash" in caplog.text


def test_missing_export_tokenizer_is_an_error_at_start(setup, monkeypatch):
    """Shards whose meta.json names a tokenizer (relative, as older pipelines wrote it) that does not exist from
    where training runs: an error before the model loads, not a warning after the last step and a final/ without
    its tokenizer."""
    from tests._train_helpers import ROOT

    tmp, config = setup
    data = write_packed(tmp / "relative_tok", random_rows(4, 1), {"tokenizer_path": "data/example/tokenizer"})
    monkeypatch.chdir(tmp)
    cfg = load_config(config, [f"data_path={data}"])
    with pytest.raises(ConfigError, match=r"tokenizer_path: not set; model_path .* holds no tokenizer files, and the "
                       r"shards' meta.json names the tokenizer data/example/tokenizer, which does not exist \(a "
                       f"relative path, from {tmp} here\).*Set tokenizer_path"):
        preflight(cfg)
    preflight(load_config(config, [f"data_path={data}", f"tokenizer_path={ROOT / 'data/example/tokenizer'}"]))
    monkeypatch.chdir(ROOT)
    preflight(cfg)


def test_tokenizer_mismatch_with_a_pretrained_model_says_to_retokenize_the_data(setup, tmp_path):
    """A pretrained model's embeddings belong to the ids of its own tokenizer: exporting it with the data's tokenizer
    would not fix the ids it trained on, so the advice is to re-tokenize the data with the model's tokenizer."""
    import shutil

    from tests._train_helpers import ROOT

    _, config = setup
    model = save_tiny_model(tmp_path / "pretrained")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "data" / "example" / "tokenizer" / name, model / name)
    data_tok = tmp_path / "data_tok"
    data_tok.mkdir()
    (data_tok / "tokenizer.json").write_text('{"model": "b"}')
    write_packed(tmp_path / "data", random_rows(2, 1), {"tokenizer": {"path": str(data_tok), "hash": "0" * 64}})
    cfg = load_config(config, [f"data_path={tmp_path / 'data'}", f"model_path={model}"])
    with pytest.raises(ConfigError) as exc:
        preflight(cfg)
    message = str(exc.value)
    assert f"the tokenizer exported with the model, {model} (from model_path), has hash" in message
    assert (f"re-tokenize the data with the model's tokenizer: tokenizer_path: {model} in the data config, then "
            "sh data_process.sh again") in message
    assert "set tokenizer_path to the tokenizer the data was tokenized with" not in message


def test_sequences_longer_than_the_model_positions_are_a_warning(data_and_model, tmp_path, caplog):
    tmp, data, _ = data_and_model
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


def test_hub_id_offline_is_a_clear_error(setup):
    _, config = setup
    cfg = load_config(config, ["model_path=Qwen/Qwen2.5-0.5B-Instruct"])
    with pytest.raises(ConfigError, match=r"model_path: Qwen/Qwen2.5-0.5B-Instruct is not a local directory, and the "
                                          r"Hugging Face Hub is unreachable"):
        preflight(cfg)
    cfg = load_config(config, ["tokenizer_path=Qwen/Qwen2.5-0.5B-Instruct"])
    with pytest.raises(ConfigError, match=r"tokenizer_path: Qwen/Qwen2.5-0.5B-Instruct is not a local directory"):
        preflight(cfg)
    cfg = load_config(config, ["tokenizer_path=./no/such/dir"])
    with pytest.raises(ConfigError, match=r"tokenizer_path: ./no/such/dir does not exist"):
        preflight(cfg)


def _fake_hub_snapshot(cache, repo_id: str, source) -> None:
    """The Hugging Face cache layout (what `huggingface-cli download` leaves) holding `source`'s files."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(source, repo / "snapshots" / commit)


def test_hub_ids_train_from_the_cache(setup, tmp_path):
    """model_path and tokenizer_path given as Hub ids resolve through huggingface_hub (here its offline cache)."""
    tmp, config = setup
    cache = tmp_path / "hub"
    _fake_hub_snapshot(cache, "packsft-test/tiny-qwen2", tmp / "model")
    _fake_hub_snapshot(cache, "packsft-test/qwen-tokenizer", tokenizer_dir("qwen2_5_instruct"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "train", str(config), "model_path=packsft-test/tiny-qwen2",
         "tokenizer_path=packsft-test/qwen-tokenizer", "max_steps=1", "plot=false", f"output_dir={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "tokenizer_config.json").is_file()


# ---------------------------------------------------------------------------------------------- own data, real tokenizer
@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    """Packed GSM8K conversations tokenized with the Qwen2.5 tokenizer (as data_process.sh records it)."""
    import orjson
    from transformers import AutoTokenizer

    from common.fsutil import tokenizer_hash

    tok_dir = tokenizer_dir("qwen2_5_instruct")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    lines = fixture_path("data", "gsm8k_train.jsonl").read_bytes().splitlines()[:6]
    rows = []
    for line in lines:
        rec = orjson.loads(line)
        chat = [{"role": "user", "content": rec["question"]}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        full = tok.apply_chat_template(chat + [{"role": "assistant", "content": rec["answer"]}],
                                       tokenize=True)["input_ids"]
        ids = np.asarray(full, dtype=np.int32)
        labels = ids.copy()
        labels[: len(prompt)] = -100
        turns = (labels != -100).astype(np.int16)
        rows.append([{"input_ids": ids, "labels": labels, "category_ids": np.ones(len(ids), np.int16),
                      "turn_ids": turns}])
    path = tmp_path_factory.mktemp("qwen") / "packed"
    write_packed(path, rows, {"tokenizer_path": str(tok_dir), "tokenizer_hash": tokenizer_hash(tok_dir)})
    return path


def test_own_data_on_the_example_config_names_the_keys_to_set(qwen_data, tmp_path):
    cfg = load_config("configs/train/example.yaml", [f"data_path={qwen_data}", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as exc:
        preflight(cfg)
    message = str(exc.value)
    assert "does not fit the vocabulary of model_config=configs/model/tiny_qwen2.json (vocab_size=2048)" in message
    assert "Set model_path to a pretrained model of that tokenizer" in message
    assert "configs/train/qwen2_5_tiny.yaml" in message
    assert "set tokenizer_path to the tokenizer the data was tokenized with" in message
    assert "(from tokenizer_path)" in message


def test_qwen2_5_tiny_config_trains_on_cpu(qwen_data, tmp_path, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.metrics import read_log
    from train.trainer import Trainer

    out = tmp_path / "run"
    cfg = load_config("configs/train/qwen2_5_tiny.yaml", [f"data_path={qwen_data}", f"output_dir={out}",
                                                           "max_steps=2", "warmup_steps=1"])
    Trainer(cfg, console=lambda *_: None).train()
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2] and all(np.isfinite(r["loss"]) for r in log)
    assert log[0]["loss"] == pytest.approx(np.log(151936), abs=1.5)  # random init over the Qwen2.5 vocabulary
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert tok("<|im_end|>")["input_ids"] == [151645]
    assert AutoModelForCausalLM.from_pretrained(out / "final").config.vocab_size == 151936


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
