"""Video and audio records, preprocess side (no decoding, no processor: the plain .venv): LLaMA-Factory's `<video>` /
`<audio>` records, ShareGPT, OpenAI / transformers content parts (`input_audio` base64 included) and the `datasets`
Audio / Video features give the same canonical record; a video named in `audios` too is folded into a video with
its sound track (LLaMA-Factory's audio-in-video records); bad records name file:line and the field."""
from __future__ import annotations

import base64
import json

import pytest

from data.config import InputSpec
from data.preprocess import convert_row, detect_format
from data.records import RecordError
from tests.conftest import fixture_path


def av(*parts):
    return fixture_path("multimodal", *parts)


def demo_records():
    return json.loads(av("mllm_av_demo.json").read_text())


def convert(raw, base=None, roots=()):
    spec = InputSpec(path=["x.jsonl"])
    fmt, spec = detect_format(raw, spec, "x.jsonl:1")
    return convert_row(raw, spec, fmt, "x.jsonl:1", str(base or av()), roots)[0]


def test_llamafactory_av_records_resolve_and_fold_audio_in_video():
    base = av()
    data = base / "mllm_av_demo_data"
    records = [convert(r) for r in demo_records()]
    assert records[0]["videos"] == [str(data / "clock.mp4")] and "audios" not in records[0]
    assert records[1]["audios"] == [str(data / "chirp.wav")]
    assert records[2]["messages"][0]["content"] == "How many beeps do you hear?<audio>"
    # the same file in videos and audios, its <audio> after its <video>: a video with its sound track
    folded = records[3]
    assert folded["videos"] == [str(data / "bars_with_sound.mp4")] and folded["audios"] == []
    assert folded["audio_in_video"] == [0] and folded["messages"][0]["content"] == "<video>What do you see and hear?"
    assert records[4]["videos"] == [str(data / "ball.webm")] and records[4]["audios"] == [
        str(data / "two_tones_stereo.flac")] and "audio_in_video" not in records[4]
    assert records[5]["videos"] == [str(data / "clock.mp4"), str(data / "ball.webm")]


def test_openai_parts_sharegpt_and_datasets_features_give_the_llamafactory_record():
    lf = convert(demo_records()[4])
    openai = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": "mllm_av_demo_data/ball.webm"},
                                     {"type": "text", "text": "Where does the ball go?"}]},
        {"role": "assistant", "content": "An orange square bounces around a dark blue frame."},
        {"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "mllm_av_demo_data/two_tones_stereo.flac"}},
                                     {"type": "text", "text": "And is this sound stereo?"}]},
        {"role": "assistant", "content": "Yes: the left channel and the right channel hold different tones."}]}
    assert convert(openai) == lf
    sharegpt = {"conversations": [{"from": "human", "value": "<video>Where does the ball go?"},
                                  {"from": "gpt", "value": lf["messages"][1]["content"]},
                                  {"from": "human", "value": "<audio>And is this sound stereo?"},
                                  {"from": "gpt", "value": lf["messages"][3]["content"]}],
                "videos": ["mllm_av_demo_data/ball.webm"], "audios": ["mllm_av_demo_data/two_tones_stereo.flac"]}
    assert convert(sharegpt) == lf
    # datasets' Audio / Video features: {path} and {bytes} dicts; OpenAI's input_audio: base64 with its format
    wav = av("mllm_av_demo_data", "chirp.wav").read_bytes()
    features = {"messages": [{"role": "user", "content": "<audio><video>Q"}, {"role": "assistant", "content": "A"}],
                "audios": [{"bytes": wav, "path": None}], "videos": [{"path": "mllm_av_demo_data/clock.mp4"}]}
    rec = convert(features)
    assert rec["audios"] == ["data:application/octet-stream;base64," + base64.b64encode(wav).decode()]
    assert rec["videos"] == [str(av("mllm_av_demo_data", "clock.mp4"))]
    inline = {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "Q"}]}, {"role": "assistant", "content": "A"}]}
    assert convert(inline)["audios"] == ["data:audio/wav;base64," + base64.b64encode(wav).decode()]
    # media beside images in one record
    mixed = {"messages": [{"role": "user", "content": "<image><video><audio>All three?"},
                          {"role": "assistant", "content": "Yes."}],
             "images": [str(fixture_path("multimodal", "mllm_demo_data", "1.jpg"))],
             "videos": ["mllm_av_demo_data/clock.mp4"], "audios": ["mllm_av_demo_data/beeps.mp3"]}
    rec = convert(mixed, roots=(str(fixture_path("multimodal", "mllm_demo_data")),))
    assert (len(rec["images"]), len(rec["videos"]), len(rec["audios"])) == (1, 1, 1)


@pytest.mark.parametrize("raw, field, reason", [
    ({"messages": [{"role": "user", "content": "<video>Hi"}, {"role": "assistant", "content": "Yo"}],
      "videos": ["mllm_av_demo_data/nope.mp4"]}, "videos[0]", "missing_video"),
    ({"messages": [{"role": "user", "content": "<audio><audio>Hi"}, {"role": "assistant", "content": "Yo"}],
      "audios": ["mllm_av_demo_data/chirp.wav"]}, "audios", "audio_count_mismatch"),
    ({"messages": [{"role": "user", "content": "<video>Hi"}, {"role": "assistant", "content": "Yo"}],
      "videos": []}, "videos", "video_count_mismatch"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<audio>Yo"}],
      "audios": ["mllm_av_demo_data/chirp.wav"]}, "messages[1].content", "audio_placement"),
    ({"messages": [{"role": "user", "content": "<video>Hi"}, {"role": "assistant", "content": "Yo"}],
      "videos": ["../../../../etc/hostname"]}, "videos[0]", "video_outside_root"),
    ({"messages": [{"role": "user", "content": "<audio>Hi"}, {"role": "assistant", "content": "Yo"}],
      "audios": ["https://example.com/a.wav"]}, "audios[0]", "bad_audio"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "Yo"}]},
     "audios", "audio_count_mismatch"),
    # the video's file as an audio before the video, or in another message: not its sound track
    ({"messages": [{"role": "user", "content": "<audio><video>Hi"}, {"role": "assistant", "content": "Yo"}],
      "videos": ["mllm_av_demo_data/bars_with_sound.mp4"], "audios": ["mllm_av_demo_data/bars_with_sound.mp4"]},
     "audios[0]", "audio_in_video_placement"),
])
def test_bad_media_records_name_the_field_and_reason(raw, field, reason):
    with pytest.raises(RecordError) as info:
        convert(raw)
    assert (info.value.field, info.value.reason) == (field, reason)
    assert str(info.value).startswith(f"x.jsonl:1: {field}: ")


def test_a_path_outside_the_data_directory_names_the_path_and_the_fix(tmp_path):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    (elsewhere / "a.wav").write_bytes(b"RIFF")
    raw = {"messages": [{"role": "user", "content": "<audio>Hi"}, {"role": "assistant", "content": "Yo"}],
           "audios": ["../elsewhere/a.wav"]}
    with pytest.raises(RecordError, match=r"x.jsonl:1: audios\[0\]: audio \.\./elsewhere/a.wav resolves to "
                                          rf"{elsewhere / 'a.wav'}, which is not under the data file's directory "
                                          rf"{data}: add the directory holding the audios to image_root"):
        convert(raw, base=data)
    assert convert(raw, base=data, roots=(str(elsewhere),))["audios"] == [str(elsewhere / "a.wav")]
