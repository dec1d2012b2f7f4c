"""LoRA's targets are checked at start-up before any weight loads (train/preflight.py `check_lora_targets`: the
model's modules built on the meta device): a target matching nothing, the output head, the routed experts named as a
module, a parameter target matching nothing — one `config error:` line, exit 2, from a model directory whose weights
are never read."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.config import ConfigError
from tests._train_helpers import ROOT, VOCAB, random_rows, write_config, write_packed
from tests.train.model.test_experts_parallel import _model_config
from train.config.sections import load_config
from train.preflight import preflight


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A packed dataset and a mixtral model directory holding its config.json only (no weights: a check that read
    them would fail on that instead)."""
    tmp = tmp_path_factory.mktemp("lora_preflight")
    packed = write_packed(tmp / "data", random_rows(3, 4))
    model_dir = tmp / "mixtral"
    model_dir.mkdir()
    config = {k: v for k, v in _model_config("qwen3_moe").items() if k not in ("num_experts", "moe_intermediate_size",
                                                                              "norm_topk_prob", "decoder_sparse_step",
                                                                              "mlp_only_layers")}
    config.update(model_type="mixtral", num_local_experts=8, intermediate_size=16, vocab_size=VOCAB)
    (model_dir / "config.json").write_text(json.dumps(config))
    return tmp, packed, model_dir


@pytest.mark.parametrize("options, needle", [
    (['target_modules=["q_proj","nope_proj"]'], "target_modules ['nope_proj'] match no module of MixtralForCausalLM"),
    (['target_modules=["lm_head"]'], "the output head 'lm_head' is never adapted"),
    (['target_modules=["experts"]'], 'names the routed experts (MixtralExperts at model.layers.0.mlp.experts): their '
                                    'weights are fused 3-D tensors, not linear layers; adapt them with '
                                    'target_parameters=["experts.gate_up_proj","experts.down_proj"]'),
    (['target_modules=["q_proj"]', 'target_parameters=["experts.up_proj"]'],
     "target_parameters ['experts.up_proj'] match no parameter of MixtralForCausalLM"),
])
def test_lora_targets_are_refused_before_the_weights_load(setup, options, needle):
    tmp, packed, model_dir = setup
    config = write_config(tmp / "c.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp / "out"), lora_rank=4)
    with pytest.raises(ConfigError) as err:
        preflight(load_config(config, options))
    assert needle in str(err.value)


def test_the_cli_refuses_them_in_one_line(setup):
    """Through `python -m train` (the start-up `sh train.sh` runs): exit 2, the message, nothing written."""
    tmp, packed, model_dir = setup
    out = tmp / "cli_out"
    config = write_config(tmp / "cli.yaml", data_path=str(packed), model_path=str(model_dir), output_dir=str(out),
                          lora_rank=4)
    proc = subprocess.run([sys.executable, "-m", "train", str(config), 'target_modules=["experts"]'], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: target_modules ['experts'] names the routed experts" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_targets_that_exist_pass(setup):
    tmp, packed, model_dir = setup
    config = write_config(tmp / "ok.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp / "ok_out"), lora_rank=4)
    preflight(load_config(config, ['target_modules=["q_proj","v_proj"]',
                                   'target_parameters=["experts.gate_up_proj","experts.down_proj"]']))


def _model_dir(tmp, name: str, config: dict):
    model_dir = tmp / name
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("tie, target, needle", [
    (False, "lm_head.weight", "target_parameters ['lm_head.weight'] names the output head (lm_head), which LoRA "
                              "never adapts"),
    (True, "lm_head.weight", "target_parameters ['lm_head.weight'] names the output head (lm_head, tied to the input "
                             "embedding), which LoRA never adapts"),
    (True, "embed_tokens.weight", "target_parameters ['embed_tokens.weight'] names the input embedding "
                                  "(model.embed_tokens, tied to the output head), which LoRA never adapts"),
], ids=["head", "tied-head", "tied-embedding"])
def test_the_head_or_embedding_as_a_target_parameter_is_refused_before_the_weights_load(setup, capsys, tie, target,
                                                                                       needle):
    """Before: lm_head.weight passed preflight (the self-check then blamed the family; without it the head's lora_B
    stayed 0), and a tied model's embed_tokens.weight died in autograd naming no key."""
    tmp, packed, model_dir = setup
    config = json.loads((model_dir / "config.json").read_text())
    tied = _model_dir(tmp, f"mixtral_tie{tie}", dict(config, tie_word_embeddings=tie))
    run = write_config(tmp / "head.yaml", data_path=str(packed), model_path=str(tied), output_dir=str(tmp / "h"),
                       lora_rank=4, target_modules=["q_proj"], target_parameters=[target])
    with pytest.raises(ConfigError) as err:
        preflight(load_config(run, []))
    assert needle in str(err.value)


def test_target_parameters_without_a_lora_rank_is_a_config_error(setup, capsys):
    """Before: target_parameters with lora_rank 0 ran a full fine-tune, rc 0, with no word of LoRA."""
    from train.__main__ import main

    tmp, packed, model_dir = setup
    run = write_config(tmp / "rank0.yaml", data_path=str(packed), model_path=str(model_dir), output_dir=str(tmp / "r0"))
    assert main(["--launch", str(run), 'target_parameters=["experts.down_proj"]']) == 2
    err = capsys.readouterr().err
    assert err == ("config error: target_parameters=['experts.down_proj'] set, but lora_rank is 0 (full fine-tuning: "
                   "no adapter, every weight trains); set lora_rank (e.g. lora_rank=16 lora_alpha=32) for LoRA, or "
                   "drop target_parameters\n")
    assert main(["--launch", str(run), 'target_modules=["q_proj"]']) == 2
    assert "config error: target_modules=['q_proj'] set, but lora_rank is 0" in capsys.readouterr().err


def test_the_default_target_modules_on_an_moe_model_say_they_are_the_default_and_what_to_set(setup):
    """Before: `target_modules ['gate_proj', 'up_proj', 'down_proj'] match no module of Qwen3MoeForCausalLM`, a key
    the user never set."""
    tmp, packed, _ = setup
    config = dict(_model_config("qwen3_moe"), vocab_size=VOCAB)
    model_dir = _model_dir(tmp, "qwen3_moe", config)
    run = write_config(tmp / "default.yaml", data_path=str(packed), model_path=str(model_dir),
                       output_dir=str(tmp / "d"), lora_rank=4)
    with pytest.raises(ConfigError) as err:
        preflight(load_config(run, []))
    assert str(err.value) == (
        "target_modules is not set, and LoRA's default ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', "
        "'up_proj', 'down_proj'] names modules Qwen3MoeForCausalLM does not have: gate_proj, up_proj, down_proj (its "
        "feed-forward layers are routed experts, whose weights are fused 3-D parameters, not linear layers). Set "
        'target_modules to its linear layers, target_modules=["q_proj","k_proj","v_proj","o_proj"] (or '
        'target_modules=all-linear), and target_parameters=["experts.gate_up_proj","experts.down_proj"] to adapt the '
        "routed experts too (one adapter per expert)")
    # what it says to set passes
    preflight(load_config(run, ['target_modules=["q_proj","k_proj","v_proj","o_proj"]',
                                'target_parameters=["experts.gate_up_proj","experts.down_proj"]']))
