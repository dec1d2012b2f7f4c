"""The trainer's media loader: the stored media of a micro-batch's sequences -> what the model's processor gives for
each item, through the same processor, settings and decoding as the tokenize stage (data/shards/processor.py).

`MediaLoader.of(meta)` is None for text data. Called on the stored media of a micro-batch's sequences (each
sequence's `StoredMedia` list, e.g. `PackedDataset.gather(...)["media"]`), it returns a `SequenceMedia` per
sequence: its items in token order, each `(kind, inputs)` with `inputs` the processor's tensors for that item alone
under the processor's own keys (pixel_values + image_grid_thw; pixel_values_videos + video_grid_thw +
second_per_grid_ts (Qwen2.5-VL) or video_second_per_grid (the omni models); input_features +
feature_attention_mask, for audio and a video's sound track), and `rope`, what the model's `get_rope_index` takes
besides tensors (the omni models' `use_audio_in_video`). Concatenating a conversation's items' inputs key by key in
order gives the processor's output on the whole conversation, bit for bit (tests/data/test_media_loader.py).

Each item is checked against what the tokenize stage stored: its patch grid, its token count and its audio
feature frames; a difference is a configuration error (the processor or its settings changed since tokenize).
Stored bytes that do not decode are the shard format's error (`ShardFormatError`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from common.config import ConfigError
from data.shards.dataset import AUDIO_IN_VIDEO, ShardFormatError, StoredMedia
from data.shards.errors import RecordError
from data.shards.processor import MediaProcessor, MediaSettings


@dataclass
class MediaItem:
    """One image, video or audio clip of a sequence: its kind and the processor's tensors for it alone."""
    kind: str
    inputs: dict[str, Any]
    audio_in_video: bool = False  # a video whose sound track is in its token run (its inputs hold the audio too)


@dataclass
class SequenceMedia:
    """A sequence's media items in token order, and what the model's `get_rope_index` takes besides tensors."""
    items: list[MediaItem]
    rope: dict[str, Any] = field(default_factory=dict)


class MediaLoader:
    """Stored media -> the processor's per-item tensors (module docstring)."""

    def __init__(self, settings: MediaSettings):
        self.processor = MediaProcessor(settings)

    @classmethod
    def of(cls, meta: dict) -> "MediaLoader | None":
        """The loader of a dataset's meta.json (`media`; format 2's `images`), None for text-only data."""
        spec = media_settings_of(meta)
        return None if spec is None else cls(spec)

    def item(self, stored: StoredMedia, where: str = "shards") -> MediaItem:
        """One stored item's tensors, checked against what tokenize stored."""
        with_audio = bool(stored.flags & AUDIO_IN_VIDEO)
        try:
            decoded = self.processor.decode(stored.kind, stored.data, where, stored.kind, with_audio=with_audio)
        except RecordError as exc:  # stored bytes that do not decode: the shards are damaged, not a record
            raise ShardFormatError(f"the shards hold a{'n' if stored.kind != 'video' else ''} {stored.kind} that "
                                   f"does not decode: {exc}") from None
        inputs, n_tokens = self.processor.item_inputs(decoded)
        grid_key = f"{stored.kind}_grid_thw"
        got = {"tokens": n_tokens,
               "grid": tuple(int(v) for v in inputs[grid_key][0]) if grid_key in inputs else (0, 0, 0),
               "audio frames": int(inputs["feature_attention_mask"].sum()) if "feature_attention_mask" in inputs
               else 0}
        want = {"tokens": stored.n_tokens, "grid": tuple(stored.grid), "audio frames": stored.audio_frames}
        if got != want:
            raise ConfigError(f"the processor of {self.processor.path} gives a{'n' if stored.kind != 'video' else ''} "
                              f"{stored.kind} of the shards {got} where the tokenize stage stored {want}: the "
                              "processor or its settings changed since the tokenize stage; re-run it")
        return MediaItem(stored.kind, inputs, with_audio)

    def __call__(self, sequences: Sequence[Sequence[StoredMedia]]) -> list[SequenceMedia]:
        """Each sequence's items (module docstring), in the sequences' order."""
        omni = self.processor.interleaves_audio_in_video if any(sequences) else False
        out = []
        for s, stored in enumerate(sequences):
            items = [self.item(x, f"shards: sequence {s} item {k}") for k, x in enumerate(stored)]
            rope = {"use_audio_in_video": any(item.audio_in_video for item in items)} if omni else {}
            out.append(SequenceMedia(items, rope))
        return out


def media_settings_of(meta: dict) -> MediaSettings | None:
    """The media settings a dataset was tokenized under: meta.json's `media` (format 3) or `images` (format 2's
    image store: processor_path, min_pixels, max_pixels, pixel_limit); None for text-only data."""
    if meta.get("media"):
        return MediaSettings.of(meta["media"])
    spec = meta.get("images")
    if not spec:
        return None
    return MediaSettings(spec["processor_path"], spec.get("min_pixels"), spec.get("max_pixels"),
                         spec.get("pixel_limit", MediaSettings.image_pixel_limit))
