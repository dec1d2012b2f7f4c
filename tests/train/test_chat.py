"""`python -m train.chat DIR` on a composite's export (the image example's `try it:` line): a Qwen2.5-VL loads with
its own class and answers text turns in .venv; `/image` there says why it takes no image (its processor needs
torchvision) instead of failing. Images with the processor: tests/e2e/test_vision.py (.venv-vision). Before:
`AutoModelForCausalLM` refused Qwen2_5_VLConfig with a traceback."""
from __future__ import annotations

import io
import sys

import pytest

from tests._train_helpers import ROOT
from tests.conftest import fixture_path


@pytest.fixture(scope="module")
def composite_export(tmp_path_factory):
    """What the trainer exports for configs/train/example_vision.yaml (train/trainer.py `_write_export`): the
    random-init tiny Qwen2.5-VL, the tokenizer of its processor directory, the processor's files."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from train.model.composite import copy_processor_files

    processor = fixture_path("multimodal", "qwen2_5_vl_processor")
    final = tmp_path_factory.mktemp("vl") / "final"
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(ROOT / "configs/model/tiny_qwen2_5_vl.json")
                                            ).save_pretrained(final)
    AutoTokenizer.from_pretrained(processor).save_pretrained(final)
    assert copy_processor_files(processor, final) == ["preprocessor_config.json", "chat_template.json"]
    return final


def test_chat_answers_text_turns_of_a_composite_export(composite_export, monkeypatch, capsys):
    from train.chat import main

    image = fixture_path("multimodal", "mllm_demo_data", "1.jpg")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Hello\n/image {image}\nWhat is 2 + 3?\n"))
    assert main([str(composite_export), "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    answers = [line for line in captured.out.splitlines() if line.startswith("assistant:")]
    assert len(answers) == 2, captured.out
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 (.venv: the CPU torch wheel, beside which torchvision does not load)
        assert ("error: /image: this model takes no images here: its processor does not load in this environment "
                "(ImportError: ") in captured.err
        assert "images need torchvision: run .venv-vision/bin/python -m train.chat" in captured.err
    else:
        assert f"(image attached to your next turn: {image})" in captured.err
