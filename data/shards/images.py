"""The trainer's image loader: the stored images of a micro-batch's rows -> the (pixel_values, image_grid_thw)
tensors the model's vision tower takes, through the same image processor and settings as the tokenize stage
(data/shards/processor.py). The image path of the trainer (train/steps/batch.py's `ImageBatch`) runs it; the media
loader (data/shards/media.py) generalises it to videos and audio. Stored bytes that do not decode are the shard
format's error (`ShardFormatError`), a grid that differs from the stored one a configuration error (the processor
or its limits changed since tokenize)."""
from __future__ import annotations

from typing import Any

import numpy as np

from common.config import ConfigError
from data.shards.dataset import ShardFormatError
from data.shards.decode import DEFAULT_PIXEL_LIMIT, decode_image
from data.shards.errors import RecordError
from data.shards.media import media_settings_of
from data.shards.processor import MediaProcessor, MediaSettings


class ImageLoader:
    """The images of a micro-batch's rows -> (pixel_values, image_grid_thw) tensors, what train/model/vision.py's
    `ImageBatch` holds: the shards' encoded bytes run through the same image processor (and pixel limits) as the
    tokenize stage, each image's grid checked against the stored one."""

    def __init__(self, processor_path: str, min_pixels: int | None = None, max_pixels: int | None = None,
                 pixel_limit: int | None = DEFAULT_PIXEL_LIMIT, settings: MediaSettings | None = None):
        self.vision = MediaProcessor(settings or MediaSettings(processor_path, min_pixels, max_pixels, pixel_limit))

    @classmethod
    def of(cls, meta: dict) -> "ImageLoader | None":
        """The loader of a dataset's meta.json (`media`, or format 2's `images`), None for text-only data."""
        settings = media_settings_of(meta)
        return None if settings is None else cls(settings.processor_path, settings=settings)

    def __call__(self, datas: list[bytes], grids: np.ndarray) -> tuple[Any, Any]:
        """The images' (pixel_values, image_grid_thw): exactly the image processor's on each file as Pillow opens it
        (`decode_image`), each image processed alone by it whatever the others of the micro-batch."""
        processor = self.vision.processor
        try:
            pil = [decode_image(data, "shards", f"image {k}", self.vision.pixel_limit) for k, data in enumerate(datas)]
        except RecordError as exc:  # stored bytes that do not decode: the shards are damaged, not a record
            raise ShardFormatError(f"the shards hold an image that does not decode: {exc}") from None
        out = processor.image_processor(images=pil, return_tensors="pt", **self.vision.images_kwargs)
        got = out["image_grid_thw"]
        if tuple(got.shape) != tuple(grids.shape) or not np.array_equal(got.numpy(), grids):
            raise ConfigError(f"the image processor of {self.vision.path} gives grids {got.tolist()} where the "
                              f"shards hold {np.asarray(grids).tolist()}: the processor or its limits changed since "
                              "the tokenize stage; re-run it")
        return out["pixel_values"], got
