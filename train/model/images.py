"""Image conversations on packed rows: what `PackedCausalLM` does with a micro-batch's images (train/model/vision.py's
`ImageBatch`), for the composites whose family spec has `images` (train/families.py `ImageInputs`: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE, whose deepstack features are placed at the same tokens).

Per micro-batch, in two steps:
- `VisionPath.prepare(input_ids, cu_seqlens, images)` on the whole row, on the host, before sequence-parallel
  sharding: the row of every image token's feature among the images' features (their placeholder runs in row order,
  each run as long as its image's merged patch grid), and the M-RoPE positions [3, T] of every token, computed per
  packed sequence by the composite's own `get_rope_index` with that sequence's images (text-only sequences: their
  1-D positions on all three components, as the composite computes them for text).
- `VisionPath.decoder_inputs(lm, input_ids, row, sp)` inside the forward: the token embeddings of this rank's
  tokens, the tower (`get_image_features`) run on the images this rank's tokens show (all of them without sequence
  parallelism; under SP only those whose tokens reach its slice: each image runs alone through the tower, so a subset
  gives the same features), the features placed at the image tokens, and this rank's 3-D positions. A rank with no
  image token runs the tower on one blank image and adds its features times zero: every rank then runs the same
  modules in every micro-batch (ZeRO-3 gathers each module's weights collectively) and every rank's gradient
  reduction sees the tower.

The tower's gradient: each rank back-propagates only through the features of its own tokens; the sum over ranks
(the trainer's gradient all-reduce) is the gradient of the whole row. Image tokens carry no label (the data side);
their embeddings are replaced, as in the composite's own forward, so the placeholder embedding gets no gradient.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from train.families import ImageInputs
from train.model.vision import ImageBatch


# the longest sequence the start-up self-check runs whole (an image is never cut): its eager reference forward
# holds the sequence's attention scores and full-vocabulary logits at once
SELF_CHECK_MAX_TOKENS = 1024


@dataclass
class RowImages:
    """A micro-batch's images prepared on its whole row (host tensors): `feature_index` [T] the row of each token's
    feature among the images' features concatenated in order (-1: a text token), `positions` [3, T] the M-RoPE
    positions, `patch_offsets` / `feature_offsets` [n + 1] where each image's patches and features start."""

    images: ImageBatch
    feature_index: torch.Tensor
    positions: torch.Tensor
    patch_offsets: list[int]
    feature_offsets: list[int]

    def local(self, sp) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature_index [L], positions [3, L]) of this rank's tokens (`sp`: the SPContext, None: the whole row).
        Sequence-parallel padding is a text token at position 0 (its own padding sequence, no loss)."""
        if sp is None:
            return self.feature_index, self.positions
        source = sp.source_index.cpu()[sp.local_index.cpu()]  # the unpadded row index of each local token, -1: padding
        padding = source < 0
        source = source.clamp(min=0)
        return (self.feature_index[source].masked_fill(padding, -1),
                self.positions[:, source].masked_fill(padding[None], 0))


def body_of(lm: nn.Module) -> nn.Module:
    """The composite's body (`model`: towers, text decoder, `get_rope_index`, `get_image_features`), through PEFT."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return getattr(base, base.base_model_prefix)


class VisionPath:
    """A composite's image path (its family's `ImageInputs`), bound to the loaded model's config."""

    def __init__(self, lm: nn.Module, spec: ImageInputs):
        config = lm.config
        vision = config.vision_config
        self.spec = spec
        self.image_token_id = int(config.image_token_id)
        self.merge = int(vision.spatial_merge_size)
        # the processor's patch rows: channels x temporal patch x patch x patch values each (the blank image's)
        self.patch_dim = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
        self.tower = body_of(lm).visual

    def trains_tower(self) -> bool:
        return any(p.requires_grad for p in self.tower.parameters())

    def describe(self) -> str:
        """The start line's part: images on and how the tower runs."""
        return (f"images on: the vision tower ({'trained' if self.trains_tower() else 'frozen'}) runs once per "
                "micro-batch on the images of each rank's tokens (a blank image where a rank has none), features at "
                "the image tokens, M-RoPE positions per packed sequence"
                + (", deepstack features at the first decoder layers" if self.spec.deepstack else ""))

    # ------------------------------------------------------------------------------------------ the whole row
    @torch.no_grad()
    def prepare(self, lm: nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                images: ImageBatch | None) -> RowImages:
        """The micro-batch's `RowImages` (`input_ids` [1, T] or [T], `cu_seqlens` [S + 1] of the whole row;
        `images` None: a micro-batch without images). Raises ValueError when the image tokens do not match the
        images: each image's placeholder run must be exactly its merged patch count, inside one packed sequence."""
        ids = input_ids.reshape(-1).cpu()
        if images is None:
            images = ImageBatch(torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long))
        grid = images.image_grid_thw.cpu().long()
        tokens = (grid.prod(-1) // self.merge ** 2).tolist()
        patches = grid.prod(-1).tolist()
        if int(images.pixel_values.shape[0]) != sum(patches):
            raise ValueError(f"micro-batch images: pixel_values has {int(images.pixel_values.shape[0])} patch rows, "
                             f"image_grid_thw {grid.tolist()} needs {sum(patches)}")
        is_image = ids == self.image_token_id
        runs = _runs(is_image)
        if [n for _, n in runs] != tokens:
            raise ValueError(
                f"micro-batch images: the rows' image-token runs have {[n for _, n in runs]} tokens, the "
                f"{len(tokens)} images (image_grid_thw / merge {self.merge}^2) give {tokens}: each image's placeholder "
                "run must hold exactly its tokens, in the images' order")
        feature_index = torch.full(ids.shape, -1, dtype=torch.long)
        feature_index[is_image] = torch.arange(int(is_image.sum()))
        bounds = [int(x) for x in cu_seqlens.reshape(-1).tolist()]
        positions = torch.empty(3, ids.numel(), dtype=torch.long)
        body = body_of(lm)
        for start, end in zip(bounds[:-1], bounds[1:]):
            mine = [i for i, (run_start, n) in enumerate(runs) if start <= run_start < end]
            if any(runs[i][0] + runs[i][1] > end for i in mine):
                raise ValueError(f"micro-batch images: an image's tokens straddle the packed sequences ending at {end}")
            if not mine:
                positions[:, start:end] = torch.arange(end - start)
                continue
            rope, _ = body.get_rope_index(ids[None, start:end], mm_token_type_ids=is_image[None, start:end].int(),
                                          image_grid_thw=grid[mine[0]:mine[-1] + 1])
            positions[:, start:end] = rope[:, 0]
        return RowImages(images, feature_index, positions, [0, *itertools.accumulate(patches)],
                         [0, *itertools.accumulate(tokens)])

    def sequences(self, batch, limit: int = 4, max_tokens: int = SELF_CHECK_MAX_TOKENS) -> tuple[list, list]:
        """Up to `limit` whole packed sequences of a micro-batch of at most `max_tokens` tokens each (an image is never
        cut) and each one's `ImageBatch` (None: no image): the start-up self-check's inputs."""
        ids = batch.input_ids.reshape(-1).cpu()
        images = batch.images
        grid = images.image_grid_thw.cpu().long() if images is not None else torch.zeros(0, 3, dtype=torch.long)
        patches = [0, *itertools.accumulate(grid.prod(-1).tolist())]
        bounds = [int(x) for x in batch.cu_seqlens.reshape(-1).tolist()]
        # no ImageBatch (text rows): no image to run, whatever the ids hold
        run_starts = [start for start, _ in _runs(ids == self.image_token_id)] if images is not None else []
        sequences, their_images = [], []
        for start, end in zip(bounds[:-1], bounds[1:]):
            mine = [i for i, run in enumerate(run_starts) if start <= run < end]
            if end - start < 2 or end - start > max_tokens or len(sequences) == limit:
                continue
            sequences.append(ids[start:end])
            their_images.append(ImageBatch(images.pixel_values[patches[mine[0]]:patches[mine[-1] + 1]],
                                           grid[mine[0]:mine[-1] + 1]) if mine else None)
        return sequences, their_images

    # ------------------------------------------------------------------------------------------ one rank's tokens
    def decoder_inputs(self, lm: nn.Module, input_ids: torch.Tensor, row: RowImages, sp=None) -> dict:
        """The text decoder's keyword arguments for this rank's `input_ids` [1, L]: `inputs_embeds` with the image
        features placed, 3-D `position_ids` [3, 1, L] (and Qwen3-VL's deepstack inputs)."""
        feature_index, positions = row.local(sp)
        device = input_ids.device
        embeds = lm.get_input_embeddings()(input_ids)
        local = feature_index >= 0
        wanted = feature_index[local]  # the feature rows (of all the images) this rank's image tokens take
        offsets = torch.tensor(row.feature_offsets)
        image_of = torch.bucketize(wanted, offsets[1:], right=True)  # the image each of them belongs to
        chosen = torch.unique(image_of).tolist()
        features = self._features(lm, row, chosen, device)
        extra = {}
        if chosen:
            # a feature row among all the images' -> among the chosen images' features (concatenated in order)
            counts = offsets[1:] - offsets[:-1]
            shift = torch.zeros(len(counts), dtype=torch.long)
            shift[chosen] = torch.cumsum(counts[chosen], 0) - counts[chosen] - offsets[chosen]
            rows = (wanted + shift[image_of]).to(device)
            main, *deep = features
            mask = local.to(device)[None, :, None]
            embeds = embeds.masked_scatter(mask.expand_as(embeds), main[rows].to(embeds.dtype))
            if self.spec.deepstack:
                extra = {"visual_pos_masks": local.to(device)[None],
                         "deepstack_visual_embeds": [d[rows].to(embeds.dtype) for d in deep]}
        else:  # the blank image: the same modules ran, nothing of it reaches the loss
            embeds = embeds + sum(f.sum() for f in features) * 0.0
        return {"inputs_embeds": embeds, "position_ids": positions.to(device)[:, None, :], **extra}

    def _features(self, lm: nn.Module, row: RowImages, chosen: list[int], device: torch.device) -> list[torch.Tensor]:
        """[main, *deepstack] features of the images `chosen` (concatenated in order); of one blank image when none.
        A frozen tower runs without autograd."""
        if chosen:
            pixels = torch.cat([row.images.pixel_values[row.patch_offsets[i]:row.patch_offsets[i + 1]]
                                for i in chosen])
            grid = row.images.image_grid_thw[chosen]
        else:
            grid = torch.tensor([[1, self.merge, self.merge]])
            pixels = torch.zeros(self.merge ** 2, self.patch_dim)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.trains_tower()):
            out = body_of(lm).get_image_features(pixels.to(device), grid.to(device), return_dict=True)
        main = torch.cat(out.pooler_output)
        if not self.spec.deepstack:
            return [main]
        return [main, *(torch.cat(f) for f in out.deepstack_features)]


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of every run of True in `mask` [T]."""
    edges = torch.diff(torch.nn.functional.pad(mask.int(), (1, 1)))
    starts, ends = torch.nonzero(edges == 1).reshape(-1), torch.nonzero(edges == -1).reshape(-1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))
