"""The processor directories of data/processors.py: each loads with `AutoProcessor` as transformers' own classes,
with the released tokens at their ids, chat template and preprocessing values; the Qwen2.5-VL one is the fixture's
processor; the tiny random-init models of configs/model/ build and run a forward on that processor's outputs.
(Needs .venv-vision: the Qwen2-VL processors import torchvision.)"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from common.config import ConfigError
from data.processors import RELEASES, check_processor, main, write_processor
from tests.conftest import ROOT, fixture_path

pytestmark = pytest.mark.vision
TINY_MODELS = {  # processor -> (model config, model class) of the example configs
    "qwen2_5_vl": ("tiny_qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("tiny_qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "qwen2_audio": ("tiny_qwen2_audio", "Qwen2AudioForConditionalGeneration"),
    "qwen2_5_omni": ("tiny_qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration"),
}


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    fixture_path("tokenizers", "qwen3", "vocab.json")
    root = tmp_path_factory.mktemp("processors")
    return {name: main([name, str(root / name)]) == 0 and root / name for name in RELEASES}


def test_every_release_loads_as_transformers_builds_it(processors):
    from transformers import AutoProcessor

    for name, path in processors.items():
        processor = check_processor(name, path)  # class, token ids, attributes, template, values
        release = RELEASES[name]
        rendered = processor.apply_chat_template([{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Hello."}], tokenize=False)
        ids = processor.tokenizer(rendered)["input_ids"]
        assert processor.tokenizer.decode(ids) == rendered and "<|im_start|>assistant\nHello.<|im_end|>" in rendered
        assert all(len(processor.tokenizer.encode(text)) == 1 for text, _ in release.tokens.values())
        assert type(AutoProcessor.from_pretrained(str(path))).__name__ == release.processor_class
    qwen3_vl = (processors["qwen3_vl"] / "chat_template.jinja").read_bytes()
    assert hashlib.sha256(qwen3_vl).hexdigest() == \
        "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"  # the release's bytes
    omni = AutoProcessor.from_pretrained(str(processors["qwen2_5_omni"]))
    assert (omni.image_token_id, omni.video_token_id, omni.audio_token_id) == (151655, 151656, 151646)
    assert omni.feature_extractor.n_samples == 300 * 16000 and omni.feature_extractor.feature_size == 128
    audio = AutoProcessor.from_pretrained(str(processors["qwen2_audio"]))
    assert audio.audio_token_id == 151646 and audio.feature_extractor.n_samples == 30 * 16000


def test_the_qwen2_5_vl_processor_is_the_fixtures(processors):
    from transformers import AutoProcessor

    ours = AutoProcessor.from_pretrained(str(processors["qwen2_5_vl"]))
    fixture = AutoProcessor.from_pretrained(str(fixture_path("multimodal", "qwen2_5_vl_processor")))
    assert ours.image_processor.to_dict() == fixture.image_processor.to_dict()
    assert ours.video_processor.to_dict() == fixture.video_processor.to_dict()
    assert ours.chat_template == fixture.chat_template
    assert ours.tokenizer.get_added_vocab() == fixture.tokenizer.get_added_vocab()


def test_the_check_refuses_a_directory_that_is_not_the_release(processors, tmp_path):
    import shutil

    tampered = tmp_path / "omni"
    shutil.copytree(processors["qwen2_5_omni"], tampered)
    config = json.loads((tampered / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151646"]["content"] = "<|object_ref_start|>"  # Qwen2.5's token at the audio id
    (tampered / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="not the Qwen/Qwen2.5-Omni-7B processor: token '<.AUDIO.>' is id"):
        check_processor("qwen2_5_omni", tampered)


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown processor 'qwen9'"):
        write_processor("qwen9", tmp_path / "x")
    with pytest.raises(ConfigError, match="no vocab.json / merges.txt there"):
        write_processor("qwen2_audio", tmp_path / "x", tmp_path)
    assert not (tmp_path / "x").exists()


def _tiny_model(name: str):
    import torch
    import transformers

    config_name, class_name = TINY_MODELS[name]
    config = transformers.AutoConfig.from_pretrained(str(ROOT / "configs" / "model" / f"{config_name}.json"))
    torch.manual_seed(0)
    return getattr(transformers, class_name)._from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_the_tiny_models_run_on_their_processors_outputs(processors, name):
    """A forward of the example's tiny model on a conversation of each kind its processor takes (a video clip, or a
    tone): the ids fit its vocabulary and the towers take the processor's tensors."""
    import torch
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(processors[name]))
    t = np.arange(16000, dtype=np.float32) / 16000
    parts, media = [], {}
    if hasattr(processor, "video_processor"):
        frames = (np.arange(4 * 56 * 56 * 3) % 251).astype(np.uint8).reshape(4, 56, 56, 3)
        parts.append({"type": "video", "video": "clip"})
        media.update(videos=[frames], do_sample_frames=False)
    if getattr(processor, "audio_token", None):
        parts.append({"type": "audio", "audio": "tone"})
        media["audio"] = [np.sin(2 * np.pi * 440 * t).astype(np.float32)]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "A test."}]
    text = processor.apply_chat_template(messages, tokenize=False)
    inputs = dict(processor(text=[text], return_tensors="pt", **media))
    for key in ("second_per_grid_ts", "video_second_per_grid"):
        if key in inputs:
            inputs[key] = torch.as_tensor(inputs[key])
    model = _tiny_model(name)
    assert int(inputs["input_ids"].max()) < model.config.get_text_config().vocab_size
    with torch.no_grad():
        out = model(**inputs, labels=inputs["input_ids"])
    assert torch.isfinite(out.loss) and out.logits.shape[1] == inputs["input_ids"].shape[1]
    config = json.loads((ROOT / "configs" / "model" / f"{TINY_MODELS[name][0]}.json").read_text())
    assert config["text_config"]["hidden_size"] <= 64 and config["text_config"]["num_hidden_layers"] <= 2
