"""The DeepSpeed dict (train/engines/deepspeed_config.py), built in code from the config: the stage, offloads, gradient
accumulation and clipping from the config, the rest from a template file; a template that offloads counts as the
config's offload (DeepSpeed's CPU optimizer) and needs stage 3 for parameters."""
from __future__ import annotations

import pytest

from common.config import ConfigError
from tests.train.config.test_sections import setup  # noqa: F401  (a fixture)
from train.config.sections import load_config
from train.engines.deepspeed_config import build_deepspeed_config


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
