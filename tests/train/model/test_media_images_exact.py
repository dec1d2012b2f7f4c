"""Image rows exact against transformers, through the user's path: LLaMA-Factory-style conversations over the shared
fixture images (and transparent PNG versions of them) -> the data pipeline (the shards keep each file's bytes) ->
one packed row -> the Trainer's start-up (plan, engine) and one step of configs/train/example_vision.yaml (the tiny
random-init Qwen2.5-VL, tower trained), against transformers' own composite forward on each conversation alone with
`processor(text=render, images=[Image.open(path), ...])`: per-sequence logits, the loss and every gradient (fp32).

The transparent images are what made rows inexact: the shards' bytes were decoded and converted to RGB by Pillow
before the processor (the alpha channel dropped, a transparent pixel keeping its hidden colour), where the processor
composites transparency onto white (`do_convert_rgb`). Opaque images were already exact.

Run in .venv-vision (the processor imports torchvision): `.venv-vision/bin/python -m pytest -m vision ...`."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tests._train_helpers import ROOT, in_project_root
from tests.conftest import fixture_path

pytestmark = pytest.mark.vision

TRAIN_CONFIG = ROOT / "configs" / "train" / "example_vision.yaml"
MAX_PIXELS = 200704  # configs/data/example_vision.json's image_max_pixels
SIZE = {"shortest_edge": 3136, "longest_edge": MAX_PIXELS}  # the processor's min_pixels, the example's max
# fp32: rounding alone (eager reference vs packed kernels, another summation order) measures ~2e-7 on the logits,
# ~1e-7 on the loss and ~1e-6 on the worst gradient; one transparent image decoded the old way moves them by 1e-3 to 1
LOGIT_TOL, LOSS_TOL, GRAD_TOL = 1e-6, 1e-6, 2e-5


def _transparent_images(directory) -> dict[str, str]:
    """PNG versions of the fixture images with transparency, in the modes Pillow gives it: RGBA (an alpha ramp, fully
    transparent on the left), a palette with a transparent index, grey + alpha."""
    from PIL import Image

    demo = fixture_path("multimodal", "mllm_demo_data")
    out = {}
    rgba = np.array(Image.open(demo / "2.jpg").convert("RGBA"))
    rgba[..., 3] = np.linspace(0, 255, rgba.shape[1]).astype(np.uint8)[None]
    out["rgba"] = directory / "2_rgba.png"
    Image.fromarray(rgba, "RGBA").save(out["rgba"])
    out["palette"] = directory / "3_palette.png"
    rgb = np.array(Image.open(demo / "3.jpg").convert("RGB"))
    rgb[:, : rgb.shape[1] // 3] = 0  # a black left third, its palette index transparent
    palette = Image.fromarray(rgb).convert("P")
    palette.save(out["palette"], transparency=int(np.array(palette)[0, 0]))
    grey = np.array(Image.open(demo / "1.jpg").convert("LA"))
    grey[::2, :, 1] = 0  # every other line transparent
    out["grey_alpha"] = directory / "1_la.png"
    Image.fromarray(grey, "LA").save(out["grey_alpha"])
    return {name: str(path) for name, path in out.items()}


def _processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(fixture_path("multimodal", "qwen2_5_vl_processor")))


def _reference_inputs(processor, record: dict) -> dict:
    """transformers alone: the processor's chat template on image parts, then processor(text, images) on the image
    files as Pillow opens them."""
    from PIL import Image

    messages = [{**m, "content": [{"type": "image"} if part == "<image>" else {"type": "text", "text": part}
                                  for part in re.split(r"(<image>)", m["content"]) if part]}
                if m["role"] == "user" else m for m in record["messages"]]
    text = processor.apply_chat_template(messages, tokenize=False)
    return processor(text=[text], images=[Image.open(path) for path in record["images"]], return_tensors="pt",
                     size=SIZE)


def test_pixel_values_are_the_processors_on_the_opened_file(tmp_path):
    """The trainer's media loader on a file's stored bytes = the image processor on `Image.open(file)`, for opaque
    and transparent images (those with an alpha band differ from their RGB-converted selves: what the old decoding
    gave the processor)."""
    from PIL import Image

    from data.shards.dataset import StoredMedia
    from data.shards.media import MediaLoader
    from data.shards.processor import MediaSettings

    processor = _processor()
    loader = MediaLoader(MediaSettings(str(fixture_path("multimodal", "qwen2_5_vl_processor")), None, MAX_PIXELS))
    files = {**_transparent_images(tmp_path), "jpeg": str(fixture_path("multimodal", "mllm_demo_data", "1.jpg"))}
    for name, path in files.items():
        want = processor.image_processor(images=[Image.open(path)], return_tensors="pt", size=SIZE)
        grid = tuple(int(v) for v in want["image_grid_thw"][0])
        stored = StoredMedia("image", open(path, "rb").read(), grid, grid[0] * grid[1] * grid[2] // 4)
        inputs = loader.item(stored).inputs
        got = inputs["pixel_values"]
        assert torch.equal(inputs["image_grid_thw"], want["image_grid_thw"]) and torch.equal(got, want["pixel_values"]), name
        dropped = processor.image_processor(images=[Image.open(path).convert("RGB")], return_tensors="pt", size=SIZE)
        # Pillow's convert("RGB") keeps a palette's transparent colour (info["transparency"]), which the processor
        # composites too; an alpha band it drops
        assert torch.equal(dropped["pixel_values"], got) == (name in ("jpeg", "palette")), name


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """LLaMA-Factory's demo records with absolute image paths, three of their images replaced by transparent PNG
    versions, each record's first message marked so no two render alike; run through the data pipeline into one
    packed row. (records, packed dir)."""
    from data.config import load_config
    from data.pipeline import run_pipeline

    root = tmp_path_factory.mktemp("vision_exact")
    demo = fixture_path("multimodal")
    transparent = _transparent_images(root)
    records = json.loads((demo / "mllm_demo.json").read_text())
    for k, record in enumerate(records):
        record["images"] = [str(demo / path) for path in record["images"]]
        record["messages"][0]["content"] += f" ({k})"
    records[1]["images"] = [transparent["rgba"]]
    records[2]["images"] = [transparent["palette"]]
    records[3]["images"][1] = transparent["grey_alpha"]
    (root / "data.json").write_text(json.dumps(records))
    config = {"inputs": [{"path": str(root / "data.json"), "category_name": "vision"}], "output_dir": str(root / "out"),
              "tokenizer_path": str(demo / "qwen2_5_vl_processor"), "max_length": 2048, "seed": 42,
              "num_workers": 0, "on_error": "error", "image_max_pixels": MAX_PIXELS,
              "image_root": str(demo / "mllm_demo_data")}
    (root / "data_config.json").write_text(json.dumps(config))
    cfg = load_config(root / "data_config.json", [])
    cfg.validate()
    run_pipeline(cfg)
    return records, root / "out" / "packed"


def test_a_packed_row_of_image_conversations_equals_the_composite_per_conversation(conversations, tmp_path):
    import torch.nn.functional as F

    from data.shards.dataset import PackedDataset
    from train.config.sections import load_config
    from train.model.lm_head import decoder_of
    from train.trainer import Trainer

    records, packed = conversations
    data = PackedDataset(packed)
    assert len(data) == 1  # one row: the whole step is one micro-batch of six conversations, eight images
    row = data[0]
    assert len(row["seq_lens"]) == len(records) and len(row["image_grid_thw"]) == 8
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lines: list[str] = []
        overrides = [f"data_path={packed}", f"output_dir={tmp_path / 'train'}", "max_steps=1", "grad_accum=1",
                     "max_grad_norm=0", "self_check=false", "plot=false", "save_steps=0"]
        with in_project_root():
            trainer = Trainer(load_config(TRAIN_CONFIG, overrides), console=lines.append)
        model = trainer.model
        lm = model.lm
        assert model.media is not None and model.media.trains(lm, "image")

        # transformers' composite on each conversation alone (its eager attention, its own positions), the row's
        # order and labels, token-mean weights as the step's
        processor = _processor()
        bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        by_ids = {}
        for record in records:
            enc = _reference_inputs(processor, record)
            by_ids[tuple(enc["input_ids"][0].tolist())] = enc
        sequences = [(tuple(int(t) for t in row["input_ids"][a:b]), torch.as_tensor(row["labels"][a:b]).long())
                     for a, b in zip(bounds[:-1], bounds[1:])]
        assert all(ids in by_ids for ids, _ in sequences)  # the pipeline's ids are the processor's, every record
        n_targets = sum(int((labels[1:] != -100).sum()) for _, labels in sequences)
        want_logits, want_loss = [], torch.zeros((), dtype=torch.float64)
        lm.zero_grad(set_to_none=True)
        with model.unpacked():
            for ids, labels in sequences:
                enc = by_ids[ids]
                logits = lm(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"],
                            image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=enc["mm_token_type_ids"],
                            use_cache=False).logits[0]
                want_logits.append(logits.detach().clone())
                loss = F.cross_entropy(logits[:-1], labels[1:], reduction="sum") / n_targets
                loss.backward()
                want_loss += float(loss.detach())
        want_grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None}
        lm.zero_grad(set_to_none=True)

        # the trainer's step: its logits (the head on the packed decoder's output, before the optimizer moves it)
        # and its gradients
        got_logits, got_grads = [], {}
        head = lm.get_output_embeddings()

        def keep_logits(module, args, output):
            with torch.no_grad():
                got_logits.append(head(output.last_hidden_state[0]).detach().clone())

        handle = decoder_of(lm).register_forward_hook(keep_logits)
        trainer.grad_hook = lambda t: got_grads.update(
            {n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None})
        try:
            log = trainer.train()
        finally:
            handle.remove()
    finally:
        torch.set_num_threads(before)

    assert len(got_logits) == 1
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        want = want_logits[k]
        error = float((got_logits[0][a:b] - want).abs().max()) / float(want.abs().max())
        assert error <= LOGIT_TOL, (k, error)
    assert abs(log[0]["loss"] - float(want_loss)) / float(want_loss) <= LOSS_TOL, (log[0]["loss"], float(want_loss))
    assert sorted(got_grads) == sorted(want_grads) and any(".visual." in n for n in want_grads)
    scale = max(float(g.abs().max()) for g in want_grads.values())
    errors = {n: float((got_grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale)
              for n, g in want_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_TOL, (worst, errors[worst])
    norm = float(torch.sqrt(sum(g.double().square().sum() for g in want_grads.values())))
    assert log[0]["grad_norm"] == pytest.approx(norm, rel=LOSS_TOL)
