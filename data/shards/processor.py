"""The model's own transformers processor, as the tokenize stage and the trainer's media loader both run it.

`MediaSettings` is what a dataset's media were tokenized under (the data config's media keys, written to meta.json
`media`); `MediaProcessor` loads the processor directory once and gives, for each kind of media it takes, the
decoded input (data/shards/decode.py) and the processor's keyword arguments, so that the tokenize stage's
`processor(text=render, images=..., videos=..., audio=...)` and the loader's per-item calls see the same inputs.

The processor of a directory is `AutoProcessor.from_pretrained`, loaded on first use: text-only runs never import
it (nor torchvision, Pillow, PyAV or soundfile).
"""
from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import ConfigError
from data.shards.decode import DEFAULT_PIXEL_LIMIT, MediaLimits, decode_audio, decode_image, decode_video

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# the processor's outputs that are text, not media: dropped from a media item's inputs
TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "text_replacement_offsets")
VISION_SETUP = ("image and video conversations need torchvision and Pillow, which load only next to PyPI's (CUDA) "
                "torch build: run `bash scripts/setup_vision.sh` (builds .venv-vision, runs on CPU too) or, beside a "
                "CUDA torch, `pip install -r requirements-vision.txt`")
VISION_VENV = Path(__file__).resolve().parents[2] / ".venv-vision"


def vision_setup_message() -> str:
    """What to do when torchvision or Pillow does not load here: where the image environment is built already
    (scripts/setup_vision.sh) but this is another interpreter, run the command again with `PACKSFT_VENV=.venv-vision`;
    else build it."""
    python = VISION_VENV / "bin" / "python"
    if python.exists() and Path(os.path.realpath(sys.prefix)) != Path(os.path.realpath(VISION_VENV)):
        return ("image conversations need torchvision and Pillow, which this Python environment "
                f"({sys.prefix}) lacks; the image environment is built ({VISION_VENV}): run the command with "
                "the prefix `PACKSFT_VENV=.venv-vision`, e.g. `PACKSFT_VENV=.venv-vision sh data_process.sh CONFIG` "
                "or `PACKSFT_VENV=.venv-vision sh train.sh CONFIG`")
    return VISION_SETUP


def is_processor_dir(path: str) -> bool:
    return any((Path(path) / name).is_file() for name in PROCESSOR_FILES)


def processor_chat_template(path: str) -> str | None:
    """The processor's own chat template (chat_template.jinja / .json of a processor directory), which renders
    media parts; None when the directory has none."""
    import orjson

    jinja, js = Path(path) / "chat_template.jinja", Path(path) / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if js.is_file():
        template = orjson.loads(js.read_bytes()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_processor(path: str):
    """transformers' AutoProcessor of `path`, or a ConfigError saying what to install / set."""
    if not is_processor_dir(path):
        raise ConfigError(f"tokenizer_path: {path} holds no processor ({' or '.join(PROCESSOR_FILES)}); records "
                          "with images, videos or audio need the model's processor directory (e.g. a Qwen2.5-VL "
                          "checkpoint, or `python -m data.processors NAME DIR`)")
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a bad directory or a missing backend
        try:
            import PIL  # noqa: F401
            import torchvision  # noqa: F401  (the Qwen2-VL image and video processors import it)
        except Exception as missing:  # ImportError, or RuntimeError "operator torchvision::nms does not exist"
            raise ConfigError(f"{vision_setup_message()} ({type(missing).__name__}: {missing})") from None
        raise ConfigError(f"tokenizer_path: cannot load a processor from {path}: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class MediaSettings:
    """What a dataset's media are processed under: the processor directory and the data config's media keys (their
    meaning: data/config.py). meta.json's `media` holds them; the trainer's loader rebuilds its processor from it."""
    processor_path: str
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    image_pixel_limit: int | None = DEFAULT_PIXEL_LIMIT
    video_fps: float | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_max_seconds: float | None = MediaLimits.video_max_seconds
    video_frame_limit: int | None = MediaLimits.video_frame_limit
    video_pixel_limit: int | None = MediaLimits.video_pixel_limit
    audio_max_seconds: float | None = MediaLimits.audio_max_seconds

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The data config keys these settings are (all but processor_path)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "processor_path")

    @classmethod
    def of(cls, spec: dict) -> "MediaSettings":
        """From meta.json's `media` (keys a newer writer added are not read)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in spec.items() if k in names})

    @property
    def limits(self) -> MediaLimits:
        return MediaLimits(self.image_pixel_limit, self.video_max_seconds, self.video_frame_limit,
                           self.video_pixel_limit, self.audio_max_seconds)


def _size(owner, min_pixels: int | None, max_pixels: int | None, what: str) -> dict:
    """`min_pixels` / `max_pixels` as a Qwen2-VL-style processor's `size` (a pixel budget); {} when neither is set."""
    if min_pixels is None and max_pixels is None:
        return {}
    size = getattr(owner, "size", None)
    edge = (lambda key: size.get(key)) if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    shortest, longest = edge("shortest_edge"), edge("longest_edge")
    if shortest is None or longest is None:
        raise ConfigError(f"{what}_min_pixels / {what}_max_pixels: the {what} processor {type(owner).__name__} has no "
                          "pixel budget (size.shortest_edge / longest_edge in pixels, as Qwen2-VL's)")
    return {"size": {"shortest_edge": min_pixels if min_pixels is not None else shortest,
                     "longest_edge": max_pixels if max_pixels is not None else longest}}


@dataclass
class Decoded:
    """One media item ready for the processor: `value` (a PIL image, a video's frames, a waveform), a video's
    `metadata` and, for a video with its sound track, that track's waveform (`audio`)."""
    kind: str
    value: Any
    metadata: Any = None
    audio: Any = None
    seconds: float = 0.0


@dataclass
class MediaProcessor:
    """A process's processor (loaded on first use) with the settings its media are decoded and processed under."""
    settings: MediaSettings
    _processor: Any = field(default=None, init=False, repr=False)
    _kwargs: dict = field(default_factory=dict, init=False, repr=False)
    _sampling: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def path(self) -> str:
        return self.settings.processor_path

    @property
    def pixel_limit(self) -> int | None:
        """The largest image decoded (`decode_image`)."""
        return self.settings.image_pixel_limit

    @property
    def processor(self):
        if self._processor is None:
            processor = load_processor(self.path)
            if multiprocessing.parent_process() is not None:  # a pool worker: one core each, as its tokenizer
                import torch

                torch.set_num_threads(1)
            s = self.settings
            kwargs: dict = {}
            if getattr(processor, "image_processor", None) is not None:
                kwargs["images_kwargs"] = _size(processor.image_processor, s.image_min_pixels, s.image_max_pixels,
                                                "image")
            if getattr(processor, "video_processor", None) is not None:
                # frames reach the processor sampled already (`decode`), with their indices in the metadata
                videos = _size(processor.video_processor, s.video_min_pixels, s.video_max_pixels, "video")
                if s.video_fps is not None:
                    videos["fps"] = s.video_fps  # the omni processors' seconds per temporal patch read it too
                    self._sampling = {"fps": s.video_fps, "do_sample_frames": True}
                if "cap_pixels_per_frame" in getattr(processor.video_processor.valid_kwargs, "__annotations__", {}) \
                        and getattr(processor.video_processor, "cap_pixels_per_frame", False) is None:
                    videos["cap_pixels_per_frame"] = False  # transformers 5.23's behaviour when unset, pinned
                kwargs["videos_kwargs"] = {**videos, "do_sample_frames": False}
            self._processor, self._kwargs = processor, kwargs
        return self._processor

    @property
    def call_kwargs(self) -> dict:
        """The processor's keyword arguments for these settings (`images_kwargs`, `videos_kwargs`)."""
        self.processor  # noqa: B018  (loads it, and the kwargs with it)
        return self._kwargs

    @property
    def images_kwargs(self) -> dict:
        return self.call_kwargs.get("images_kwargs", {})

    def kinds(self) -> tuple[str, ...]:
        """The kinds of media this processor takes (a media token and the sub-processor for it)."""
        p = self.processor
        has = {"image": getattr(p, "image_processor", None) is not None and getattr(p, "image_token", None),
               "video": getattr(p, "video_processor", None) is not None and getattr(p, "video_token", None),
               "audio": getattr(p, "feature_extractor", None) is not None and getattr(p, "audio_token", None)}
        return tuple(kind for kind, ok in has.items() if ok)

    @property
    def interleaves_audio_in_video(self) -> bool:
        """Whether the processor puts a video's sound track inside its token run (the Qwen omni processors'
        `load_audio_from_video`)."""
        from transformers.processing_utils import OmniModalProcessorMixin

        return isinstance(self.processor, OmniModalProcessorMixin)

    def token(self, kind: str) -> str:
        return getattr(self.processor, f"{kind}_token")

    @property
    def sampling_rate(self) -> int:
        return int(self.processor.feature_extractor.sampling_rate)

    def _sample_indices(self, metadata) -> Any:
        """The frame indices the video processor samples from a video of `metadata` under these settings (its own
        `sample_frames`, with the keyword arguments its `preprocess` gives it), or every frame when it does not
        sample."""
        vp = self.processor.video_processor
        kwargs = {**self.call_kwargs.get("videos_kwargs", {}), "do_sample_frames": vp.do_sample_frames,
                  **self._sampling}
        for name in vp.valid_kwargs.__annotations__:
            kwargs.setdefault(name, getattr(vp, name, None))
        if not kwargs.pop("do_sample_frames"):
            import numpy as np

            return np.arange(metadata.total_num_frames)
        for name in ("input_data_format", "do_convert_rgb", "device", "video_metadata", "return_metadata"):
            kwargs.pop(name, None)
        return vp.sample_frames(metadata, **kwargs)

    def decode(self, kind: str, data: bytes, source: str, where: str, with_audio: bool = False) -> Decoded:
        """One stored item's bytes -> what the processor takes (`with_audio`: a video with its sound track)."""
        limits = self.settings.limits
        if kind == "image":
            return Decoded(kind, decode_image(data, source, where, limits.image_pixel_limit))
        if kind == "video":
            frames, metadata = decode_video(data, source, where, limits, self._sample_indices)
            audio = decode_audio(data, source, where, limits, self.sampling_rate, from_video=True) if with_audio \
                else None
            return Decoded(kind, frames, metadata, audio, float(metadata.duration or 0.0))
        samples = decode_audio(data, source, where, limits, self.sampling_rate)
        return Decoded(kind, samples, seconds=len(samples) / self.sampling_rate)

    def inputs(self, items: list[Decoded], text: list[str] | None = None, return_tensors: str | None = None,
               **kwargs) -> dict:
        """The processor's output on `items` (in token order) and `text` (default: one media token per item, the
        text of an item alone): images, videos and audio given as their kinds' lists, a video's sound track as the
        audio slot of that video (`load_audio_from_video`, with `audio_from_video_indices`)."""
        images, videos, metadata, audio, sources = [], [], [], [], []
        for item in items:
            if item.kind == "image":
                images.append(item.value)
            elif item.kind == "video":
                if item.audio is not None:
                    audio.append(item.audio)
                    sources.append(len(videos))
                videos.append(item.value)
                metadata.append(copy.deepcopy(item.metadata))  # the processor writes into it
            else:
                audio.append(item.value)
                sources.append(None)
        if text is None:
            text = ["".join(self.token(item.kind) for item in items)]
        call = dict(self.call_kwargs, **kwargs)
        if videos:
            call["videos_kwargs"] = dict(call.get("videos_kwargs", {}), video_metadata=metadata)
        if any(s is not None for s in sources):
            call.update(load_audio_from_video=True, audio_from_video_indices=sources)
        return self.processor(text=text, images=images or None, videos=videos or None, audio=audio or None,
                              return_tensors=return_tensors, **call)

    def item_inputs(self, item: Decoded) -> tuple[dict, int]:
        """(the processor's tensors for one item alone, the number of tokens its run takes): what the per-item
        calls of the media loader give, whose concatenation over a conversation's items is the processor's output
        on the whole conversation."""
        out = self.inputs([item], return_tensors="pt")
        return {k: v for k, v in out.items() if k not in TEXT_KEYS}, int(out["input_ids"].shape[-1])
