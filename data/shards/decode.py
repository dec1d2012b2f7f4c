"""Media bytes -> what transformers' processors take, with the libraries made for each format: Pillow for images,
PyAV (FFmpeg) for video and compressed audio, soundfile (libsndfile) for WAV and FLAC.

The tokenize stage and the trainer's media loader decode the same stored bytes with these functions, so the pixel
values and audio features the trainer rebuilds are the ones the tokenize stage counted tokens for. Every limit is
checked from the container's header before anything is decoded (`MediaLimits`): a 20 KB PNG of 12000 x 12000
pixels, a WAV header claiming ten hours or a 4K hour-long video is refused before a pixel or sample is decoded, and
decoding itself never goes past the frames asked for.

- Images: Pillow opens the file in its own mode, as `processor(images=Image.open(path))` receives it (the image
  processor's RGB conversion then composites transparency onto white).
- Videos: frames as transformers' PyAV reader gives them (`transformers.video_utils.read_video_pyav`: every frame
  of the first video stream in decode order, `to_ndarray(format="rgb24")`, metadata from the stream header), decoding
  only up to the last frame the video processor samples (`sample_indices`). Where the header gives no frame count
  (WebM), the stream's packets are counted (demuxed, not decoded), as a frame-exact reader does.
- Audio: mono float32 at the feature extractor's rate: decoded (soundfile for WAV / FLAC, PyAV otherwise, the
  sound track of a video included), channels averaged, then resampled by FFmpeg's swresample through PyAV (the
  resampler torchcodec, transformers' default audio decoder, uses) to `ceil(n * rate / source_rate)` samples.

Nothing here is imported at module load but numpy: Pillow, PyAV and soundfile load in the branch that needs them.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from data.shards.errors import RecordError

# PIL's own decompression-bomb bound (2**30 // 4 // 3 pixels), the default `image_pixel_limit`
DEFAULT_PIXEL_LIMIT = 89_478_485
MEDIA_SETUP = ("video and audio conversations need PyAV and soundfile (`pip install -r requirements-vision.txt`, or "
               "`bash scripts/setup_vision.sh` for .venv-vision)")


@dataclass(frozen=True)
class MediaLimits:
    """The largest media decoded, each read from the file's header before decoding (None: no bound)."""
    image_pixel_limit: int | None = DEFAULT_PIXEL_LIMIT  # width x height of an image
    video_max_seconds: float | None = 600.0  # a video's duration
    video_frame_limit: int | None = 36_000  # frames in a video file (ten minutes at 60 frames/s)
    video_pixel_limit: int | None = 3840 * 2160  # width x height of a video frame (4K UHD)
    audio_max_seconds: float | None = 600.0  # an audio clip's duration (a video's sound track included)


def _module(name: str):
    try:
        return __import__(name)
    except ImportError:
        from common.config import ConfigError

        raise ConfigError(f"{MEDIA_SETUP} ({name} does not import here)") from None


def _bad(source: str, where: str, kind: str, what: str, exc: Exception | None = None) -> RecordError:
    detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    return RecordError(source, where, f"unreadable {kind}{detail}" if not what else f"{what}{detail}", f"bad_{kind}")


# ---------------------------------------------------------------------------------------------- images
def decode_image(data: bytes, source: str, where: str, pixel_limit: int | None = DEFAULT_PIXEL_LIMIT):
    """Encoded bytes -> the PIL image as Pillow opens the file (decoded, in its own mode), which is what
    `processor(images=Image.open(path))` receives: the image processor's own conversion (`do_convert_rgb`:
    transformers' `convert_to_rgb`, which composites transparency onto white, as Qwen's own preprocessing does) then
    makes the pixel values exactly the processor's for that file. Converting to RGB here would drop the alpha channel
    instead. EXIF orientation is not applied (neither does the processor on an opened image, nor LLaMA-Factory).
    An image of more than `pixel_limit` pixels (width x height from its header: PIL's `open` reads no more) is a
    RecordError `image_too_large` before anything is decoded (None: no bound)."""
    try:
        from PIL import Image
    except ImportError:
        from common.config import ConfigError

        raise ConfigError("image conversations need Pillow (bash scripts/setup_vision.sh)") from None
    Image.MAX_IMAGE_PIXELS = None  # the bound is `pixel_limit`, checked from the header alike
    try:
        img = Image.open(io.BytesIO(data))  # in memory: no file handle to close
        if pixel_limit is not None and img.width * img.height > pixel_limit:
            raise RecordError(source, where, f"image of {img.width}x{img.height} = {img.width * img.height:,} "
                              f"pixels exceeds image_pixel_limit={pixel_limit:,} (read from its header, not "
                              "decoded): downscale it, or raise image_pixel_limit in the data config",
                              "image_too_large")
        img.load()
        return img
    except RecordError:
        raise
    except Exception as exc:  # PIL raises several types (UnidentifiedImageError, OSError, DecompressionBombError)
        raise RecordError(source, where, f"unreadable image: {type(exc).__name__}: {exc}", "bad_image") from None


# ---------------------------------------------------------------------------------------------- videos
@dataclass(frozen=True)
class VideoHeader:
    """What a video file's header says (no frame decoded): its first video stream's frame count, rate and size."""
    total_frames: int
    fps: float
    width: int
    height: int
    seconds: float  # total_frames / fps, as transformers' readers compute the duration


def _open_container(data: bytes, source: str, where: str, kind: str):
    av = _module("av")
    try:
        return av.open(io.BytesIO(data), mode="r")
    except Exception as exc:  # av.error.InvalidDataError and friends: not a container FFmpeg knows
        raise _bad(source, where, kind, f"not a {kind} file FFmpeg can open", exc) from None


def _video_header(container, data: bytes, source: str, where: str, limits: MediaLimits) -> VideoHeader:
    """The header of a video's first video stream, checked against `limits` (`video_too_long`, `video_too_large`)
    and for frames (`empty_video`) before any frame is decoded."""
    streams = container.streams.video
    if not streams:
        raise RecordError(source, where, "the file holds no video stream", "bad_video")
    stream = streams[0]
    if stream.codec_context is None or not stream.codec_context.name:
        raise RecordError(source, where, "the video stream's codec has no decoder here", "bad_video")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    width, height = int(stream.width or 0), int(stream.height or 0)
    header_seconds = (float(stream.duration * stream.time_base) if stream.duration and stream.time_base
                      else (container.duration or 0) / 1_000_000)
    if limits.video_pixel_limit is not None and width * height > limits.video_pixel_limit:
        raise RecordError(source, where, f"video frames of {width}x{height} = {width * height:,} pixels exceed "
                          f"video_pixel_limit={limits.video_pixel_limit:,} (read from its header, not decoded): "
                          "downscale it, or raise video_pixel_limit in the data config", "video_too_large")
    if limits.video_max_seconds is not None and header_seconds > limits.video_max_seconds:
        raise RecordError(source, where, f"video of {header_seconds:,.1f} s exceeds video_max_seconds="
                          f"{limits.video_max_seconds:g} (read from its header, not decoded): cut it, or raise "
                          "video_max_seconds in the data config", "video_too_long")
    total = int(stream.frames or 0)
    if total == 0:  # no count in the header (Matroska / WebM): count the stream's packets, decoding nothing
        total = _count_packets(data, source, where, limits.video_frame_limit)
    if limits.video_frame_limit is not None and total > limits.video_frame_limit:
        raise RecordError(source, where, f"video of {total:,}{'+' if not stream.frames else ''} frames exceeds "
                          f"video_frame_limit={limits.video_frame_limit:,} (counted before decoding): cut it, or "
                          "raise video_frame_limit in the data config", "video_too_long")
    if total == 0 or fps <= 0 or width * height == 0:
        raise RecordError(source, where, f"the video stream has no frames to decode ({total} frames, {fps:g} "
                          f"frames/s, {width}x{height})", "empty_video")
    seconds = total / fps
    if limits.video_max_seconds is not None and seconds > limits.video_max_seconds:
        raise RecordError(source, where, f"video of {seconds:,.1f} s ({total:,} frames at {fps:g}/s) exceeds "
                          f"video_max_seconds={limits.video_max_seconds:g} (read before decoding): cut it, or "
                          "raise video_max_seconds in the data config", "video_too_long")
    return VideoHeader(total, fps, width, height, seconds)


def _count_packets(data: bytes, source: str, where: str, budget: int | None) -> int:
    """The packets of a file's first video stream (one a frame), demuxed from a container of its own; counting stops
    past `budget`."""
    total = 0
    with _open_container(data, source, where, "video") as container:
        try:
            for packet in container.demux(container.streams.video[0]):
                if packet.size:
                    total += 1
                    if budget is not None and total > budget:
                        break
        except Exception as exc:  # damaged data between packets
            raise _bad(source, where, "video", f"the video stream breaks after {total} packets", exc) from None
    return total


def decode_video(data: bytes, source: str, where: str, limits: MediaLimits,
                 sample_indices: Callable[[Any], np.ndarray] | None = None):
    """(frames uint8 [n, height, width, 3], transformers `VideoMetadata`) of a video's first video stream: the
    frames `sample_indices(metadata)` picks (None: every frame), decoded in order up to the last of them. The
    metadata's `frames_indices` are the picked indices, as the video processor's own sampling sets them; a file that
    ends before the last picked frame (truncated) is `bad_video`."""
    from transformers.video_utils import VideoMetadata

    with _open_container(data, source, where, "video") as container:
        header = _video_header(container, data, source, where, limits)
        metadata = VideoMetadata(total_num_frames=header.total_frames, fps=header.fps, duration=header.seconds,
                                 video_backend="pyav", height=header.height, width=header.width)
        indices = (np.asarray(sample_indices(metadata)) if sample_indices is not None
                   else np.arange(header.total_frames))
        if not len(indices):
            raise RecordError(source, where, "the video processor samples no frame of this video", "empty_video")
        wanted, last = set(int(i) for i in indices), int(indices[-1])
        frames, seen = [], 0
        try:
            for i, frame in enumerate(container.decode(video=0)):
                if i > last:
                    break
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                seen = i + 1
        except Exception as exc:  # corrupt data mid-stream
            raise _bad(source, where, "video", f"the video stream breaks after {seen} frames", exc) from None
    if seen <= last:
        raise RecordError(source, where, f"the video stream ends after {seen} frames, its header says "
                          f"{header.total_frames} (a truncated file?)", "bad_video")
    metadata.frames_indices = indices
    return np.stack(frames), metadata


# ---------------------------------------------------------------------------------------------- audio
SOUNDFILE_MAGIC = ((b"RIFF", 8, b"WAVE"), (b"fLaC", 0, b""))  # WAV and FLAC: libsndfile reads them


def _is_soundfile_format(data: bytes) -> bool:
    return any(data[:4] == magic and data[at:at + len(tail)] == tail for magic, at, tail in SOUNDFILE_MAGIC)


def audio_seconds(data: bytes, source: str, where: str, from_video: bool = False) -> float:
    """An audio file's (or a video's sound track's) duration from its header, nothing decoded."""
    if not from_video and _is_soundfile_format(data):
        sf = _module("soundfile")
        try:
            info = sf.info(io.BytesIO(data))
        except Exception as exc:  # soundfile.LibsndfileError: unsupported or damaged
            raise _bad(source, where, "audio", "", exc) from None
        return info.frames / info.samplerate if info.samplerate else 0.0
    with _open_container(data, source, where, "video" if from_video else "audio") as container:
        return _audio_header_seconds(container, source, where, from_video)


def _audio_header_seconds(container, source: str, where: str, from_video: bool) -> float:
    streams = container.streams.audio
    if not streams:
        what = "the video has no sound track to use (audio-in-video)" if from_video else "the file holds no audio"
        raise RecordError(source, where, what, "no_audio_track" if from_video else "bad_audio")
    stream = streams[0]
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return (container.duration or 0) / 1_000_000


def decode_audio(data: bytes, source: str, where: str, limits: MediaLimits, sampling_rate: int,
                 from_video: bool = False) -> np.ndarray:
    """Mono float32 samples at `sampling_rate` of an audio file (`from_video`: of a video file's first sound
    track). Its header's duration is checked against `audio_max_seconds` first (`audio_too_long`); a clip with no
    sample is `empty_audio`."""
    seconds = audio_seconds(data, source, where, from_video)
    if limits.audio_max_seconds is not None and seconds > limits.audio_max_seconds:
        raise RecordError(source, where, f"audio of {seconds:,.1f} s exceeds audio_max_seconds="
                          f"{limits.audio_max_seconds:g} (read from its header, not decoded): cut it, or raise "
                          "audio_max_seconds in the data config", "audio_too_long")
    if not from_video and _is_soundfile_format(data):
        samples, rate = _read_soundfile(data, source, where)
    else:
        samples, rate = _read_pyav(data, source, where, from_video, limits)
    if samples.shape[1] == 0:
        raise RecordError(source, where, "the audio holds no sample (a zero-length clip)", "empty_audio")
    mono = samples.mean(axis=0, dtype=np.float32) if samples.shape[0] > 1 else samples[0]
    return resample(np.ascontiguousarray(mono, dtype=np.float32), rate, sampling_rate)


def _read_soundfile(data: bytes, source: str, where: str) -> tuple[np.ndarray, int]:
    sf = _module("soundfile")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            return f.read(dtype="float32", always_2d=True).T, f.samplerate
    except Exception as exc:  # soundfile.LibsndfileError
        raise _bad(source, where, "audio", "", exc) from None


def _read_pyav(data: bytes, source: str, where: str, from_video: bool, limits: MediaLimits
               ) -> tuple[np.ndarray, int]:
    """[channels, samples] float32 of the first audio stream, at its own rate; decoding stops past the duration
    limit (a header that understates the length cannot make it unbounded)."""
    kind = "video" if from_video else "audio"
    with _open_container(data, source, where, kind) as container:
        _audio_header_seconds(container, source, where, from_video)
        stream = container.streams.audio[0]
        rate = int(stream.rate or stream.codec_context.sample_rate or 0)
        if rate <= 0:
            raise RecordError(source, where, "the audio stream has no sample rate", f"bad_{kind}")
        bound = None if limits.audio_max_seconds is None else int(math.ceil(limits.audio_max_seconds * rate))
        chunks, n = [], 0
        try:
            for frame in container.decode(stream):
                chunk = frame.to_ndarray()
                if frame.format.is_packed:  # interleaved samples: [1, samples * channels]
                    chunk = chunk.reshape(-1, len(frame.layout.channels)).T
                chunks.append(chunk.astype(np.float32) / _scale(frame.format.name))
                n += chunk.shape[1]
                if bound is not None and n > bound:
                    raise RecordError(source, where, f"audio longer than audio_max_seconds="
                                      f"{limits.audio_max_seconds:g} (its header said {n / rate:,.1f} s or less)",
                                      "audio_too_long")
        except RecordError:
            raise
        except Exception as exc:  # corrupt data mid-stream
            raise _bad(source, where, kind, f"the audio stream breaks after {n} samples", exc) from None
    if not chunks:
        return np.zeros((1, 0), dtype=np.float32), rate
    return np.concatenate(chunks, axis=1), rate


def _scale(sample_format: str) -> float:
    """The full-scale value of an FFmpeg sample format (float formats are already in [-1, 1])."""
    base = sample_format.rstrip("p")
    return {"u8": 128.0, "s16": 32768.0, "s32": 2147483648.0, "s64": 9223372036854775808.0}.get(base, 1.0)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Mono float32 `samples` at `rate` -> `target` Hz with FFmpeg's swresample (PyAV), flushed, padded or cut to
    `ceil(len * target / rate)` samples; unchanged when the rates agree."""
    if rate == target:
        return samples
    av = _module("av")
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    out = [f.to_ndarray()[0] for f in resampler.resample(frame) + resampler.resample(None)]
    resampled = np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
    n = math.ceil(len(samples) * target / rate)
    return np.ascontiguousarray(np.pad(resampled, (0, max(0, n - len(resampled))))[:n], dtype=np.float32)
