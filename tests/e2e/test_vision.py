"""Image conversations end to end: `data_process` on configs/data/example_vision.json (LLaMA-Factory's demo records
through the real Qwen2.5-VL processor, one record held out as the eval split) -> packed shards with images ->
configs/train/example_vision.yaml (the tiny random-init Qwen2.5-VL of configs/model/tiny_qwen2_5_vl.json, tower
trained) in one process, under sequence parallelism 2 and under DeepSpeed ZeRO-3 over 2 data-parallel ranks: the
same losses and gradient norms; the eval split with its images runs; `final/` is a Qwen2.5-VL that
AutoModelForImageTextToText loads, with the processor's files; stopped and resumed = uninterrupted.

max_length 400 packs the five training records into three rows of two, two and one records (2, 3 and 1 images), so
a step of two rows is two micro-batches in one process, one row per rank under dp = 2, and two rows of the sp group
under sp = 2 (the first row's second image, tokens 157-222 of 316, on both ranks)."""
from __future__ import annotations

import json

import pytest
import torch

from tests._train_helpers import ROOT, in_project_root, one_thread, run_train  # noqa: F401  (one_thread: a fixture)
from tests.conftest import fixture_path

pytestmark = pytest.mark.vision

DATA_CONFIG = ROOT / "configs" / "data" / "example_vision.json"
TRAIN_CONFIG = ROOT / "configs" / "train" / "example_vision.yaml"
RTOL = 1e-5
STEPS = 2


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The example's data pipeline, run once for the module: (packed dir, eval split's packed dir)."""
    fixture_path("multimodal", "qwen2_5_vl_processor")
    from data.config import load_config
    from data.pipeline import run_pipeline

    out = tmp_path_factory.mktemp("vision_data")
    with in_project_root():
        cfg = load_config(DATA_CONFIG, [f"output_dir={out}", "max_length=400", "eval_size=1"])
        cfg.validate()
        run_pipeline(cfg)
    return out / "packed", out / "eval" / "packed"


def _overrides(packed, out, *more: str) -> list[str]:
    """A step of two rows (accumulated in one process), the eval split after the last step, clipping off (the
    logged gradient norm is then the step gradient's own)."""
    return [f"data_path={packed[0]}", f"output_dir={out}", f"max_steps={STEPS}", "grad_accum=2", "max_grad_norm=0",
            f"eval_steps={STEPS}", "plot=false", *more]


def _train(overrides: list[str]) -> tuple[list[dict], list[str]]:
    from train.config.sections import load_config
    from train.trainer import Trainer

    lines: list[str] = []
    with in_project_root():
        log = Trainer(load_config(TRAIN_CONFIG, overrides), console=lines.append).train()
    return log, lines


@pytest.fixture(scope="module")
def reference(packed, tmp_path_factory):
    """One process, the self-check on: (log, console lines, output dir)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("vision_one") / "train"
    try:
        log, lines = _train(_overrides(packed, out))
    finally:
        torch.set_num_threads(before)
    return log, lines, out


def test_the_example_data_holds_images_in_the_rows_the_docstring_says(packed):
    from data.shards.dataset import PackedDataset

    train, held_out = PackedDataset(packed[0]), PackedDataset(packed[1])
    assert train.has_images and held_out.has_images
    assert [len(train[i]["seq_lens"]) for i in range(len(train))] == [2, 2, 1]
    assert [len(train[i]["image_grid_thw"]) for i in range(len(train))] == [2, 3, 1]
    assert len(held_out) == 1 and len(held_out[0]["image_grid_thw"]) == 2
    ids = torch.as_tensor(train[0]["input_ids"])
    image = torch.nonzero(ids == 151655).reshape(-1)  # the processor's <|image_pad|>
    second = image[image > image[0] + (image.diff() > 1).nonzero()[0, 0]]  # the second image's run
    assert torch.equal(second, torch.arange(int(second[0]), int(second[0]) + second.numel()))
    assert int(second[0]) < ids.numel() // 2 < int(second[-1])


def test_one_process_trains_evaluates_and_exports_a_composite(reference, packed):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    log, lines, out = reference
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in log)
    assert "eval_loss" in log[-1] and log[-1]["eval_loss"] > 0 and "eval_loss" not in log[0]
    assert any(line.startswith("self-check: packed = unpacked on 4 sequences (4 with media") for line in lines), lines
    assert any("media on: images (trained tower): each tower runs once per micro-batch" in line
               for line in lines), lines
    assert any(line.startswith("attention: sdpa on 2 layers: causal") for line in lines), lines  # not the tower's
    final = out / "final"
    for name in ("preprocessor_config.json", "chat_template.json"):  # the processor's files, from tokenizer_path
        assert (final / name).read_bytes() == fixture_path("multimodal", "qwen2_5_vl_processor", name).read_bytes()
    model = AutoModelForImageTextToText.from_pretrained(final)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    trained = {n for n, p in model.named_parameters() if "visual" in n}
    assert trained  # the tower is exported (and was trained: freeze_vision_tower false in the example)
    processor = AutoProcessor.from_pretrained(final)
    assert processor.image_token_id == model.config.image_token_id == 151655


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", [["sequence_parallel_size=2"], ["distributed_backend=fsdp2", "grad_accum=1"]],
                         ids=["sp2", "fsdp2_dp2"])
def test_two_processes_train_as_one(reference, packed, tmp_path, parallel):
    """sp = 2 (the two rows of a step accumulated over one sp group) and FSDP2 over dp = 2 (one row per rank, the
    weights sharded): the losses, gradient norms and eval loss of the single process within 1e-5."""
    one, _, _ = reference
    out = tmp_path / "two"
    run_train(TRAIN_CONFIG, [*_overrides(packed, out), "launch.num_processes=2", "self_check=false", *parallel],
              nproc=2)
    from train.metrics import read_log

    two = read_log(out)
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for got, want in zip(two, one):
        assert got["loss_tokens"] == want["loss_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
    assert two[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=RTOL)


def test_stopped_and_resumed_equals_uninterrupted(reference, packed, tmp_path, one_thread):  # noqa: F811
    from safetensors.torch import load_file

    one, _, out = reference
    resumed = tmp_path / "resumed"
    first, _ = _train(_overrides(packed, resumed, "stop_at_step=1", "self_check=false"))
    rest, _ = _train(_overrides(packed, resumed, "resume=latest", "self_check=false"))
    assert [r["step"] for r in first + rest] == [r["step"] for r in one]
    for got, want in zip(first + rest, one):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
    want, got = load_file(out / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[key], want[key]) for key in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert json.loads((resumed / "final" / "config.json").read_text())["model_type"] == "qwen2_5_vl"


def test_self_check_says_why_it_skips_long_image_sequences(packed, tmp_path, monkeypatch, one_thread):  # noqa: F811
    """Image sequences are checked whole: where the first rows hold none short enough, the start line says so (not
    that the data has no sequence of 2 tokens)."""
    import train.run.check
    import train.trainer
    from train.config.sections import load_config

    monkeypatch.setattr(train.run.check, "SELF_CHECK_MAX_TOKENS", 100)  # the example's sequences have 140-195 tokens
    lines: list[str] = []
    with in_project_root():
        train.trainer.Trainer(load_config(TRAIN_CONFIG, _overrides(packed, tmp_path / "out")), console=lines.append)
    assert "self-check skipped: the first 3 rows hold fewer than 2 sequences of 2 to 100 tokens, which it checks " \
           "whole (media are never cut" in "\n".join(lines), lines


def test_chat_with_the_export_takes_text_and_image_turns(reference, monkeypatch, capsys):
    """The run's own `try it: python -m train.chat …/final` (before: AutoModelForCausalLM refused Qwen2_5_VLConfig):
    a text turn, then `/image PATH` and a turn about it, which the processor renders with the image's tokens and
    whose pixel values reach the model."""
    import io
    import sys

    from train import chat

    final = reference[2] / "final"
    image = fixture_path("multimodal", "mllm_demo_data", "1.jpg")
    seen = []
    real_generate = None

    def spying(self, *args, **kwargs):
        seen.append({key: kwargs[key] for key in ("input_ids", "pixel_values", "image_grid_thw") if key in kwargs})
        return real_generate(self, *args, **kwargs)

    from transformers import Qwen2_5_VLForConditionalGeneration

    real_generate = Qwen2_5_VLForConditionalGeneration.generate
    monkeypatch.setattr(Qwen2_5_VLForConditionalGeneration, "generate", spying)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Hello\n/image {image}\nWhat is in the picture?\n"))
    assert chat.main([str(final), "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert len([line for line in captured.out.splitlines() if line.startswith("assistant:")]) == 2, captured
    assert f"(image attached to your next turn: {image})" in captured.err
    text_turn, image_turn = seen
    assert "pixel_values" not in text_turn and image_turn["pixel_values"].shape[0] > 0
    tokens = int((image_turn["input_ids"] == 151655).sum())  # <|image_pad|>: one per 2x2 merged patches
    assert tokens == int(image_turn["image_grid_thw"].prod(dim=-1).sum()) // 4 > 0
