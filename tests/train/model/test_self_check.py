"""The trainer's model-family gate: a refused family stops before any weight loads, the start-up self-check
passes on an exact family and stops training when the packed path does not reproduce the model."""
from __future__ import annotations

import os
import subprocess
import sys


import numpy as np
import pytest
import torch

from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    VOCAB,
    one_thread,
    random_rows,
    save_tiny_model,
    write_config,
    write_packed,
)
from train.attention.function import BACKENDS, LayerKernels
from train.model.support import UnsupportedModelError

SDPA_KERNELS = LayerKernels(every=BACKENDS["sdpa"])  # every layer through the SDPA loop

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(tmp_path, **values):
    from train.config.sections import load_config

    data = write_packed(tmp_path / "data", random_rows(0, 4, seqs_per_row=3, min_len=8, max_len=20))
    path = write_config(tmp_path / "run.yaml", data_path=str(data), output_dir=str(tmp_path / "out"), max_steps=1,
                        loss_chunk_size=8, plot=False, **values)
    return load_config(path)


def test_refused_family_stops_before_the_model_loads(tmp_path, monkeypatch):
    from transformers import BloomConfig

    from train import trainer as trainer_module
    from train.run import setup as run_setup

    model_config = tmp_path / "bloom.json"
    BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2).to_json_file(model_config)
    monkeypatch.setattr(run_setup, "build_lm", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UnsupportedModelError, match="model family 'bloom'.*causal mask"):
        trainer_module.Trainer(_config(tmp_path, model_config=str(model_config)), console=lambda *_: None)


def test_refused_setting_stops_before_the_model_loads(tmp_path, monkeypatch):
    """HRM-Text's default config is a prefix-LM: refused from the config, whatever the family's status."""
    from tests.model_zoo import tiny_config
    from train import trainer as trainer_module
    from train.run import setup as run_setup

    config = tiny_config("hrm_text", prefix_lm=True)
    config.to_json_file(tmp_path / "hrm.json")
    monkeypatch.setattr(run_setup, "build_lm", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UnsupportedModelError, match="model family 'hrm_text' .* with `prefix_lm: True`"):
        trainer_module.Trainer(_config(tmp_path, model_config=str(tmp_path / "hrm.json")), console=lambda *_: None)


def test_self_check_passes_on_an_exact_family(tmp_path):
    from train.trainer import Trainer

    lines = []
    save_tiny_model(tmp_path / "model")
    Trainer(_config(tmp_path, model_path=str(tmp_path / "model")), console=lines.append)
    assert any(line.startswith("self-check: packed = unpacked on 4 sequences") for line in lines), lines


def test_self_check_stops_a_packed_path_that_leaks(tmp_path, monkeypatch):
    """Boundaries dropped (as a family whose layers ignore them would): the check names the family and the
    difference, before step 1."""
    from train.model import self_check as model_check
    from train.attention.function import AttentionContext
    from train.trainer import Trainer

    real = AttentionContext.for_micro_batch

    def one_sequence(cu_seqlens, device, kernels, **kwargs):
        return real(torch.tensor([0, int(cu_seqlens[-1])], dtype=torch.int32), device, kernels, **kwargs)

    monkeypatch.setattr(model_check.AttentionContext, "for_micro_batch", staticmethod(one_sequence))
    save_tiny_model(tmp_path / "model")
    with pytest.raises(RuntimeError, match="start-up self-check failed for model family 'qwen2'.*loss packed"):
        Trainer(_config(tmp_path, model_path=str(tmp_path / "model")), console=lambda *_: None)
    cfg = _config(tmp_path, model_path=str(tmp_path / "model"), self_check=False)
    Trainer(cfg, console=lambda *_: None)  # the check off: the user's call


def test_unverified_family_needs_the_self_check(tmp_path):
    from transformers import Qwen2Config

    from train.model.support import check_model_support

    config = Qwen2Config()
    config.model_type = "my_remote_family"
    assert check_model_support(config, self_check=True) == "unverified"
    with pytest.raises(UnsupportedModelError, match="'my_remote_family' is not in PackSFT's verified table"):
        check_model_support(config, self_check=False)


def _gemma2_config(path, **extra):
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=0.5,
                 final_logit_softcapping=0.3, max_position_embeddings=256, **extra).to_json_file(path)
    return path


def test_train_command_trains_a_windowed_softcapped_family_exactly(tmp_path):
    """`python -m train` (what train.sh launches) on gemma2 — sliding window 4 (shorter than the sequences),
    attention and final-logit softcaps: the start-up self-check proves packed = unpacked, then it trains."""
    from tests._train_helpers import run_train

    data = write_packed(tmp_path / "data", random_rows(0, 4, seqs_per_row=3, min_len=8, max_len=20))
    config = write_config(tmp_path / "run.yaml", data_path=str(data), output_dir=str(tmp_path / "out"),
                          model_config=str(_gemma2_config(tmp_path / "gemma2.json")), max_steps=2, lr=1e-3,
                          loss_chunk_size=8, plot=False)
    proc = run_train(config, [])
    assert "self-check: packed = unpacked on 4 sequences" in proc.stdout, proc.stdout
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


def test_train_command_refuses_an_unsupported_family(tmp_path):
    from transformers import BloomConfig

    from tests._train_helpers import ROOT

    data = write_packed(tmp_path / "data", random_rows(0, 2))
    model_config = tmp_path / "bloom.json"
    BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2).to_json_file(model_config)
    config = write_config(tmp_path / "run.yaml", data_path=str(data), output_dir=str(tmp_path / "out"),
                          model_config=str(model_config), max_steps=1)
    proc = subprocess.run([sys.executable, "-m", "train", str(config)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model not supported: model family 'bloom' cannot be trained on packed rows" in proc.stderr
    assert not (tmp_path / "out" / "final").exists()


def _longrope_run(tmp_path):
    """A Phi-3 config with longrope switching at 16 tokens, and data whose first 9 rows hold only sequences of 6-12
    tokens: the only longer one (40 tokens) is in row 9."""
    from tests._train_helpers import synthetic_sequence
    from transformers import Phi3Config

    Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=16,
               sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                                "original_max_position_embeddings": 16}).to_json_file(tmp_path / "phi3.json")
    rows = random_rows(0, 9, seqs_per_row=3, min_len=6, max_len=12)
    rows.append([synthetic_sequence(np.random.default_rng(1), 40, 2, 1)])
    data = write_packed(tmp_path / "data", rows)
    return write_config(tmp_path / "run.yaml", data_path=str(data), output_dir=str(tmp_path / "out"), max_steps=1,
                        loss_chunk_size=8, plot=False, model_config=str(tmp_path / "phi3.json"))


def test_self_check_covers_both_sides_of_a_rope_switch_point(tmp_path):
    """A rope whose frequencies switch with the sequence length (longrope at 16 tokens): the self-check packs
    sequences of at most 16 tokens with one longer (the first one of the data past the switch point, cut to 17)."""
    from train.config.sections import load_config
    from train.model.self_check import self_check_sequences
    from train.model.patches.rope import switch_points
    from train.trainer import Trainer

    lines = []
    trainer = Trainer(load_config(_longrope_run(tmp_path)), console=lines.append)
    assert switch_points(trainer.lm.config) == [16]
    lengths = [len(s) for s in self_check_sequences(trainer.dataset, switch_points=[16])]
    assert max(lengths) == 17 and sorted(lengths)[-2] <= 16, lengths
    assert any(line.startswith("self-check: packed = unpacked on 4 sequences") and "rope switch point 16" in line
               for line in lines), lines


def test_self_check_stops_a_rope_taken_from_the_longest_sequence(tmp_path, monkeypatch):
    """Without per-sequence rope (transformers' choice from the row's longest sequence, as before train/model/patches/rope.py)
    the check fails: it only can because one of its sequences is past the switch point."""
    from train.model import packed as packed_model
    from train.config.sections import load_config
    from train.model.patches.rope import PerSequenceRopes
    from train.trainer import Trainer

    monkeypatch.setattr(packed_model, "install_per_sequence_rope", lambda lm: PerSequenceRopes())
    with pytest.raises(RuntimeError, match="start-up self-check failed for model family 'phi3'"):
        Trainer(load_config(_longrope_run(tmp_path)), console=lambda *_: None)


def _deep_bf16_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from train.model.packed import PackedCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM._from_config(config, attn_implementation="packsft", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (40, 33, 57, 25)]
    return PackedCausalLM(lm, chunk_size=16, num_categories=1), sequences


def test_half_precision_judges_the_gradients_together(monkeypatch):
    """bf16 weights (the DeepSpeed bf16 path): both paths round at every matmul, so single parameters with tiny
    gradients differ by rounding noise; the check judges the whole gradient, which a leaking mask still moves
    by far more than the tolerance."""
    from train.model import self_check as model_check
    from train.attention.function import AttentionContext

    model, sequences = _deep_bf16_model()
    result = model_check.compare_packed_with_reference(model, sequences, SDPA_KERNELS, gradient_probe=True)
    assert result.dtype == torch.bfloat16 and not result.per_parameter
    assert result.ok, result.describe()
    assert result.grad_error < 0.03, result.describe()  # rounding noise only: well under the 1e-1 tolerance
    assert "all parameters together" in result.describe()

    real = AttentionContext.for_micro_batch
    monkeypatch.setattr(model_check.AttentionContext, "for_micro_batch", staticmethod(
        lambda cu, device, kernels, **kw: real(torch.tensor([0, int(cu[-1])], dtype=torch.int32), device, kernels,
                                             **kw)))
    leaking = model_check.compare_packed_with_reference(model, sequences, SDPA_KERNELS, gradient_probe=True)
    assert not leaking.ok and leaking.grad_error > 0.3, leaking.describe()


def test_blt_is_refused_for_what_breaks_not_as_multimodal():
    """BLT is a text-only byte-level model: its refusal names what leaks across packed sequences (byte-group
    hashes, entropy patches, the patch-level transformer over the whole row), not a vision/audio tower."""
    from types import SimpleNamespace

    from train.model.support import check_model_support

    with pytest.raises(UnsupportedModelError, match="model family 'blt'") as err:
        check_model_support(SimpleNamespace(model_type="blt"))
    text = str(err.value)
    assert "multimodal" not in text and "vision" not in text
    assert "byte-level" in text and "patch" in text and "hash" in text


@pytest.mark.parametrize("sharded, zero3", [(False, False), (True, False), (False, True)])
def test_non_finite_weights_are_named_before_the_self_check(tmp_path, sharded, zero3):
    """A NaN / inf in model_path's weights stops the start naming the tensor and the file holding it, whatever
    self_check: the self-check would blame packing ("does not reproduce this model on packed rows"). Under ZeRO-3
    the weights load partitioned (and the self-check is skipped): the partitions are checked."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    from common.config import ConfigError
    from tests._train_helpers import tiny_model
    from train.trainer import Trainer

    model = tmp_path / "model"
    lm = tiny_model()
    lm.config._attn_implementation = "sdpa"
    lm.save_pretrained(model, **({"max_shard_size": "60KB"} if sharded else {}))
    name = "model.layers.1.mlp.up_proj.weight"
    if sharded:
        file = model / json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][name]
        assert file.name != "model-00001-of-00006.safetensors"
    else:
        file = model / "model.safetensors"
    tensors = load_file(file)
    tensors[name][3, 5] = float("nan")
    tensors[name][0, 0] = float("inf")
    save_file(tensors, file, metadata={"format": "pt"})
    for self_check in (True, False):
        with pytest.raises(ConfigError, match=rf"model_path: {re.escape(str(file))}: tensor '{re.escape(name)}' "
                                              r"holds 1 NaN and 1 infinite value"):
            Trainer(_config(tmp_path, model_path=str(model), self_check=self_check,
                            deepspeed={"stage": 3 if zero3 else None}), console=lambda *_: None)
