"""Composite (multimodal) checkpoints trained on packed text (train/model/composite.py): the trainer loads a tiny
Qwen2.5-VL / Gemma 3 saved with save_pretrained, trains its text decoder (start-up self-check on), and `final/` is
the same composite again: every key of the checkpoint, towers bitwise unchanged, processor files beside it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests._train_helpers import VOCAB, one_thread, random_rows, write_config, write_packed  # noqa: F401
from tests.model_zoo import tiny_composite_config
from train.model.support import UnsupportedModelError

PROCESSOR = {"preprocessor_config.json": json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}),
             "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
# the towers' keys in each checkpoint as transformers saves it (their original layouts: Qwen2.5-VL's `visual.` beside the
# text decoder's `model.`, Gemma 3's `vision_tower.` beside `language_model.model.`)
TOWER_KEYS = {"qwen2_5_vl": ("visual.",), "gemma3": ("vision_tower.", "multi_modal_projector.")}


def save_tiny_composite(path, model_type: str):
    """A tiny random-init composite checkpoint (weights, config, a processor's files) at `path`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    config = tiny_composite_config(model_type, vocab_size=VOCAB)
    torch.manual_seed(0)
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]._from_config(config).save_pretrained(path)
    for name, text in PROCESSOR.items():
        (path / name).write_text(text)
    return path


def train_composite(tmp_path, model_type: str, *overrides: str):
    from train.config.sections import load_config
    from train.trainer import Trainer

    model_dir = save_tiny_composite(tmp_path / "model", model_type)
    packed = write_packed(tmp_path / "packed", random_rows(0, 4))
    config = write_config(tmp_path / "train.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp_path / "out"), max_steps=2, lr=1e-2, plot=False,
                          tokenizer_mismatch="warn", attn_backend="sdpa")
    lines = []
    Trainer(load_config(config, list(overrides)), console=lines.append).train()
    return model_dir, tmp_path / "out" / "final", lines


def assert_same_composite(model_dir, exported, model_type: str):
    """`exported` loads with AutoModelForImageTextToText and holds the checkpoint's keys; towers bitwise equal,
    the text decoder trained."""
    from transformers import AutoModelForImageTextToText

    before, after = load_file(model_dir / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(after) == sorted(before)
    towers = [key for key in before if key.startswith(TOWER_KEYS[model_type])]
    assert towers and all(torch.equal(before[key], after[key]) for key in towers)
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    assert any(".layers.0." in key for key in changed) and any(".layers.1." in key for key in changed), changed
    reloaded = AutoModelForImageTextToText.from_pretrained(exported)
    assert type(reloaded).__name__ == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    for name, text in PROCESSOR.items():
        assert (exported / name).read_text() == text


def test_composite_trains_and_exports_the_same_composite(tmp_path, one_thread):  # noqa: F811
    model_dir, final, lines = train_composite(tmp_path, "qwen2_5_vl")
    assert any(line.startswith("self-check: packed = unpacked") for line in lines), lines
    assert_same_composite(model_dir, final, "qwen2_5_vl")


def test_composite_lora_exports_adapter_and_merged_composite(tmp_path, one_thread):  # noqa: F811
    """LoRA adapts the text decoder only (Gemma 3's SigLIP tower has q_proj / k_proj layers too)."""
    model_dir, final, _ = train_composite(tmp_path, "gemma3", "lora_rank=4", "lora_alpha=8",
                                          'target_modules=["q_proj","v_proj"]', "lora_merge_on_save=true")
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all(".language_model." in key for key in adapter), sorted(adapter)
    assert len(adapter) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert_same_composite(model_dir, final / "merged", "gemma3")
    for name in PROCESSOR:
        assert (final / name).is_file()


def test_towers_freeze_by_name():
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from train.model.composite import freeze_towers, towers_of

    config = tiny_composite_config("gemma3")
    composite = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]._from_config(config)
    assert sorted(towers_of(composite)) == ["model.multi_modal_projector", "model.vision_tower"]
    assert freeze_towers(composite, vision_tower=True, projector=False) == ["model.vision_tower"]
    trainable = {name.split(".")[1] for name, p in composite.named_parameters()
                 if p.requires_grad and name.startswith("model.")}
    assert trainable == {"language_model", "multi_modal_projector"}


@pytest.mark.parametrize("model_type,reason", [
    ("paligemma", "a prefix-LM"),
    ("llama4", "its text decoder `llama4_text` is refused: chunked local attention"),
    ("blip-2", "its language model is a whole causal LM nested in the composite"),
])
def test_unsupported_composite_is_refused_before_any_weight_loads(tmp_path, model_type, reason):
    """Only config.json in model_path: the refusal comes from the family table, not from loading weights."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from train.config.sections import load_config
    from train.trainer import Trainer

    model_dir = tmp_path / "model"
    CONFIG_MAPPING[model_type]().save_pretrained(model_dir)
    packed = write_packed(tmp_path / "packed", random_rows(0, 2))
    config = write_config(tmp_path / "train.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp_path / "out"), max_steps=1, tokenizer_mismatch="warn")
    with pytest.raises(UnsupportedModelError, match=f"model family '{model_type}' cannot be trained on packed "
                                                    f"rows: {reason}"):
        Trainer(load_config(config))


def test_composite_resumes_to_the_same_weights(tmp_path, one_thread):  # noqa: F811
    from train.config.sections import load_config
    from train.trainer import Trainer

    _, final, _ = train_composite(tmp_path, "qwen2_5_vl")
    config, resumed = tmp_path / "train.yaml", tmp_path / "resumed"
    Trainer(load_config(config, [f"output_dir={resumed}", "stop_at_step=1"]), console=lambda *_: None).train()
    Trainer(load_config(config, [f"output_dir={resumed}", "resume=latest"]), console=lambda *_: None).train()
    want, got = load_file(final / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[key], want[key]) for key in want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type,parallel", [
    ("qwen2_5_vl", ["sequence_parallel_size=2"]),  # M-RoPE positions sharded with the row
    ("gemma3", ["deepspeed.stage=3"]),  # ZeRO-3 over 2 dp ranks: the towers partitioned too, frozen
])
def test_composite_trains_the_same_in_two_processes(tmp_path, model_type, parallel):
    """Sequence parallelism (Qwen2.5-VL) and ZeRO-3 data parallelism (Gemma 3) on a composite: the losses and
    gradient norms of one process training the same rows in the same steps (grad_accum=2 for the dp run)."""
    from tests._train_helpers import run_train
    from train.metrics import read_log

    model_dir = save_tiny_composite(tmp_path / "model", model_type)
    packed = write_packed(tmp_path / "packed", random_rows(0, 4))
    config = write_config(tmp_path / "train.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp_path / "unused"), max_steps=2, lr=1e-2, plot=False,
                          tokenizer_mismatch="warn", max_grad_norm=0.0)
    single = ["grad_accum=2"] if "deepspeed.stage=3" in parallel else []
    run_train(config, [f"output_dir={tmp_path / 'one'}", *single])
    run_train(config, [f"output_dir={tmp_path / 'two'}", "launch.num_processes=2", *parallel], nproc=2)
    one, two = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("model_type,reason", [
    ("gemma3", "the tokens of one image attend to each other bidirectionally"),
    ("llava", "PackSFT trains image conversations on the composites whose tower"),
    ("qwen2", "a text-only model: it has no vision tower"),
])
def test_image_conversations_are_refused_where_no_exact_image_path(model_type, reason):
    """From the config alone (the trainer asks before any weight loads when the data holds images)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from train.families import MediaInputs
    from train.model.support import check_media_support

    with pytest.raises(UnsupportedModelError, match=f"model family '{model_type}' cannot train on image "
                                                    f"conversations \\(the data holds images\\): {reason}"):
        check_media_support(CONFIG_MAPPING[model_type](), ["image"])
    for exact in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni_thinker"):
        assert isinstance(check_media_support(CONFIG_MAPPING[exact](), ["image"]), MediaInputs)


def test_trainer_refuses_images_before_any_weight_loads(tmp_path, monkeypatch):
    """Data holding images (the shards' image store) and a Gemma 3 checkpoint (config.json alone): the trainer stops
    at the family check, naming the family and why its image path is not exact."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import train.steps.online
    from train.config.sections import load_config
    from train.trainer import Trainer

    def with_images(*args, **kwargs):  # the dataset as an image store opens (data/shards/dataset.py's has_images)
        dataset = open_dataset(*args, **kwargs)
        dataset.has_images = True
        return dataset

    open_dataset = train.steps.online.open_train_dataset
    monkeypatch.setattr(train.steps.online, "open_train_dataset", with_images)
    model_dir = tmp_path / "model"
    CONFIG_MAPPING["gemma3"]().save_pretrained(model_dir)
    packed = write_packed(tmp_path / "packed", random_rows(0, 2))
    config = write_config(tmp_path / "train.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp_path / "out"), max_steps=1, tokenizer_mismatch="warn")
    with pytest.raises(UnsupportedModelError, match="model family 'gemma3' cannot train on image conversations "
                                                    r"\(the data holds images\): the tokens of one image attend"):
        Trainer(load_config(config))
