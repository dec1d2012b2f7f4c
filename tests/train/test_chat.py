"""Talking to a trained model (train/chat.py, `python -m train.chat`): a tokenizer without a chat template is told how
to give one, and with a built-in template each line gets the answer transformers' own greedy generation gives;
what is not a model directory is refused; a composite's export (the image example's `try it:` line) loads with its
own class and answers text turns (images with the processor: tests/e2e/test_vision.py, .venv-vision)."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from data.shards.chat_templates import BUILTIN_TEMPLATES
from tests._train_helpers import ROOT
from tests.conftest import fixture_path, tokenizer_dir


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    """A tiny random Qwen2 with gpt2's vocabulary and tokenizer (no chat template), saved as an export is."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("gpt2_model")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("gpt2"))
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _reference_replies(path: Path, template: str, turns: list[str], max_new_tokens: int) -> list[str]:
    """transformers alone: greedy generation on the conversation so far, cut at the end-of-turn marker."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = BUILTIN_TEMPLATES[template]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    messages, replies = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:]).split("<|im_end|>")[0].split(tok.eos_token)[0].strip()
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def test_chat_without_a_template_says_how_and_with_one_answers_each_line(gpt2_model, monkeypatch, capsys):
    from train import chat

    assert chat.main([str(gpt2_model)]) == 2
    assert "the tokenizer has no chat template; give --template (a built-in name: chatml, llama3, phi3, qwen" in \
        capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 3?\n\nAnd 4 + 4?\n/reset\nWhat is 2 + 3?\n"))
    assert chat.main([str(gpt2_model), "--template", "chatml", "--max-new-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("assistant: ") for line in lines)
    replies = [line.removeprefix("assistant: ") for line in lines]
    assert replies[:2] == _reference_replies(gpt2_model, "chatml", ["What is 2 + 3?", "And 4 + 4?"], 6)
    assert replies[2] == replies[0]  # /reset: a new conversation, greedy


def test_chat_refuses_what_is_not_a_model(tmp_path, capsys):
    from train import chat

    (tmp_path / "adapter_config.json").write_text("{}")
    assert chat.main([str(tmp_path)]) == 2
    assert "not a model directory (no config.json) (a LoRA run exports an adapter" in capsys.readouterr().err


@pytest.fixture(scope="module")
def composite_export(tmp_path_factory):
    """What the trainer exports for configs/train/example_vision.yaml (train/run/export.py): the
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
