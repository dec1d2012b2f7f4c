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
    def of_images(cls, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> "MediaBatch":
        """The images of an image loader's output (every image's patch rows concatenated, their grids), one item each
        (data/shards/images.py's ImageLoader)."""
        grids = torch.as_tensor(image_grid_thw).reshape(-1, 3)
        counts = grids.prod(-1).tolist()
        if sum(counts) != int(pixel_values.shape[0]):
            raise ValueError(f"micro-batch images: pixel_values has {int(pixel_values.shape[0])} patch rows, "
                             f"image_grid_thw {grids.tolist()} needs {sum(counts)}")
        rows = torch.split(pixel_values, counts)
        return cls([("image", {"pixel_values": p, "image_grid_thw": g[None]}) for p, g in zip(rows, grids)])


def dataset_media_kinds(*datasets) -> tuple[str, ...]:
    """The media kinds the datasets hold (None: no dataset), in MEDIA_KINDS order: a dataset's `media_kinds` (shards
    with videos or audios), or ("image",) for an image dataset (`has_images`)."""
    kinds: set[str] = set()
    for data in datasets:
        if data is None:
            continue
        kinds.update(getattr(data, "media_kinds", None) or (("image",) if getattr(data, "has_images", False) else ()))
    return tuple(kind for kind in MEDIA_KINDS if kind in kinds)
