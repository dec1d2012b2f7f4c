"""Image, video and audio conversations on packed rows: what `PackedCausalLM` does with a micro-batch's media
(train/model/media_batch.py's `MediaBatch`), for the composites whose family spec has `media` (train/families.py
`MediaInputs`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE for images and videos, Qwen2-Audio for audio, the
Qwen2.5-Omni thinker for all three and audio inside video).

Per micro-batch, in two steps:
- `MediaPath.prepare(lm, input_ids, cu_seqlens, media)` on the whole row, on the host, before sequence-parallel
  sharding: for every media token, the row of its feature among the items' features (per kind, the kind's tokens in
  row order take the kind's items in order, each as many tokens as its processor output gives: merged patch grid,
  audio frames after the tower's convolutions and pooling), checked to lie inside one packed sequence; and the
  positions of every token, computed per packed sequence by the composite's own `get_rope_index` with that
  sequence's items (M-RoPE; the Omni thinker's with its audio lengths, seconds per grid and `use_audio_in_video`),
  or none for a 1-D family (Qwen2-Audio: the packed positions stand).
- `MediaPath.decoder_inputs(lm, input_ids, row, sp)` inside the forward: the token embeddings of this rank's tokens,
  the towers run on the media this rank's tokens show, the features placed at the media tokens (Qwen3-VL: and its
  deepstack features at the visual tokens), and this rank's positions.

Where a clip's features are made (long rows, sequence parallelism): on every rank whose tokens show it, from the
part of it they show. A video's vision tower attends within each temporal patch (the frames one grid step merges:
its blocks' `cu_seqlens` and windows are per frame group, its positions per frame), so the features of some of
its temporal patches are the tower run on those patches' rows alone (`get_video_features` with the sub-grid
[k, h, w]). A rank runs the tower only on the temporal patches its tokens reach: each frame group is encoded once
over the sp group, twice where a group straddles a rank boundary, and nothing crosses ranks. Images and audios are
encoded whole by each rank they reach (an image is one temporal patch; an audio is short beside a clip). Each rank
back-propagates through the features of its own tokens only; the sum over ranks (the trainer's gradient
all-reduce) is the whole row's gradient.

Every rank runs the same modules in every micro-batch: one call per media kind of the run (`kinds`: the data's),
on a blank item of that kind where its tokens show none (features times zero), so ZeRO-3's collective gathers of
each module's weights and every rank's gradient reduction see the same modules. Media tokens carry no label (the
data side); their embeddings are replaced, as in the composite's own forward, so the placeholder embeddings get no
gradient.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from train.families import MEDIA_KINDS, AudioTower, MediaInputs, Positions
from train.model.media_batch import MediaBatch


# the longest sequence the start-up self-check runs whole (an item is never cut): its eager reference forward
# holds the sequence's attention scores and full-vocabulary logits at once
SELF_CHECK_MAX_TOKENS = 1024

TOKEN_KEYS = {"image": "image_token_id", "video": "video_token_id", "audio": "audio_token_id"}  # config attributes
GRID_KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
MM_TOKEN_TYPES = {"image": 1, "video": 2}  # the processor's mm_token_type_ids (Qwen2-VL family)
SECONDS_KEYS = ("second_per_grid_ts", "video_second_per_grid")  # a video's seconds per temporal patch
TOWERS = {"image": ("visual",), "video": ("visual",), "audio": ("audio_tower", "multi_modal_projector")}


@dataclass(frozen=True)
class Unit:
    """The part of an item that a tower can encode alone: `tokens` features from `rows` rows of its inputs (a video's
    temporal patch; a whole image or audio)."""

    count: int  # units in the item
    tokens: int  # features per unit
    rows: int  # input rows per unit (patch rows; an audio: its one input)


@dataclass
class RowMedia:
    """A micro-batch's media prepared on its whole row (host tensors): `feature_index` [T] the row of each token's
    feature among the items' features concatenated in order (-1: a text token), `positions` [3, T] (None: the packed
    1-D positions), `offsets` [n + 1] where each item's features start, `units` each item's `Unit`."""

    media: MediaBatch
    feature_index: torch.Tensor
    positions: torch.Tensor | None
    offsets: list[int]
    units: list[Unit]

    def local(self, sp) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(feature_index [L], positions [3, L] or None) of this rank's tokens (`sp`: the SPContext, None: the whole
        row). Sequence-parallel padding is a text token at position 0 (its own padding sequence, no loss)."""
        if sp is None:
            return self.feature_index, self.positions
        source = sp.source_index.cpu()[sp.local_index.cpu()]  # the unpadded row index of each local token, -1: padding
        padding = source < 0
        source = source.clamp(min=0)
        positions = None if self.positions is None else self.positions[:, source].masked_fill(padding[None], 0)
        return self.feature_index[source].masked_fill(padding, -1), positions


def body_of(lm: nn.Module) -> nn.Module:
    """The composite's body (`model`: towers, text decoder, `get_rope_index`, `get_*_features`), through PEFT."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return getattr(base, base.base_model_prefix)


class MediaPath:
    """A composite's media path (its family's `MediaInputs`), bound to the loaded model's config; `kinds`: the media
    kinds of the run's data (each runs its tower once per micro-batch on every rank), default all the family's."""

    def __init__(self, lm: nn.Module, spec: MediaInputs, kinds=None):
        config = lm.config
        self.spec = spec
        self.kinds = tuple(kind for kind in MEDIA_KINDS if kind in set(spec.kinds if kinds is None else kinds))
        if set(self.kinds) - set(spec.kinds):
            raise ValueError(f"media kinds {self.kinds}: the family trains {spec.kinds} exactly")
        self.token_ids = {kind: int(getattr(config, TOKEN_KEYS[kind])) for kind in spec.kinds}
        body = body_of(lm)
        if {"image", "video"} & set(spec.kinds):
            vision = config.vision_config
            self.merge = int(vision.spatial_merge_size)
            # the processor's patch rows: channels x temporal patch x patch x patch values each (the blank item's)
            self.patch_dim = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
        if "audio" in spec.kinds:
            audio = config.audio_config
            self.mel_bins = int(audio.num_mel_bins)
            # Qwen2-Audio's tower takes exactly its 30-s window; the Omni thinker's any length
            self.audio_frames = (int(audio.max_source_positions) * 2 if spec.audio is AudioTower.PROJECTED else 100)
            self.audio_lengths = body.audio_tower._get_feat_extract_output_lengths

    def modules(self, lm: nn.Module, kind: str) -> list[nn.Module]:
        body = body_of(lm)
        return [getattr(body, name) for name in TOWERS[kind] if hasattr(body, name)]

    def trains(self, lm: nn.Module, kind: str) -> bool:
        return any(p.requires_grad for module in self.modules(lm, kind) for p in module.parameters())

    def describe(self, lm: nn.Module) -> str:
        """The start line's part: the media kinds on and how their towers run."""
        towers = ", ".join(f"{kind}s ({'trained' if self.trains(lm, kind) else 'frozen'} tower)" for kind in self.kinds)
        return (f"media on: {towers}: each tower runs once per micro-batch on the media of each rank's tokens (a "
                f"video's temporal patches that rank shows; a blank item where it shows none), features at the media "
                f"tokens, {self.spec.positions.value} per packed sequence"
                + (", deepstack features at the first decoder layers" if self.spec.deepstack else ""))

    @staticmethod
    def reset_positions(lm: nn.Module) -> None:
        """Forget the rope deltas an M-RoPE composite keeps between forwards: before each reference forward of one
        conversation alone."""
        body = body_of(lm)
        if hasattr(body, "rope_deltas"):
            body.rope_deltas = None

    # ------------------------------------------------------------------------------------------ items
    def unit(self, kind: str, inputs: dict) -> Unit:
        """How `kind`'s item of `inputs` splits into units (module docstring)."""
        if kind == "audio":
            lengths = inputs["feature_attention_mask"].reshape(-1).sum().reshape(1)
            return Unit(1, int(self.audio_lengths(lengths)[1]), 1)
        t, h, w = (int(x) for x in inputs[GRID_KEYS[kind][1]].reshape(3))
        return Unit(t if kind == "video" else 1, h * w // self.merge ** 2 * (1 if kind == "video" else t),
                    h * w * (1 if kind == "video" else t))

    # ------------------------------------------------------------------------------------------ the whole row
    @torch.no_grad()
    def prepare(self, lm: nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                media: MediaBatch | None) -> RowMedia:
        """The micro-batch's `RowMedia` (`input_ids` [1, T] or [T], `cu_seqlens` [S + 1] of the whole row; `media`
        None: a micro-batch without media). Raises ValueError when the media tokens do not match the items: per kind,
        the tokens must be exactly the items' tokens in the items' order, each item inside one packed sequence."""
        ids = input_ids.reshape(-1).cpu()
        media = media if media is not None else MediaBatch()
        feature_index, offsets, units, sequence_of = self._assign(ids, cu_seqlens, media)
        positions = None
        if self.spec.positions is not Positions.ONE_D:
            bounds = [int(x) for x in cu_seqlens.reshape(-1).tolist()]
            positions = torch.empty(3, ids.numel(), dtype=torch.long)
            for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                theirs = [media.items[k] for k, seq in enumerate(sequence_of) if seq == s]
                positions[:, start:end] = (self._positions(lm, ids[start:end], theirs, media.audio_in_video_of(s))
                                           if theirs else torch.arange(end - start))
        return RowMedia(media, feature_index, positions, offsets, units)

    def _assign(self, ids: torch.Tensor, cu_seqlens: torch.Tensor, media: MediaBatch):
        """(feature_index [T], feature offsets [n + 1], units, the packed sequence of each item) of `media` on the
        row `ids` [T]; ValueError where tokens and items differ (`prepare`)."""
        items = media.items
        foreign = sorted({kind for kind, _ in items} - set(self.spec.kinds))
        if foreign:
            raise ValueError(f"micro-batch media: {foreign} items, which this family does not train "
                             f"(it trains {list(self.spec.kinds)})")
        units = [self.unit(kind, inputs) for kind, inputs in items]
        sizes = [u.count * u.tokens for u in units]
        offsets = [0, *itertools.accumulate(sizes)]
        feature_index = torch.full(ids.shape, -1, dtype=torch.long)
        ends = torch.tensor([int(x) for x in cu_seqlens.reshape(-1).tolist()][1:])
        sequence_of = [0] * len(items)
        for kind in self.spec.kinds:
            where = torch.nonzero(ids == self.token_ids[kind]).reshape(-1)
            mine = [k for k, (item_kind, _) in enumerate(items) if item_kind == kind]
            want = [sizes[k] for k in mine]
            if int(where.numel()) != sum(want):
                raise ValueError(
                    f"micro-batch media: the rows hold {int(where.numel())} {kind} tokens, the {len(mine)} {kind} "
                    f"items give {want} (their processor outputs): each item's placeholder tokens must be exactly "
                    "its tokens, in the items' order")
            start = 0
            for k in mine:
                tokens = where[start:start + sizes[k]]
                feature_index[tokens] = torch.arange(offsets[k], offsets[k + 1])
                seqs = torch.bucketize(tokens, ends, right=True).unique()
                if seqs.numel() != 1:
                    raise ValueError(f"micro-batch media: {kind} item {k}'s tokens straddle the packed sequences "
                                     f"{seqs.tolist()}")
                sequence_of[k] = int(seqs)
                start += sizes[k]
        return feature_index, offsets, units, sequence_of

    def _positions(self, lm: nn.Module, ids: torch.Tensor, items: list, audio_in_video: bool) -> torch.Tensor:
        """[3, n] positions of one packed sequence `ids` [n] with its `items` (in order): the composite's own
        get_rope_index, given what its forward gives it."""
        body = body_of(lm)
        inputs = self.forward_inputs(ids, items, audio_in_video)
        if self.spec.positions is Positions.OMNI:
            audio_lengths = (inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs
                             else None)
            rope, _ = body.get_rope_index(ids[None], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                          inputs["attention_mask"], audio_in_video, audio_lengths,
                                          inputs.get("video_second_per_grid"))
        else:
            extra = {key: inputs[key] for key in ("second_per_grid_ts",) if key in inputs}
            rope, _ = body.get_rope_index(ids[None], mm_token_type_ids=inputs["mm_token_type_ids"],
                                          image_grid_thw=inputs.get("image_grid_thw"),
                                          video_grid_thw=inputs.get("video_grid_thw"), **extra)
        return rope[:, 0]

    def forward_inputs(self, ids: torch.Tensor, items: list, audio_in_video: bool = False) -> dict:
        """The keyword arguments the composite's own forward takes for one conversation `ids` [n] with its `items`
        (in order), as its processor gives them for the whole conversation: each kind's tensors concatenated over
        its items (audio features padded to the longest), `mm_token_type_ids` (M-RoPE families), an all-ones
        `attention_mask` and `use_audio_in_video` (the Omni thinker, whose positions need both)."""
        out: dict = {}
        for kind in MEDIA_KINDS:
            mine = [inputs for item_kind, inputs in items if item_kind == kind]
            if not mine:
                continue
            if kind == "audio":
                out.update(_padded_audio(mine))
                continue
            for key in sorted(set().union(*mine)):
                out[key] = torch.cat([inputs[key].reshape(-1) if key in SECONDS_KEYS else inputs[key]
                                      for inputs in mine])
        if self.spec.positions is Positions.MROPE:
            types = torch.zeros(ids.numel(), dtype=torch.int)
            for kind, value in MM_TOKEN_TYPES.items():
                if kind in self.token_ids:
                    types[ids == self.token_ids[kind]] = value
            out["mm_token_type_ids"] = types[None]
        if self.spec.positions is Positions.OMNI:
            out["attention_mask"] = torch.ones(1, ids.numel(), dtype=torch.long)
            out["use_audio_in_video"] = audio_in_video
        return out

    def sequences(self, batch, limit: int = 4, max_tokens: int = SELF_CHECK_MAX_TOKENS) -> tuple[list, list]:
        """Up to `limit` whole packed sequences of a micro-batch of at most `max_tokens` tokens each (an item is never
        cut) and each one's `MediaBatch` (None: no media): the start-up self-check's inputs."""
        ids = batch.input_ids.reshape(-1).cpu()
        media = batch.media or MediaBatch()
        sequence_of = self._assign(ids, batch.cu_seqlens, media)[3]
        bounds = [int(x) for x in batch.cu_seqlens.reshape(-1).tolist()]
        sequences, their_media = [], []
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end - start < 2 or end - start > max_tokens or len(sequences) == limit:
                continue
            sequences.append(ids[start:end])
            theirs = [item for item, seq in zip(media.items, sequence_of) if seq == s]
            their_media.append(MediaBatch(theirs, [media.audio_in_video_of(s)]) if theirs else None)
        return sequences, their_media

    # ------------------------------------------------------------------------------------------ one rank's tokens
    def decoder_inputs(self, lm: nn.Module, input_ids: torch.Tensor, row: RowMedia, sp=None) -> dict:
        """The text decoder's keyword arguments for this rank's `input_ids` [1, L]: `inputs_embeds` with the media
        features placed, `position_ids` [3, 1, L] (M-RoPE families; else the caller's) and Qwen3-VL's deepstack
        inputs."""
        feature_index, positions = row.local(sp)
        device = input_ids.device
        embeds = lm.get_input_embeddings()(input_ids)
        local = feature_index >= 0
        wanted = feature_index[local]  # the feature rows (of all the items) this rank's media tokens take
        offsets = torch.tensor(row.offsets)
        item_of = torch.bucketize(wanted, offsets[1:], right=True)
        per_unit = torch.tensor([u.tokens for u in row.units] or [1])
        unit_of = (wanted - offsets[item_of]) // per_unit[item_of]
        parts = _runs_of_units(item_of, unit_of)  # (item, first unit, units): what the towers encode here
        features, deep, starts, blanks = self._features(lm, row, parts, device)
        extra = {}
        if parts:
            # a feature row among all the items' -> among this rank's parts' features (concatenated in order)
            # the part of each token: the last run starting at or before its (item, unit), runs sorted and disjoint
            span = max(u.count for u in row.units)
            run_starts = torch.tensor([item * span + first for item, first, _ in parts])
            part_of = torch.searchsorted(run_starts, item_of * span + unit_of, right=True) - 1
            first_unit = torch.tensor([first for _, first, _ in parts])
            rows = (torch.tensor(starts)[part_of] + wanted - offsets[item_of]
                    - first_unit[part_of] * per_unit[item_of]).to(device)
            mask = local.to(device)[None, :, None]
            embeds = embeds.masked_scatter(mask.expand_as(embeds), features[rows].to(embeds.dtype))
            if self.spec.deepstack:
                visual = torch.tensor([kind != "audio" for kind, _ in row.media.items])[item_of]
                visual_mask = local.clone()
                visual_mask[local] = visual
                extra = {"visual_pos_masks": visual_mask.to(device)[None],
                         "deepstack_visual_embeds": [d[rows[visual.to(device)]].to(embeds.dtype) for d in deep]}
        if blanks is not None:  # the blank items: the same modules ran, nothing of them reaches the loss
            embeds = embeds + blanks * 0.0
        out = {"inputs_embeds": embeds, **extra}
        if positions is not None:
            out["position_ids"] = positions.to(device)[:, None, :]
        return out

    def _features(self, lm: nn.Module, row: RowMedia, parts: list[tuple[int, int, int]], device: torch.device):
        """(features [N, H] of `parts` concatenated in order, deepstack features [N, H] each (visual parts; zeros at
        audio rows), where each part's features start, the blank items' features summed or None). One tower call
        per kind of the run; a frozen tower runs without autograd."""
        body = body_of(lm)
        by_kind: dict[str, list[int]] = {kind: [] for kind in self.kinds}
        for p, (item, _, _) in enumerate(parts):
            by_kind[row.media.items[item][0]].append(p)
        out: list = [None] * len(parts)
        deep_out: list = [None] * len(parts)
        blanks = None
        for kind in self.kinds:
            mine = by_kind[kind]
            inputs = [self._part_inputs(kind, row, parts[p]) for p in mine] or [self._blank(kind)]
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.trains(lm, kind)):
                main, deep = self._encode(body, kind, inputs, device)
            if not mine:
                total = sum(f.sum() for f in main) + sum(f.sum() for layer in deep for f in layer)
                blanks = total if blanks is None else blanks + total
                continue
            for j, p in enumerate(mine):
                out[p] = main[j]
                deep_out[p] = [layer[j] for layer in deep]
        if not parts:
            return None, [], [], blanks
        features = torch.cat(out)
        starts = [0, *itertools.accumulate(f.shape[0] for f in out)][:-1]
        deep = []
        if self.spec.deepstack:
            layers = max(len(d) for d in deep_out)
            deep = [torch.cat([d[layer] if d else torch.zeros_like(f) for d, f in zip(deep_out, out)])
                    for layer in range(layers)]
        return features, deep, starts, blanks

    def _part_inputs(self, kind: str, row: RowMedia, part: tuple[int, int, int]) -> dict:
        """The inputs of units [first, first + count) of an item: a video's sub-grid of temporal patches; an image
        or audio whole."""
        item, first, count = part
        inputs = row.media.items[item][1]
        if kind != "video" or (first == 0 and count == row.units[item].count):
            return inputs
        pixels_key, grid_key = GRID_KEYS[kind]
        rows = row.units[item].rows
        grid = inputs[grid_key].reshape(1, 3).clone()
        grid[0, 0] = count
        return {pixels_key: inputs[pixels_key][first * rows:(first + count) * rows], grid_key: grid}

    def _blank(self, kind: str) -> dict:
        """One tiny item of `kind`: a merge x merge patch image / single-temporal-patch video, or a short silence."""
        if kind == "audio":
            mask = torch.zeros(1, self.audio_frames, dtype=torch.long)
            mask[0, :100] = 1
            return {"input_features": torch.zeros(1, self.mel_bins, self.audio_frames), "feature_attention_mask": mask}
        pixels_key, grid_key = GRID_KEYS[kind]
        return {pixels_key: torch.zeros(self.merge ** 2, self.patch_dim),
                grid_key: torch.tensor([[1, self.merge, self.merge]])}

    def _encode(self, body: nn.Module, kind: str, inputs: list[dict], device) -> tuple[list, list]:
        """([features of each input], [[deepstack layer l of each input] per layer]): the kind's tower on the inputs
        in one call."""
        if kind == "audio":
            audio = {key: value.to(device) for key, value in _padded_audio(inputs).items()}
            lengths = self.audio_lengths(audio["feature_attention_mask"].sum(-1))[1].tolist()
            if self.spec.audio is AudioTower.GET_AUDIO_FEATURES:
                features = body.get_audio_features(audio["input_features"], audio["feature_attention_mask"],
                                                   return_dict=True).last_hidden_state
                return list(torch.split(features, lengths)), []
            return projected_audio_features(body, audio["input_features"], audio["feature_attention_mask"]), []
        pixels_key, grid_key = GRID_KEYS[kind]
        pixels = torch.cat([i[pixels_key] for i in inputs]).to(device)
        grids = torch.cat([i[grid_key].reshape(-1, 3) for i in inputs]).to(device)
        function = body.get_image_features if kind == "image" else body.get_video_features
        out = function(pixels, grids, return_dict=True)
        deep = [list(layer) for layer in out.deepstack_features] if self.spec.deepstack else []
        return list(out.pooler_output), deep


def projected_audio_features(body: nn.Module, input_features: torch.Tensor,
                             feature_attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Qwen2-Audio's audio features, one [n_i, H] per audio: the steps of Qwen2AudioModel.forward between its inputs
    and the placement (it has no function of its own): the tower on the padded features with the padding masked
    from attention (its bidirectional mask of the lengths after the first convolution), the projector, each audio's
    first `_get_feat_extract_output_lengths` rows."""
    from transformers.masking_utils import create_bidirectional_mask

    tower = body.audio_tower
    feat_lengths, output_lengths = tower._get_feat_extract_output_lengths(feature_attention_mask.sum(-1))
    batch, _, frames = input_features.shape
    positions = (frames - 2) // 2 + 1
    valid = torch.arange(positions, device=feat_lengths.device)[None, :] < feat_lengths[:, None]
    mask = create_bidirectional_mask(config=tower.config,
                                     inputs_embeds=torch.zeros(batch, positions, 1, dtype=input_features.dtype,
                                                               device=input_features.device),
                                     attention_mask=valid.long())
    hidden = body.multi_modal_projector(tower(input_features, attention_mask=mask).last_hidden_state)
    return [hidden[k, :n] for k, n in enumerate(output_lengths.tolist())]


def _padded_audio(inputs: list[dict]) -> dict:
    """Audio items' `input_features` / `feature_attention_mask` stacked, padded (zeros, masked) to the longest."""
    frames = max(int(i["input_features"].shape[-1]) for i in inputs)
    features = torch.cat([nn.functional.pad(i["input_features"], (0, frames - int(i["input_features"].shape[-1])))
                          for i in inputs])
    masks = torch.cat([nn.functional.pad(i["feature_attention_mask"], (0, frames - int(i["input_features"].shape[-1])))
                       for i in inputs])
    return {"input_features": features, "feature_attention_mask": masks}


def _runs_of_units(item_of: torch.Tensor, unit_of: torch.Tensor) -> list[tuple[int, int, int]]:
    """The (item, first unit, units) runs of consecutive units among the (item, unit) pairs of this rank's tokens,
    in order."""
    pairs = sorted(set(zip(item_of.tolist(), unit_of.tolist())))
    runs: list[list[int]] = []
    for item, unit in pairs:
        if runs and runs[-1][0] == item and runs[-1][1] + runs[-1][2] == unit:
            runs[-1][2] += 1
        else:
            runs.append([item, unit, 1])
    return [tuple(r) for r in runs]
