"""Trainer config: YAML + overrides, every invariant checked before the model loads with a clear message, the
DeepSpeed dict built in code."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from common.config import ConfigError
from tests._train_helpers import random_rows, save_tiny_model, write_config, write_packed
from train.config.sections import load_config
from train.preflight import preflight
from train.engines.deepspeed_config import build_deepspeed_config
from train.engines.schedule import lr_lambda_factory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg")
    data = write_packed(tmp / "data", random_rows(0, 2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), output_dir=str(tmp / "out"))
    return tmp, config


def test_yaml_and_overrides(setup):
    _, config = setup
    cfg = load_config(config, ["lr=3e-4", "deepspeed.stage=3", "deepspeed.offload_optimizer=true",
                               "log_backends=[\"tensorboard\"]", "launch.num_processes=4"])
    assert cfg.optim.lr == 3e-4 and cfg.deepspeed.stage == 3 and cfg.deepspeed.offload_optimizer
    assert cfg.logging.log_backends == ["tensorboard"] and cfg.launch.num_processes == 4
    preflight(cfg, world_size=4)


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["data_path=/nonexistent/packed"], 1, "data_path: /nonexistent/packed is not a directory"),
        (["model_path=/nonexistent/model"], 1, "model_path: /nonexistent/model does not exist"),
        # the override replaces the file's model_path (test_newcomer_frictions), then the path is checked
        (["model_config=x.json"], 1, "model_config: x.json does not exist (x.json is relative to the current directory"),
        (["sequence_parallel_size=2", "launch.num_processes=2"], 3, "world size 3 is not divisible by sequence_parallel_size=2"),
        (["sequence_parallel_size=2"], 2, "launch.num_processes=1 is not divisible"),
        (["grad_accum=0"], 1, "grad_accum must be >= 1"),
        (["min_lr_ratio=2"], 1, "min_lr_ratio must be in [0, 1]"),
        (["prefetch_micro_batches=-1"], 1, "prefetch_micro_batches must be in [0, 64] (0: built in the loop;"),
        (["prefetch_micro_batches=100000"], 1, "prefetch_micro_batches must be in [0, 64] (0: built in the loop;"),
        (["deepspeed.offload_param=true", "deepspeed.stage=2"], 1, "offload_param needs deepspeed.stage 3"),
        (["bf16=true"], 1, "bf16: true needs a GPU"),
        (["distributed_backend=fsdp2", "deepspeed.stage=2"], 1,
         "distributed_backend: fsdp2 shards the model with torch FSDP2, in place of DeepSpeed, and needs "
         "deepspeed.stage null (got 2)"),
        (["fsdp2.reshard_after_forward=false"], 1,
         "fsdp2.reshard_after_forward set, but distributed_backend is deepspeed: the fsdp2 section needs"),
        (["distributed_backend=fsdp2", "fsdp2.cpu_offload=true"], 1, "fsdp2.cpu_offload: true needs a GPU"),
        (["eval_steps=5"], 1, "eval_steps is set but eval_data_path is not"),
        (["log_backends=[\"mlflow\"]"], 1, "unknown backend 'mlflow'"),
        (["resume=/nonexistent/ckpt"], 1, "resume: /nonexistent/ckpt is not a checkpoint directory"),
        (["log_backends=[\"wandb\"]"], 1, "log_backends: wandb is not installed"),
        (["online_max_length=64"], 1, "online_max_length is set but data_path"),
        (["launch.num_machines=2", "launch.num_processes=2"], 1, "main_process_ip is required"),
        (["launch.num_machines=2", "launch.num_processes=3", "launch.main_process_ip=10.0.0.1"], 3,
         "launch.num_processes=3 is not divisible by launch.num_machines=2"),
        (["launch.num_machines=2", "launch.num_processes=4", "launch.main_process_ip=10.0.0.1",
          "sequence_parallel_size=4", "sp_backend=torch"], 4,
         "sequence_parallel_size=4 does not divide the 2 processes per machine"),
        (["sequence_parallel_size=4", "sp_ulysses_size=3", "launch.num_processes=4"], 4,
         "sp_ulysses_size=3 must divide sequence_parallel_size=4"),
    ],
)
def test_invariant_errors(setup, overrides, world, message):
    _, config = setup
    if message in ("bf16: true needs a GPU", "fsdp2.cpu_offload: true needs a GPU"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA present")
    if message.startswith("log_backends: wandb"):
        import importlib.util

        if importlib.util.find_spec("wandb") is not None:
            pytest.skip("wandb is installed")
    cfg = load_config(config, overrides)
    with pytest.raises(ConfigError) as exc:
        preflight(cfg, world_size=world)
    assert message in str(exc.value)


def test_unknown_key_and_bad_type(setup):
    _, config = setup
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(config, ["learning_rate=1"])
    with pytest.raises(ConfigError, match="loss_reduction"):
        load_config(config, ["loss_reduction=mean"])
    with pytest.raises(ConfigError, match="distributed_backend"):
        load_config(config, ["distributed_backend=zero2"])


def test_token_ids_must_fit_the_vocabulary(setup):
    tmp, config = setup
    rows = random_rows(1, 1)
    rows[0][0]["input_ids"][3] = 500  # the tiny model's vocabulary is 97
    write_packed(tmp / "big_ids", rows)
    cfg = load_config(config, [f"data_path={tmp / 'big_ids'}"])
    with pytest.raises(ConfigError, match=r"data_path: token id 500 .* \(vocab_size=97\)"):
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


def test_deepspeed_dict_built_in_code(setup, tmp_path):
    _, config = setup
    cfg = load_config(config, ["deepspeed.stage=3", "deepspeed.offload_optimizer=true", "grad_accum=4",
                               "max_grad_norm=0.5", "deepspeed.template=configs/deepspeed/zero3.json"])
    ds = build_deepspeed_config(cfg)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 50000000  # from the template
    assert ds["optimizer"]["type"] == "AdamW"
    cfg = load_config(config, ["deepspeed.stage=2"])
    assert "optimizer" not in build_deepspeed_config(cfg)


def test_deepspeed_template_offload_counts(setup):
    from train.engines.deepspeed_config import offloads_optimizer

    _, config = setup
    template = "deepspeed.template=configs/deepspeed/zero3_offload.json"
    ds = build_deepspeed_config(load_config(config, ["deepspeed.stage=3", template]))  # YAML flags false
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert offloads_optimizer(ds) and ds["optimizer"]["type"] == "AdamW"  # DeepSpeed's CPU optimizer, not ours
    plain = build_deepspeed_config(
        load_config(config, ["deepspeed.stage=3", "deepspeed.template=configs/deepspeed/zero3.json"])
    )
    assert not offloads_optimizer(plain) and "optimizer" not in plain
    assert plain["zero_optimization"]["offload_param"]["device"] == "none"
    with pytest.raises(ConfigError, match="offloads parameters.*stage 3"):
        build_deepspeed_config(load_config(config, ["deepspeed.stage=2", template]))


def test_lr_schedule():
    f = lr_lambda_factory(total_steps=10, warmup_steps=2, schedule="cosine", min_ratio=0.1)
    values = [f(s) for s in range(10)]
    assert values[0] == pytest.approx(0.5) and values[1] == pytest.approx(1.0) and values[2] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[1:], values[2:]))
    g = lr_lambda_factory(total_steps=5, warmup_steps=0, schedule="linear", min_ratio=0.0)
    assert np.allclose([g(s) for s in range(5)], [1.0, 0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("path,world", [("configs/train/example.yaml", 1), ("configs/train/example_sp.yaml", 2)])
def test_shipped_configs_parse(path, world, tmp_path):
    """Each shipped config parses. Its output_dir goes to tmp_path: a user's earlier run of the quick start in
    outputs/ (which a re-run refuses to overwrite) must not decide this test."""
    from tests._train_helpers import ROOT
    from train.__main__ import launch_args
    from train.machines.threads import CpuThreads

    cfg = load_config(ROOT / path, [f"output_dir={tmp_path / 'out'}"])
    cfg.validate(world)
    args = launch_args(cfg, CpuThreads(1, "test"))
    assert args[args.index("--num_processes") + 1] == str(world)
    assert args[args.index("--num_cpu_threads_per_process") + 1] == "1"
    assert ("--multi_gpu" in args) == (world > 1)


def test_activation_checkpointing_auto_follows_row_length(setup):
    _, config = setup
    cfg = load_config(config, [])
    assert cfg.model.gradient_checkpointing == "auto"
    assert cfg.model.checkpointing_enabled(8192) and cfg.model.checkpointing_enabled(131072)
    assert not cfg.model.checkpointing_enabled(4096)
    assert load_config(config, ["gradient_checkpointing=false"]).model.checkpointing_enabled(131072) is False
    assert load_config(config, ["gradient_checkpointing=true"]).model.checkpointing_enabled(16) is True
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        load_config(config, ["gradient_checkpointing=sometimes"])


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


def test_keys_flat_or_in_their_section(setup, tmp_path):
    """Every key of the sections but deepspeed / launch may be written flat (as every config before the sections did)
    or in its section; both give the same config, code reads the section (`cfg.optim.lr`)."""
    from train.config.sections import FLAT_KEYS, from_keys, key_path

    _, config = setup
    flat = load_config(config, ["lr=3e-4", "sequence_parallel_size=2", "launch.num_processes=2"])
    dotted = load_config(config, ["optim.lr=3e-4", "parallel.sequence_parallel_size=2", "launch.num_processes=2"])
    assert flat == dotted and flat.optim.lr == 3e-4 and flat.parallel.sequence_parallel_size == 2
    sectioned = tmp_path / "s.yaml"
    sectioned.write_text(config.read_text() + "optim: {lr: 0.0003, schedule: linear}\nsteps:\n  grad_accum: 4\n")
    cfg = load_config(sectioned)
    assert (cfg.optim.lr, cfg.optim.schedule, cfg.steps.grad_accum) == (3e-4, "linear", 4)
    assert load_config(sectioned, ["lr=1e-3"]).optim.lr == 1e-3  # a flat override of a key the file sets in its section
    twice = tmp_path / "twice.yaml"
    twice.write_text(sectioned.read_text() + "lr: 0.001\n")
    with pytest.raises(ConfigError, match=r"lr is set twice, as lr and as optim.lr"):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"override 'optim.lrr=1': unknown key 'optim.lrr'; did you mean 'optim.lr'"):
        load_config(config, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"^override 'optim.lr=fast': optim.lr: expected a number"):
        load_config(config, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"^override 'lr=fast': lr: expected a number"):
        load_config(config, ["lr=fast"])
    assert key_path("lr") == "optim.lr" and key_path("deepspeed.stage") == "deepspeed.stage"
    assert len(FLAT_KEYS) == 67 and "stage" not in FLAT_KEYS  # deepspeed.* and launch.* keep their section
    assert from_keys({"data_path": "d", "output_dir": "o", "model_config": "m.json", "optim": {"lr": 2e-4}}).optim.lr == 2e-4
    with pytest.raises(ConfigError, match="missing required key 'data_path'"):
        from_keys({"output_dir": "o", "model_config": "m.json"})
