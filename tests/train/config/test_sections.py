"""The trainer's config (train/config/sections.py): one YAML file plus `key=value` overrides, keys flat or in their
section, every rule of the values checked before the model loads with a clear message naming the key and where it
was written (unknown keys with the closest one, other tools' key names, bad values and numbers), relative paths
naming the directory they were resolved against, `sh train.sh --help`, the shipped configs."""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import typing

import numpy as np
import orjson
import pytest
import yaml

from common.config import ConfigError, field_help
from tests._train_helpers import ROOT, VOCAB, random_rows, save_tiny_model, write_config, write_packed
from train.config.sections import FLAT_KEYS, SECTIONS, TrainConfig, load_config
from train.preflight import preflight


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg")
    data = write_packed(tmp / "data", random_rows(0, 2))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), output_dir=str(tmp / "out"))
    return tmp, config


@pytest.fixture(scope="module")
def data_and_model(tmp_path_factory):
    """Packed rows of 20-24-token sequences and a tiny saved model."""
    tmp = tmp_path_factory.mktemp("data_and_model")
    data = write_packed(tmp / "data", random_rows(0, 2, min_len=20, max_len=24))
    model = save_tiny_model(tmp / "model")
    return tmp, data, model


def _model_config(path, max_positions: int):
    """A tiny Qwen2's config.json of `max_positions` positions."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=max_positions).to_json_file(path)
    return path


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
        # the override replaces the file's model_path (test_a_model_source_on_the_command_line_replaces_the_yaml_one),
        # then the path is checked
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


def test_other_tools_key_names_suggest_ours(data_and_model, tmp_path):
    tmp, data, model = data_and_model
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


def test_a_bad_override_value_names_the_override_and_file_values_the_file(data_and_model, tmp_path):
    tmp, data, model = data_and_model
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


def test_a_model_source_on_the_command_line_replaces_the_yaml_one(data_and_model, tmp_path, caplog):
    tmp, data, model = data_and_model
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


def test_relative_paths_in_errors_name_the_directory_they_were_resolved_against(data_and_model, tmp_path, monkeypatch):
    tmp, data, model = data_and_model
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


def test_no_shipped_train_config_deletes_an_earlier_run():
    configs = sorted((ROOT / "configs" / "train").glob("*.yaml"))
    assert configs
    for path in configs:
        raw = yaml.safe_load(path.read_text()) or {}
        assert raw.get("overwrite_output_dir", False) is False, f"{path.name} deletes the previous run's checkpoints"


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
    assert len(FLAT_KEYS) == 69 and "stage" not in FLAT_KEYS  # deepspeed.* and launch.* keep their section
    assert from_keys({"data_path": "d", "output_dir": "o", "model_config": "m.json", "optim": {"lr": 2e-4}}).optim.lr == 2e-4
    with pytest.raises(ConfigError, match="missing required key 'data_path'"):
        from_keys({"output_dir": "o", "model_config": "m.json"})


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



@pytest.mark.parametrize("where, key, needle", [
    ("override", "max_length=4096", "unknown key 'max_length': packed rows get their length when the data is packed: "
                                    "set max_length (or pack.max_length) in the data config"),
    ("override", "max_seq_length=4096", "unknown key 'max_seq_length': packed rows get their length"),
    ("file", {"cutoff_len": 4096}, "unknown key 'cutoff_len': packed rows get their length"),
    ("file", {"packing": True}, "unknown key 'packing': PackSFT always trains on packed rows"),
    ("override", "data.max_length=4096", "unknown key 'data.max_length': packed rows get their length"),
    ("file", {"template": "qwen"}, "unknown key 'template': the chat template is applied when the data is tokenized"),
], ids=["max_length", "max_seq_length", "cutoff_len", "packing", "data.max_length", "template"])
def test_other_frameworks_length_and_packing_keys_say_where_packsft_sets_them(setup, tmp_path, capsys, where, key,
                                                                              needle):
    """`sh train.sh … max_length=4096` (TRL's max_seq_length, LLaMA-Factory's cutoff_len, TRL's packing): what the
    trainer's launcher says. Before: max_length suggested online_max_length (not for packed rows), the others nothing."""
    from train.__main__ import main

    tmp, config = setup
    if where == "file":
        base = dict(__import__("yaml").safe_load(config.read_text()), **key)
        config, overrides = write_config(tmp_path / "c.yaml", **base), []
    else:
        overrides = [key]
    assert main(["--launch", str(config), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and needle in err and "online_max_length?" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_data_path_at_the_pipelines_output_dir_points_to_its_packed_dir(setup, tmp_path):
    """data_path=<the data config's output_dir> (as typed after sh data_process.sh): the packed/ inside is named.
    Before: `has no meta.json: not a packed dataset` alone."""
    _, config = setup
    out = tmp_path / "example"
    write_packed(out / "packed", random_rows(0, 2))
    with pytest.raises(ConfigError) as err:
        preflight(load_config(config, [f"data_path={out}"]))
    assert str(err.value) == (f"data_path: {out} has no meta.json: not a packed dataset; the packed rows of sh "
                              f"data_process.sh are in its packed/ directory: data_path={out / 'packed'}")


def _tokenized(path, lengths):
    from data.shards.dataset import ShardWriter
    from tests._train_helpers import synthetic_sequence

    rng = np.random.default_rng(0)
    with ShardWriter(path, kind="tokenized") as writer:
        for uid, length in enumerate(lengths):
            writer.add_row([synthetic_sequence(rng, length, 1, 1)], record_indices=[uid], uids=[[uid]])
        writer.close({"max_length": 256, "categories": {"0": "untracked", "1": "math"}})
    return path


@pytest.mark.parametrize("overrides, needle", [
    (["attn_backend=torch_varlen"], "config error: attn_backend=torch_varlen cannot run on cpu torch.float32 "
                                    "(dropout 0.0): needs CUDA tensors (varlen_attn is CUDA-only)"),
    (["attn_backend=flex"], "config error: attn_backend=flex cannot run on cpu torch.float32"),
    (["sequence_parallel_size=2", "launch.num_processes=2", "sp_backend=llama3"],
     "config error: sp_backend='llama3' needs a CUDA GPU (ring-flash-attn runs flash-attn kernels); use "
     "sp_backend=torch on CPU"),
    (["online_max_length=16", "TOKENIZED"],
     "config error: online_max_length=16: data_path {} holds sequences of up to 30 tokens (2 longer than 16), and "
     "online packing puts each one whole into a row: set online_max_length >= 30, or tokenize with max_length <= 16"),
], ids=["torch_varlen", "flex", "llama3", "online_max_length"])
def test_what_this_machine_cannot_run_is_refused_before_any_process_starts(setup, tmp_path, capsys, overrides,
                                                                          needle):
    """`sh train.sh` on a CPU machine with a CUDA-only attention or sequence-parallel backend, or online packing
    rows shorter than the data's sequences: the launcher's start-up checks refuse them (exit 2, one line). Before:
    a traceback from the trainer after the model loaded (15-27 s on a loaded 2-core machine)."""
    import torch

    from train.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("the backends run on CUDA")
    _, config = setup
    if "TOKENIZED" in overrides:
        data = _tokenized(tmp_path / "tokenized", [12, 30, 20, 8])
        overrides = [o for o in overrides if o != "TOKENIZED"] + [f"data_path={data}", "tokenizer_mismatch=warn"]
        needle = needle.format(data)
    assert main(["--launch", str(config), f"output_dir={tmp_path / 'out'}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(needle) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_stepwise_trees_under_sequence_parallelism_are_refused_by_the_launcher(setup, tmp_path, capsys):
    """`sh train.sh … sequence_parallel_size=2` on packed stepwise trees: refused before any process starts
    (before: by every rank once the trainer opened the data)."""
    from data.shards.dataset import ShardWriter
    from data.shards.prefix_tree import PrefixTree
    from tests._train_helpers import synthetic_sequence
    from train.__main__ import main

    rng = np.random.default_rng(0)
    tree = PrefixTree()
    for _ in range(2):
        tree.insert(synthetic_sequence(rng, 12, 1, 1))
    data = tmp_path / "trees"
    with ShardWriter(data, kind="packed", token_fields=["input_ids", "labels", "category_ids", "turn_ids",
                                                        "tree_spans"]) as writer:
        writer.add_row([tree.arrays()])
        writer.close({"max_length": 64, "categories": {"0": "untracked", "1": "math"}})
    _, config = setup
    assert main(["--launch", str(config), f"data_path={data}", "sequence_parallel_size=2", "launch.num_processes=2",
                 "sp_backend=torch", "tokenizer_mismatch=warn", f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: data_path {data}: stepwise trees (tree_spans in the shards) cannot run "
                          "under sequence parallelism yet"), err
    assert err.rstrip().endswith("(sequence_parallel_size=2)")
