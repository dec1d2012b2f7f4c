"""Video and audio conversations through the pipeline with the real processors of data/processors.py (Qwen2.5-VL,
Qwen3-VL, Qwen2-Audio, Qwen2.5-Omni) on ../shared/fixtures/multimodal/mllm_av_demo.json (H.264 + AAC mp4, VP9
WebM, 16 kHz WAV, 22.05 kHz stereo FLAC, 44.1 kHz MP3):

- every kept record's ids are transformers' `processor(text=render, videos=..., audio=...)["input_ids"]`, the
  render by the processor's own chat template, videos decoded frame by frame with PyAV (all frames, the processor's
  own sampling) and the 16 kHz WAV read by soundfile; media tokens carry no label nor turn id;
- the trainer's media loader on the stored bytes gives, item by item, tensors whose concatenation is the processor's
  output on the whole conversation, bit for bit;
- a kind the processor does not take is dropped and counted (`unsupported_media`); report.json, meta.json and
  stats.json count videos, audios, their tokens and seconds.
(Needs .venv-vision: torchvision, PyAV, soundfile.)"""
from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from data import pipeline
from data.processors import main as write_processor
from data.shards.dataset import PackedDataset
from data.shards.media import MediaLoader
from tests.conftest import fixture_path

pytestmark = pytest.mark.vision
# processor -> (its data config keys, the demo records it keeps: the others hold a kind it does not take)
CASES = {
    "qwen2_5_vl": ({}, [0, 5]),  # every decoded frame, as the released processor does
    "qwen3_vl": ({}, [0, 5]),  # 2 frames/s by its own sampling, timestamps in the text
    "qwen2_audio": ({}, [1, 2]),
    "qwen2_5_omni": ({"video_fps": 2.0}, [0, 1, 2, 3, 4, 5]),  # audio-in-video in record 3
}
TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def av(*parts):
    return fixture_path("multimodal", *parts)


def demo_records() -> list[dict]:
    return json.loads(av("mllm_av_demo.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per processor: its directory and the pipeline's output on the demo (on_error: skip)."""
    av("mllm_av_demo.json")
    root = tmp_path_factory.mktemp("media")
    out = {}
    for name, (keys, _) in CASES.items():
        assert write_processor([name, str(root / f"proc_{name}")]) == 0
        config = root / f"{name}.json"
        config.write_bytes(orjson.dumps({
            "inputs": [{"path": str(av("mllm_av_demo.json")), "category_name": "av"}],
            "output_dir": str(root / name), "tokenizer_path": str(root / f"proc_{name}"), "max_length": 32768,
            "num_workers": 1, "on_error": "skip", **keys}))
        stages = [] if name == "qwen2_5_omni" else ["--stages", "preprocess,sample,merge,tokenize"]
        pipeline.main([str(config), *stages])
        out[name] = root
    return out


def _video(path: str):
    """All frames of a video as PyAV decodes them (transformers' PyAV reader's `to_ndarray("rgb24")`) and their
    metadata: the input transformers' video processors sample from."""
    import av as pyav
    from transformers.video_utils import VideoMetadata

    with pyav.open(path) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        fps = float(stream.average_rate)
    return frames, VideoMetadata(total_num_frames=len(frames), fps=fps, duration=len(frames) / fps,
                                 video_backend="pyav", height=frames.shape[1], width=frames.shape[2])


def _audio(path: str, from_video: bool = False) -> np.ndarray:
    """16 kHz mono: the 16 kHz WAV read by soundfile as transformers' soundfile loader reads it (float32; its
    `load_audio` also wants soxr, absent here, though this file needs no resampling); the others (resampled, or a
    video's AAC track, which transformers decodes only with torchcodec) through the pipeline's decoder."""
    if path.endswith(".wav"):
        import soundfile

        samples, rate = soundfile.read(path, dtype="float32")
        assert rate == 16000 and samples.ndim == 1
        return samples
    from data.shards.decode import MediaLimits, decode_audio

    with open(path, "rb") as f:
        return decode_audio(f.read(), path, "audio", MediaLimits(), 16000, from_video=from_video)


def reference(processor, raw: dict, keys: dict):
    """transformers alone: the processor's chat template on media parts, then the processor on the render."""
    base = str(av())
    videos, audios = list(raw.get("videos", ())), list(raw.get("audios", ()))
    with_audio = [v for v in videos if v in audios]  # LLaMA-Factory's audio-in-video: the same file in both
    messages, slots, frames, metadata, waves = [], [], [], [], []
    v = a = 0
    for msg in raw["messages"]:
        parts, text = [], msg["content"]
        while text:
            cut = min([i for i in (text.find("<video>"), text.find("<audio>")) if i >= 0], default=len(text))
            if cut:
                parts.append({"type": "text", "text": text[:cut]})
            if cut == len(text):
                break
            tag, text = text[cut:cut + 7], text[cut + 7:]
            if tag == "<video>":
                path = f"{base}/{videos[v]}"
                parts.append({"type": "video", "video": path})
                f, m = _video(path)
                frames.append(f)
                metadata.append(m)
                if videos[v] in with_audio:
                    waves.append(_audio(path, from_video=True))
                    slots.append(len(frames) - 1)
                v += 1
            else:
                if audios[a] not in with_audio:
                    parts.append({"type": "audio", "audio": f"{base}/{audios[a]}"})
                    waves.append(_audio(f"{base}/{audios[a]}"))
                    slots.append(None)
                a += 1
        messages.append({**msg, "content": parts if msg["role"] == "user" else msg["content"]})
    text = processor.apply_chat_template(messages, tokenize=False)
    kwargs = {"fps": keys["video_fps"], "do_sample_frames": True} if keys.get("video_fps") else {}
    if frames:
        kwargs.update(videos=frames, video_metadata=metadata)
    if waves:
        kwargs["audio"] = waves
    if with_audio:
        kwargs.update(load_audio_from_video=True, audio_from_video_indices=slots)
    return processor(text=[text], return_tensors="pt", **kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ids_are_the_processors_and_the_loader_rebuilds_its_tensors(runs, name):
    import torch
    from transformers import AutoProcessor

    keys, kept = CASES[name]
    root = runs[name]
    processor = AutoProcessor.from_pretrained(str(root / f"proc_{name}"))
    tokenized = PackedDataset(root / name / "tokenized", verify="full")
    merged = [orjson.loads(line) for line in (root / name / "merged.jsonl").read_bytes().splitlines()]
    records = demo_records()
    uids = [merged[int(tokenized[i]["record_index"][0])]["meta"]["uid"] for i in range(len(tokenized))]
    assert sorted(uids) == kept
    report = json.loads((root / name / "report.json").read_text())["tokenize"]
    assert report["dropped"] == ({"unsupported_media": 6 - len(kept)} if len(kept) < 6 else {})
    loader = MediaLoader.of(tokenized.meta)
    media_ids = [processor.tokenizer.convert_tokens_to_ids(getattr(processor, f"{k}_token"))
                 for k in ("image", "video", "audio") if getattr(processor, f"{k}_token", None)]
    for i, uid in enumerate(uids):
        row, raw = tokenized[i], records[uid]
        ref = reference(processor, raw, keys)
        assert row["input_ids"].tolist() == ref["input_ids"][0].tolist()  # ids exactly the processor's
        if name == "qwen3_vl":  # its timestamps, in the text between the frames' runs
            assert "<0.3 seconds><|vision_start|><|video_pad|>" in processor.tokenizer.decode(row["input_ids"])
        is_media = np.isin(row["input_ids"], media_ids)
        assert (row["labels"][is_media] == -100).all() and (row["turn_ids"][is_media] == 0).all()
        answers = [m["content"] for m in raw["messages"] if m["role"] == "assistant"]
        turns = row["turn_ids"]
        assert [processor.tokenizer.decode(row["input_ids"][turns == k]) for k in range(1, turns.max() + 1)] == \
            [a + "<|im_end|>" for a in answers]
        stored = row["media"][0]
        assert sum(item.n_tokens for item in stored) >= int(is_media.sum())
        # the loader, item by item: the processor's tensors on the conversation, bit for bit
        (sequence,) = loader([stored])
        media_keys = sorted(k for k in ref if k not in TEXT_KEYS)
        assert sorted({k for item in sequence.items for k in item.inputs}) == media_keys
        for key in media_keys:
            parts = [torch.as_tensor(item.inputs[key]) for item in sequence.items if key in item.inputs]
            assert torch.equal(torch.cat(parts), torch.as_tensor(ref[key])), (name, uid, key)
        assert [item.kind for item in sequence.items] == [s.kind for s in stored]
        if name == "qwen2_5_omni":
            assert sequence.rope == {"use_audio_in_video": uid == 3}
        else:
            assert sequence.rope == {}


def test_counts_reach_report_meta_and_stats(runs):
    root = runs["qwen2_5_omni"] / "qwen2_5_omni"
    report = json.loads((root / "report.json").read_text())
    sizes = {p.name: p.stat().st_size for p in av("mllm_av_demo_data").iterdir()}
    videos = report["tokenize"]["videos"]
    # clock 3 s (twice), bars 2 s (its sound track in its run), ball 2 s (twice)
    assert (videos["videos"], videos["with_audio"], videos["video_seconds"]) == (5, 1, 12.0)
    assert videos["video_bytes"] == 2 * sizes["clock.mp4"] + sizes["bars_with_sound.mp4"] + 2 * sizes["ball.webm"]
    audios = report["tokenize"]["audios"]
    assert (audios["audios"], audios["audio_seconds"]) == (3, 6.0)
    assert audios["audio_bytes"] == sizes["chirp.wav"] + sizes["beeps.mp3"] + sizes["two_tones_stereo.flac"]
    packed = PackedDataset(root / "packed", verify="full")
    counts = packed.meta["counts"]
    assert (counts["videos"], counts["audios"], counts["videos_with_audio"]) == (5, 3, 1)
    assert counts["video_tokens"] == videos["video_tokens"] and counts["audio_tokens"] == audios["audio_tokens"]
    assert packed.meta["media"]["video_fps"] == 2.0 and packed.meta["media"]["storage"] == "encoded"
    stats = json.loads((root / "packed" / "stats.json").read_text())
    assert (stats["videos"], stats["video_seconds"], stats["audios"], stats["audio_seconds"]) == (5, 12.0, 3, 6.0)
    assert report["pack"]["video_tokens"] == counts["video_tokens"]
    assert report["merge"]["blocked"].get("media", 0) == 0  # merge.probability 0: nothing tried to join


def test_the_decoder_gives_transformers_pyav_frames_and_metadata():
    """The pipeline's video decoder, every frame: transformers' own PyAV reader (`load_video(path, "pyav")`), where
    that reader works (MP4; on WebM it fails: the header holds no frame count)."""
    from transformers.video_utils import load_video

    from data.shards.decode import MediaLimits, decode_video

    for name in ("clock.mp4", "bars_with_sound.mp4"):
        path = str(av("mllm_av_demo_data", name))
        frames, metadata = decode_video(av("mllm_av_demo_data", name).read_bytes(), name, "videos[0]", MediaLimits())
        ref_frames, ref_metadata = load_video(path, backend="pyav")
        assert np.array_equal(frames, ref_frames)
        assert {k: getattr(metadata, k) for k in ("total_num_frames", "fps", "duration", "width", "height")} == \
            {k: getattr(ref_metadata, k) for k in ("total_num_frames", "fps", "duration", "width", "height")}
        assert list(metadata.frames_indices) == list(ref_metadata.frames_indices)
    with pytest.raises(IndexError):
        load_video(str(av("mllm_av_demo_data", "ball.webm")), backend="pyav")
    frames, metadata = decode_video(av("mllm_av_demo_data", "ball.webm").read_bytes(), "ball", "v", MediaLimits())
    assert frames.shape[0] == metadata.total_num_frames == 40
