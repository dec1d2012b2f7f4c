"""A checkpoint that lacks weights its config describes (a composite's tower, a decoder layer's projection) stops
the run before training with a ConfigError naming how many and the first few, instead of training (and exporting)
transformers' random initialisation of them. Tied weights (lm_head = the embeddings) are not missing; random init is
model_config's. Through the Trainer's start-up, as `python -m train` builds it."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import ConfigError
from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from tests.train.model.test_composite import save_tiny_composite
from train.config.sections import load_config
from train.trainer import Trainer


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return write_packed(tmp_path_factory.mktemp("missing") / "packed", random_rows(0, 2))


def _drop(model_dir, keep) -> list[str]:
    """Rewrite model.safetensors without the tensors `keep` rejects; the dropped names."""
    weights = load_file(model_dir / "model.safetensors")
    dropped = sorted(k for k in weights if not keep(k))
    save_file({k: v for k, v in weights.items() if keep(k)}, model_dir / "model.safetensors", metadata={"format": "pt"})
    return dropped


def _trainer(tmp_path, packed, model_dir, **extra):
    config = write_config(tmp_path / "train.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp_path / "out"), max_steps=1, lr=1e-3, plot=False,
                          tokenizer_mismatch="warn", attn_backend="sdpa", **extra)
    return Trainer(load_config(config, []), console=lambda *_: None)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_complete_checkpoint_loads(tmp_path, packed, tie, one_thread):  # noqa: F811
    """lm_head tied to the embeddings is stored once: not missing."""
    model_dir = save_tiny_model(tmp_path / "model", tie=tie)
    trainer = _trainer(tmp_path, packed, model_dir)
    saved = load_file(model_dir / "model.safetensors")
    assert ("lm_head.weight" in saved) != tie
    assert torch.equal(trainer.lm.model.embed_tokens.weight.detach().cpu(), saved["model.embed_tokens.weight"])


def test_a_decoder_weight_missing_stops_before_training(tmp_path, packed, one_thread):  # noqa: F811
    model_dir = save_tiny_model(tmp_path / "model")
    dropped = _drop(model_dir, lambda k: k != "model.layers.1.mlp.down_proj.weight")
    assert dropped == ["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ConfigError, match=r"the checkpoint lacks 1 of the model's \d+ weights "
                                          r"\(model\.layers\.1\.mlp\.down_proj\.weight\).*model_config"):
        _trainer(tmp_path, packed, model_dir)
    assert not (tmp_path / "out" / "final").exists()


def test_a_composite_without_its_tower_stops_before_training(tmp_path, packed, one_thread):  # noqa: F811
    model_dir = save_tiny_composite(tmp_path / "model", "qwen2_5_vl")
    dropped = _drop(model_dir, lambda k: not k.startswith("visual."))
    assert len(dropped) > 5
    with pytest.raises(ConfigError) as info:
        _trainer(tmp_path, packed, model_dir)
    message = str(info.value)
    assert f"the checkpoint lacks {len(dropped)} of the model's" in message, message
    assert f"({len(dropped) - 5} more)" in message and message.count("visual.") >= 5, message
    assert str(model_dir) in message
    assert not (tmp_path / "out" / "final").exists()
