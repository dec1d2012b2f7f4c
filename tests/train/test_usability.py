"""The newcomer's first hour: --help, typo suggestions, bad floats, Hub ids, own data with a real tokenizer."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing

import numpy as np
import pytest

from common.config import ConfigError, field_help
from tests._train_helpers import ROOT, one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from tests.conftest import fixture_path, tokenizer_dir
from train.config.sections import FLAT_KEYS, SECTIONS, TrainConfig, load_config
from train.preflight import preflight


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("usability")
    data = write_packed(tmp / "data", random_rows(0, 2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), output_dir=str(tmp / "out"))
    return tmp, config


def _all_keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _all_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, hints[f.name], cls


def test_help_lists_every_key_with_type_default_and_help():
    """Every key under its section's line, by the name it may be written with alone (`lr`; `deepspeed.stage`)."""
    proc = subprocess.run(["sh", "train.sh", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for section in SECTIONS:
        assert any(line.startswith(f"{section}: ") for line in lines), section
    for dotted, _, cls in _all_keys(TrainConfig):
        section, name = dotted.split(".", 1)
        key = name if name in FLAT_KEYS else dotted
        heads = [i for i, line in enumerate(lines) if line.startswith(f"  {key} (")]
        assert len(heads) == 1, key
        assert field_help(cls)[key.rsplit(".", 1)[-1]], f"{key} has no help comment in train/config/sections.py"
        assert lines[heads[0] + 1].strip(), key
    assert "  lr (float, default 1.0e-05)" in lines
    assert "  loss_reduction (token|turn|sample, default token)" in lines
    assert "  deepspeed.stage (0|1|2|3|null, default null)" in lines
    assert "  data_path (str, default required)" in lines


def test_unknown_key_names_its_origin_and_the_closest_key(setup, tmp_path):
    _, config = setup
    with pytest.raises(ConfigError, match=r"override 'max_step=3': unknown key 'max_step'; did you mean 'max_steps'\?"):
        load_config(config, ["max_step=3"])
    with pytest.raises(ConfigError, match=r"override 'deepspeed.stag=2': unknown key 'deepspeed.stag'; did you mean "
                                          r"'deepspeed.stage'\?"):
        load_config(config, ["deepspeed.stag=2"])
    typo = tmp_path / "typo.yaml"
    typo.write_text(config.read_text() + "warmup_step: 3\n")
    with pytest.raises(ConfigError, match=rf"config file {typo}: unknown key 'warmup_step'; did you mean 'warmup_steps'"):
        load_config(typo)
    with pytest.raises(ConfigError, match="unknown key 'frobnicate' \\(sh train.sh --help lists every key\\)"):
        load_config(config, ["frobnicate=1"])
    load_config(config, ["deepspeed.overrides.zero_optimization.overlap_comm=true"])  # free-form mapping


@pytest.mark.parametrize(
    "yaml_line,message",
    [
        ("lr: .nan", "lr must be a finite number, got nan"),
        ("lr: .inf", "lr must be a finite number, got inf"),
        ("adam_beta1: 1.5", "adam_beta1 must be in [0, 1), got 1.5"),
        ("adam_beta2: 1.0", "adam_beta2 must be in [0, 1), got 1.0"),
        ("adam_eps: -1", "adam_eps must be > 0, got -1.0"),
        ("weight_decay: -1", "weight_decay must be >= 0, got -1.0"),
        ("lora_dropout: 1.5", "lora_dropout must be in [0, 1), got 1.5"),
        ("lora_alpha: 0", "lora_alpha must be > 0, got 0.0"),
        ("max_grad_norm: -.inf", "max_grad_norm must be a finite number, got -inf"),
        ("warmup_ratio: 1.0", "warmup_ratio must be in [0, 1), got 1.0"),
        ("stop_at_step: 0", "stop_at_step must be >= 1 (or null), got 0"),
        ("launch: {machine_rank: 1}", "launch.machine_rank must be in [0, launch.num_machines=1), got 1"),
    ],
)
def test_bad_numbers_fail_before_launch(setup, tmp_path, yaml_line, message):
    _, config = setup
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text() + yaml_line + "\n")
    cfg = load_config(bad)
    with pytest.raises(ConfigError) as exc:
        cfg.validate()
    assert str(exc.value) == message


def test_train_sh_refuses_a_nan_lr_before_launching(tmp_path):
    proc = subprocess.run(["sh", "train.sh", "configs/train/example.yaml", "adam_beta1=1.5", f"output_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "config error: adam_beta1 must be in [0, 1), got 1.5" in proc.stderr


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
