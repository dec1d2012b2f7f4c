"""Video and audio rows exact against transformers, through the user's path: the shared fixtures' video, audio and
image conversations (H.264 and VP9 clips, a clip with its AAC sound, wav, MP3, stereo FLAC, the image demo's JPEGs)
-> the data pipeline with the released Qwen2.5-Omni processor (data/processors.py) -> one packed row -> the
Trainer's start-up and one step of configs/train/example_av.yaml (the tiny random-init Omni thinker, towers trained),
against transformers' own thinker forward on each conversation alone with the processor's output on the whole
conversation, its files decoded as transformers decodes them (PyAV, the processor sampling 2 frames per second; audio
resampled to 16 kHz mono): per-sequence logits, the loss and every gradient (fp32).

Measured (2026-12-02, merged with the data side's media store): logits 4.9e-7, loss 1.3e-7, worst gradient 1.5e-6.
Needs the data side's media store (data/shards/media.py, its `MediaLoader` given to make_batch as `media=` by the
trainer) and .venv-vision: `.venv-vision/bin/python -m pytest -m vision tests/train/model/test_media_exact.py`."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests import _media_inputs as mi
from tests._train_helpers import ROOT, in_project_root
from tests.conftest import fixture_path

pytestmark = pytest.mark.vision
pytest.importorskip("data.shards.media", reason="the data side's media store (video and audio shards) is not here")

TRAIN_CONFIG = ROOT / "configs" / "train" / "example_av.yaml"
VIDEO_MAX_PIXELS, IMAGE_MAX_PIXELS, FPS = 112 * 112, 224 * 224, 2.0
LOGIT_TOL, LOSS_TOL, GRAD_TOL = 1e-6, 1e-6, 2e-5


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """The av demo's records and the image demo's first two, each record's first message marked so no two render
    alike, through the data pipeline into one packed row. (records, processor directory, packed dir)."""
    from data.config import load_config
    from data.pipeline import run_pipeline
    from data.processors import write_processor

    root = tmp_path_factory.mktemp("media_exact")
    demo = fixture_path("multimodal")
    processor = write_processor("qwen2_5_omni", root / "processor")
    records = json.loads((demo / "mllm_av_demo.json").read_text()) + json.loads(
        (demo / "mllm_demo.json").read_text())[:2]
    for k, record in enumerate(records):
        for key in ("images", "videos", "audios"):
            if key in record:
                record[key] = [str(demo / path) for path in record[key]]
        record["messages"][0]["content"] += f" ({k})"
    (root / "data.json").write_text(json.dumps(records))
    config = {"inputs": [{"path": str(root / "data.json"), "category_name": "av"}], "output_dir": str(root / "out"),
              "tokenizer_path": str(processor), "max_length": 4096, "seed": 42, "num_workers": 0, "on_error": "error",
              "image_max_pixels": IMAGE_MAX_PIXELS, "video_max_pixels": VIDEO_MAX_PIXELS, "video_fps": FPS,
              "image_root": [str(demo)]}
    (root / "data_config.json").write_text(json.dumps(config))
    cfg = load_config(root / "data_config.json", [])
    cfg.validate()
    run_pipeline(cfg)
    return records, processor, root / "out" / "packed"


def _reference_inputs(processor, record: dict) -> dict:
    """transformers alone: the processor's chat template on the record's parts, then the processor on the files as
    transformers decodes them, sampling 2 frames per second itself; a clip named in both lists carries its sound."""
    from PIL import Image

    inside = [p for p in record.get("audios", []) if p in record.get("videos", [])]
    messages, _ = mi._messages(record, inside)
    text = processor.apply_chat_template(messages, tokenize=False)
    videos = [mi.load_video(p) for p in record.get("videos", [])]
    kwargs = {"images_kwargs": {"size": {"shortest_edge": processor.image_processor.size["shortest_edge"],
                                         "longest_edge": IMAGE_MAX_PIXELS}}}
    if videos:
        kwargs["videos_kwargs"] = {"fps": FPS, "do_sample_frames": True, "cap_pixels_per_frame": False,
                                   "size": {"shortest_edge": processor.video_processor.size["shortest_edge"],
                                            "longest_edge": VIDEO_MAX_PIXELS},
                                   "video_metadata": [meta for _, meta in videos]}
    if inside:
        kwargs.update(load_audio_from_video=True, audio_from_video_indices=[
            record["videos"].index(p) if p in inside else None for p in record["audios"]])
    audios = [mi.load_audio(p) for p in record.get("audios", [])]
    enc = processor(text=[text], images=[Image.open(p) for p in record.get("images", [])] or None,
                    videos=[frames for frames, _ in videos] or None, audio=audios or None, return_tensors="pt",
                    **kwargs)
    return {**enc, "use_audio_in_video": bool(inside)}


def test_a_packed_row_of_video_and_audio_conversations_equals_the_thinker_per_conversation(conversations, tmp_path):
    import torch.nn.functional as F
    from transformers import AutoProcessor

    from data.shards.dataset import PackedDataset
    from train.config.sections import load_config
    from train.model.lm_head import decoder_of
    from train.trainer import Trainer

    records, processor_dir, packed = conversations
    data = PackedDataset(packed)
    assert len(data) == 1  # one row: the whole step is one micro-batch of every conversation
    row = data[0]
    assert len(row["seq_lens"]) == len(records)
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
        assert model.media is not None and model.media.kinds == ("image", "video", "audio")
        assert all(model.media.trains(lm, kind) for kind in model.media.kinds)

        processor = AutoProcessor.from_pretrained(processor_dir)
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
                model.media.reset_positions(lm)
                logits = lm(**by_ids[ids], use_cache=False).logits[0]
                want_logits.append(logits.detach().clone())
                loss = F.cross_entropy(logits[:-1], labels[1:], reduction="sum") / n_targets
                loss.backward()
                want_loss += float(loss.detach())
        want_grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None}
        lm.zero_grad(set_to_none=True)

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
    assert sorted(got_grads) == sorted(want_grads)
    assert any(".visual." in n for n in want_grads) and any(".audio_tower." in n for n in want_grads)
    scale = max(float(g.abs().max()) for g in want_grads.values())
    errors = {n: float((got_grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale)
              for n, g in want_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_TOL, (worst, errors[worst])
