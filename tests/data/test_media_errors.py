"""Bad video and audio input (made here with PyAV, soundfile and numpy): a missing, truncated or corrupt file, a codec
with no decoder, a video with no frames, a zero-length clip, a video without the sound track its record asks for,
a placeholder count that differs from the list, a FLAC header claiming ten hours, a 4K hour-long video, a path
outside the allowed roots. Each stops the pipeline with `file:line: field: message`, or under `on_error: skip` is
dropped and counted by reason; the limits are read from the header before anything is decoded. The trainer's loader
refuses stored bytes that do not decode and items the processor no longer gives as stored.
(Needs .venv-vision: PyAV, soundfile and the processors' torchvision.)"""
from __future__ import annotations

import fractions
import io
import json
import re
import shutil

import numpy as np
import orjson
import pytest

from common.config import ConfigError
from data import pipeline
from data.processors import write_processor
from data.shards.dataset import ShardFormatError, StoredMedia
from data.shards.decode import MediaLimits, decode_audio, decode_video
from data.shards.errors import RecordError
from data.shards.media import MediaLoader
from data.shards.processor import MediaSettings
from tests.conftest import fixture_path

pytestmark = pytest.mark.vision


def demo(name: str) -> bytes:
    return fixture_path("multimodal", "mllm_av_demo_data", name).read_bytes()


def _flac_claiming(seconds: int) -> bytes:
    """A one-second silent FLAC whose STREAMINFO says it holds `seconds` of samples."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(16000, np.float32), 16000, format="FLAC")
    data = bytearray(buf.getvalue())
    field = int.from_bytes(data[18:26], "big")  # sample rate, channels, bits, then a 36-bit sample count
    data[18:26] = ((field & ~((1 << 36) - 1)) | seconds * 16000).to_bytes(8, "big")
    return bytes(data)


def _four_k_hour() -> bytes:
    """Two black 3840x2160 frames, the second an hour after the first: a 25 KB file whose header says 4K, 1 hour."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=1)
        stream.width, stream.height, stream.pix_fmt = 3840, 2160, "yuv420p"
        stream.options, stream.time_base = {"preset": "ultrafast"}, fractions.Fraction(1, 1)
        for pts in (0, 3600):
            frame = av.VideoFrame.from_ndarray(np.zeros((2160, 3840, 3), np.uint8), format="rgb24")
            frame.pts = pts
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _no_video_frames() -> bytes:
    """A Matroska file with a video stream that holds no frame (and a short sound track)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        video = container.add_stream("libx264", rate=10)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        audio = container.add_stream("aac", rate=16000)
        audio.layout = "mono"
        container.start_encoding()
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, 0
        for packet in [*audio.encode(frame), *audio.encode()]:
            container.mux(packet)
    return buf.getvalue()


def _empty_wav() -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(0, np.float32), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


# file name -> (its bytes, the record's media, the reason its record is dropped for)
CASES = {
    "ok.mp4": (lambda: demo("clock.mp4"), {"videos": ["ok.mp4"]}, None),
    "ok.wav": (lambda: demo("chirp.wav"), {"audios": ["ok.wav"]}, None),
    "truncated.mp4": (lambda: demo("clock.mp4")[:4000], {"videos": ["truncated.mp4"]}, "bad_video"),
    "garbage.mp4": (lambda: bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)),
                    {"videos": ["garbage.mp4"]}, "bad_video"),
    "unknown_codec.webm": (lambda: demo("ball.webm").replace(b"V_VP9", b"V_XX9"), {"videos": ["unknown_codec.webm"]},
                           "bad_video"),
    "no_frames.mkv": (_no_video_frames, {"videos": ["no_frames.mkv"]}, "empty_video"),
    "empty.wav": (_empty_wav, {"audios": ["empty.wav"]}, "empty_audio"),
    "ten_hours.flac": (lambda: _flac_claiming(10 * 3600), {"audios": ["ten_hours.flac"]}, "audio_too_long"),
    "four_k_hour.mp4": (_four_k_hour, {"videos": ["four_k_hour.mp4"]}, "video_too_long"),
    # a video with no sound track, named in both lists (audio-in-video)
    "silent.mp4": (lambda: demo("clock.mp4"), {"videos": ["silent.mp4"], "audios": ["silent.mp4"]}, "no_audio_track"),
}


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """data/: the files, and d.jsonl with one record per case, then a placeholder mismatch and a path outside."""
    root = tmp_path_factory.mktemp("bad_media")
    data = root / "data"
    data.mkdir()
    (root / "outside.wav").write_bytes(demo("chirp.wav"))
    rows = []
    for name, (make, media, _) in CASES.items():
        (data / name).write_bytes(make())
        tags = "".join(f"<{key[:-1]}>" for key in media for _ in media[key])
        rows.append({"messages": [{"role": "user", "content": f"{tags}What is it?"},
                                  {"role": "assistant", "content": "A test."}], **media})
    rows.append({"messages": [{"role": "user", "content": "<video><video>Two?"}, {"role": "assistant", "content": "No."}],
                 "videos": ["ok.mp4"]})
    rows.append({"messages": [{"role": "user", "content": "<audio>Where?"}, {"role": "assistant", "content": "Out."}],
                 "audios": ["../outside.wav"]})
    (data / "d.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    processor = write_processor("qwen2_5_omni", root / "processor")
    return root, data, processor


def _config(root, data, processor, **extra):
    path = root / "config.json"
    path.write_bytes(orjson.dumps({"inputs": [{"path": str(data / "d.jsonl"), "category_name": "av"}],
                                   "output_dir": str(root / "out"), "tokenizer_path": str(processor),
                                   "max_length": 32768, "num_workers": 1, "video_fps": 2.0,
                                   "category_loss_warning": 1.0, **extra}))
    return str(path)


def test_bad_media_stop_with_file_line_and_field_or_are_counted(layout, capsys):
    root, data, processor = layout
    config = _config(root, data, processor)
    with pytest.raises(SystemExit):  # preprocess: the placeholder mismatch, line 11
        pipeline.main([config])
    assert f"{data / 'd.jsonl'}:11: videos: 2 <video> placeholders in the messages but 1 videos" in \
        capsys.readouterr().err
    pipeline.main([config, "on_error=skip", "--stages", "preprocess,sample,merge,tokenize"])
    report = json.loads((root / "out" / "report.json").read_text())
    assert report["preprocess"]["dropped"] == {"audio_outside_root": 1, "video_count_mismatch": 1}
    expected: dict[str, int] = {}
    for _, _, reason in CASES.values():
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    tokenize = report["tokenize"]
    assert tokenize["dropped"] == dict(sorted(expected.items())) and tokenize["out"] == 2
    lines = {name: k + 1 for k, name in enumerate(CASES)}
    for name, (_, _, reason) in CASES.items():
        if reason:  # each drop names its input line
            assert any(f"(from {data / 'd.jsonl'}:{lines[name]})" in source
                       for source in tokenize["dropped_at"][reason]), (name, tokenize["dropped_at"][reason])
    assert tokenize["videos"]["videos"] == 1 and tokenize["audios"]["audios"] == 1
    # under on_error: error the first bad record stops tokenize, naming its line and field
    with pytest.raises(SystemExit):
        pipeline.main([config, "on_error=error", "--stages", "tokenize"])
    err = capsys.readouterr().err
    found = re.search(rf"merged.jsonl:\d+ \(from {re.escape(str(data / 'd.jsonl'))}:(\d+)\): (\w+)\[0\]: ", err)
    assert found, err[-2000:]
    name = list(CASES)[int(found.group(1)) - 1]  # the first bad record in merged.jsonl's order
    assert CASES[name][2] is not None and found.group(2) == ("audios" if "audios" in CASES[name][1] and
                                                             "videos" not in CASES[name][1] else "videos")


def test_limits_come_from_the_header_before_decoding(layout, monkeypatch):
    from data.shards import decode

    _, data, _ = layout
    monkeypatch.setattr(decode, "_read_soundfile", lambda *a: pytest.fail("decoded a clip its header refuses"))
    with pytest.raises(RecordError, match=r"audio of 36,000.0 s exceeds audio_max_seconds=600 \(read from its "
                                          r"header, not decoded\)") as info:
        decode_audio((data / "ten_hours.flac").read_bytes(), "d.jsonl:8", "audios[0]", MediaLimits(), 16000)
    assert (info.value.field, info.value.reason) == ("audios[0]", "audio_too_long")
    four_k = (data / "four_k_hour.mp4").read_bytes()
    with pytest.raises(RecordError, match=r"video of 3,601.0 s exceeds video_max_seconds=600 \(read from its "
                                          r"header, not decoded\)"):
        decode_video(four_k, "d.jsonl:9", "videos[0]", MediaLimits())
    with pytest.raises(RecordError, match=r"video frames of 3840x2160 = 8,294,400 pixels exceed "
                                          r"video_pixel_limit=2,073,600") as info:
        decode_video(four_k, "d.jsonl:9", "videos[0]", MediaLimits(video_pixel_limit=1920 * 1080,
                                                                   video_max_seconds=None))
    assert info.value.reason == "video_too_large"
    with pytest.raises(RecordError, match=r"video of 11\+ frames exceeds video_frame_limit=10 \(counted before "
                                          r"decoding\)"):  # WebM: no count in the header, its packets are counted, up to the limit
        decode_video(demo("ball.webm"), "d.jsonl:1", "videos[0]", MediaLimits(video_frame_limit=10))
    # within the limits the same files decode (the hour-long video's two frames, with the bound lifted)
    frames, metadata = decode_video(four_k, "d.jsonl:9", "videos[0]", MediaLimits(video_max_seconds=None))
    assert frames.shape == (2, 2160, 3840, 3) and metadata.total_num_frames == 2


def test_the_loader_refuses_damaged_bytes_and_changed_settings(layout):
    _, data, processor = layout
    loader = MediaLoader(MediaSettings(str(processor), video_fps=2.0))
    good = loader.item(StoredMedia("audio", demo("chirp.wav"), (0, 0, 0), 37, 0, 150, 1500))
    assert good.kind == "audio" and tuple(good.inputs["input_features"].shape) == (1, 128, 30000)
    with pytest.raises(ShardFormatError, match="the shards hold an audio that does not decode"):
        loader.item(StoredMedia("audio", b"RIFF" + bytes(60), (0, 0, 0), 37, 0, 150, 1500))
    with pytest.raises(ConfigError, match=r"gives a video of the shards .* where the tokenize stage stored .*: the "
                                          "processor or its settings changed since the tokenize stage"):
        loader.item(StoredMedia("video", demo("clock.mp4"), (2, 4, 4), 10, 0, 0, 3000))
    shutil.rmtree(data.parent / "out", ignore_errors=True)
