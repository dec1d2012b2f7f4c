"""The media of a micro-batch as the trainer carries them beside its packed rows (image, video and audio
conversations: issues 29 and 50).

The rows' `input_ids` already hold each item's placeholder tokens (as many as the model's processor counted). A
`MediaBatch` holds, for every media item of the micro-batch, what the composite's tower needs for it: `(kind,
inputs)`, `kind` one of train/families.py's MEDIA_KINDS and `inputs` the tensors the model's processor gives for
that item alone, under the processor's own names:
- image: `pixel_values` [patches, patch_dim], `image_grid_thw` [1, 3];
- video: `pixel_values_videos` [patches, patch_dim], `video_grid_thw` [1, 3], and the seconds per temporal patch
  where the processor gives them (`second_per_grid_ts` [1]: Qwen2.5-VL; `video_second_per_grid` [1]: Qwen2.5-Omni);
- audio: `input_features` [1, mel bins, frames], `feature_attention_mask` [1, frames].
Items are in the order of their first placeholder token in the rows (row by row, left to right; a video whose audio
track the Omni thinker interleaves with its frames comes before that audio). Per packed sequence of the micro-batch,
`audio_in_video` says whether its videos carry their audio inside (the Omni thinker's `use_audio_in_video`, which
its processor and its `get_rope_index` take per conversation).

The data side's media loader (data/shards/media.py) gives the same per sequence: its items in token order, a video
with its sound track as one item whose inputs hold both (`audio_in_video`), and `rope` (`use_audio_in_video`);
`MediaBatch.of_sequences` turns that into this batch (the sound track becomes the audio item after its video).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from train.families import MEDIA_KINDS


@dataclass
class MediaBatch:
    items: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    audio_in_video: list[bool] = field(default_factory=list)  # per packed sequence; [] or False: none

    def __post_init__(self):
        for k, (kind, inputs) in enumerate(self.items):
            if kind not in MEDIA_KINDS:
                raise ValueError(f"micro-batch media item {k}: kind {kind!r} is none of {MEDIA_KINDS}")
            if not isinstance(inputs, dict):
                raise ValueError(f"micro-batch media item {k} ({kind}): inputs must be the processor's dict of tensors")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def kinds(self) -> set[str]:
        return {kind for kind, _ in self.items}

    def audio_in_video_of(self, sequence: int) -> bool:
        return sequence < len(self.audio_in_video) and bool(self.audio_in_video[sequence])

    @classmethod
    def of_sequences(cls, sequences) -> "MediaBatch":
        """The batch of the data side's media loader output: one entry per packed sequence of the micro-batch, each
        with `items` (`kind`, `inputs`, `audio_in_video`) in token order and `rope` (`use_audio_in_video`)."""
        items, flags = [], []
        for sequence in sequences:
            flags.append(bool(sequence.rope.get("use_audio_in_video", False)))
            for item in sequence.items:
                if item.kind == "video" and item.audio_in_video:
                    items.append(("video", {k: v for k, v in item.inputs.items() if k not in AUDIO_KEYS}))
                    items.append(("audio", {k: item.inputs[k] for k in AUDIO_KEYS}))
                else:
                    items.append((item.kind, item.inputs))
        return cls(items, flags)


# a video item's inputs that are its sound track (the Omni processor's audio keys)
AUDIO_KEYS = ("input_features", "feature_attention_mask")
COUNT_KEYS = {"image": ("images",), "video": ("videos",), "audio": ("audios", "videos_with_audio")}  # meta.json


def dataset_media_kinds(*datasets) -> tuple[str, ...]:
    """The media kinds the datasets hold (None: no dataset), in MEDIA_KINDS order, from their meta.json counts
    (`images`, `videos`, `audios`, `videos_with_audio`: a sound track trains the audio tower); a media store without
    counts of them holds images (the image stores before videos and audios)."""
    kinds: set[str] = set()
    for data in datasets:
        if data is None or not (getattr(data, "has_media", False) or getattr(data, "has_images", False)):
            continue
        counts = data.meta.get("counts", {})
        held = {kind for kind, keys in COUNT_KEYS.items() if any(counts.get(key) for key in keys)}
        kinds.update(held or {"image"})
    return tuple(kind for kind in MEDIA_KINDS if kind in kinds)
