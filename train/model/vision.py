"""Images of a micro-batch as the trainer carries them beside its packed rows (image conversations, issue 29).

The rows' `input_ids` already hold each image's placeholder tokens (as many as the processor counted); an
`ImageBatch` holds what the composite's vision tower needs for those images, in the order their placeholder runs
appear in the micro-batch's rows (row by row, left to right).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ImageBatch:
    """`pixel_values`: the processor's output for the images ([patches, patch_dim] for Qwen2-VL-style towers);
    `image_grid_thw`: [n_images, 3] (temporal, height, width) patch grid of each image."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def __len__(self) -> int:
        return int(self.image_grid_thw.shape[0])
