"""Video and audio conversations for the trainer's media tests (tests/train/test_media.py and its gloo worker).

The shared fixtures (../shared/fixtures/multimodal: mllm_av_demo.json with its H.264 / VP9 clips, wav, MP3 and stereo
FLAC, and the image demo's records) decoded as transformers decodes them: videos through
`transformers.video_utils.load_video(path, backend="pyav")`, audio through PyAV, its channels averaged and resampled
to the feature extractor's 16 kHz. Each conversation goes through the real processor of its family twice:
- on the whole conversation: the reference (transformers' composite forward takes every key of that output);
- on each media item alone: the item's `inputs`, what the data side's loader hands the trainer per item
  (train/model/media_batch.py's contract).
Tiny random-init composites are built from configs: hidden 64, 2 text layers, towers of 1-2 blocks, the Qwen
vocabulary (its real media token ids), attention sharpened so positions and placement move the loss.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.conftest import fixture_path

VOCAB = 151936  # the Qwen2 / 2.5 / 3 vocabulary: every special id the processors give
# the families whose video / audio conversations train exactly (train/families.py), and what their data may hold
KINDS = {"qwen2_vl": ("image", "video"), "qwen2_5_vl": ("image", "video"), "qwen3_vl": ("image", "video"),
         "qwen3_vl_moe": ("image", "video"), "qwen2_audio": ("audio",),
         "qwen2_5_omni_thinker": ("image", "video", "audio")}
# small frames and few of them: 2 frames per second, at most 8 x 8 patches per frame
QWEN2_VIDEOS = {"do_sample_frames": True, "fps": 2, "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}}
QWEN3_VIDEOS = {"do_sample_frames": True, "fps": 2, "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128 * 4}}
VIDEO_KWARGS = {"qwen2_vl": QWEN2_VIDEOS, "qwen2_5_vl": QWEN2_VIDEOS, "qwen3_vl": QWEN3_VIDEOS,
                "qwen3_vl_moe": QWEN3_VIDEOS, "qwen2_5_omni_thinker": QWEN2_VIDEOS}
IMAGE_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
TEXT_RECORD = {"messages": [{"role": "user", "content": "What is two plus two? Answer in words."},
                            {"role": "assistant", "content": "Two plus two is four."}]}


@dataclass
class Conversation:
    """One conversation: `reference` the processor's output on all of it (with `use_audio_in_video` for Omni), `items`
    each media item's (kind, processor output alone) in token order, `audio_in_video` its Omni flag."""

    name: str
    reference: dict
    items: list = field(default_factory=list)
    audio_in_video: bool = False

    @property
    def input_ids(self) -> torch.Tensor:
        return self.reference["input_ids"][0]


# ---------------------------------------------------------------------------------------------- processors
# data/processors.py's name of each family's processor (Qwen2-VL's is Qwen2.5-VL's without the seconds per grid,
# which Qwen2-VL's positions do not use: `ONLY_IN` drops them)
RELEASE = {"qwen2_vl": "qwen2_5_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
           "qwen2_audio": "qwen2_audio", "qwen2_5_omni_thinker": "qwen2_5_omni"}
ONLY_IN = {"second_per_grid_ts": "qwen2_5_vl"}


def processor(family: str, directory: Path):
    """The family's processor: data/processors.py's directory of the released checkpoint's (the shared Qwen
    tokenizer files, the released tokens, template and preprocessing values), written under `directory`."""
    from transformers import AutoProcessor

    from data.processors import write_processor

    return AutoProcessor.from_pretrained(write_processor(RELEASE[family], Path(directory) / RELEASE[family]))


# ---------------------------------------------------------------------------------------------- decoding
def load_video(path: Path):
    """(frames, metadata) as transformers decodes a file with PyAV (`load_video(path, backend="pyav")`, every
    frame). A container whose header gives no frame count (the VP9 webm) makes that function sample nothing: its
    frames are then counted by decoding them, as the same function would given the count."""
    import av
    import numpy as np
    from transformers.video_utils import VideoMetadata, load_video as load

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.frames:
            return load(str(path), backend="pyav")
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
        fps = float(stream.average_rate)
        return frames, VideoMetadata(total_num_frames=len(frames), fps=fps, duration=len(frames) / fps,
                                     video_backend="pyav", height=stream.height, width=stream.width,
                                     frames_indices=np.arange(len(frames)))


def load_audio(path: Path, rate: int = 16000):
    """The first audio stream of `path` as float32 mono samples at `rate`: its channels averaged (transformers'
    loaders' mono), then resampled by FFmpeg's swresample (PyAV; transformers' soxr is not installed here), padded or
    cut to ceil(n * rate / its rate) samples."""
    import math

    import av
    import numpy as np

    chunks = []
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        source = int(stream.rate)
        for frame in container.decode(stream):
            chunk = frame.to_ndarray()
            if frame.format.is_packed:  # interleaved: [1, samples * channels]
                chunk = chunk.reshape(-1, len(frame.layout.channels)).T
            scale = {"s16": 32768.0, "s16p": 32768.0, "s32": 2147483648.0, "s32p": 2147483648.0}.get(
                frame.format.name, 1.0)
            chunks.append(chunk.astype(np.float32) / scale)
    mono = np.concatenate(chunks, axis=1).mean(axis=0, dtype=np.float32)
    if source == rate:
        return mono
    frame = av.AudioFrame.from_ndarray(mono[None, :], format="flt", layout="mono")
    frame.sample_rate = source
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    out = np.concatenate([f.to_ndarray()[0] for f in resampler.resample(frame) + resampler.resample(None)])
    n = math.ceil(len(mono) * rate / source)
    return np.ascontiguousarray(np.pad(out, (0, max(0, n - len(out))))[:n], dtype=np.float32)


# ---------------------------------------------------------------------------------------------- conversations
def records(family: str) -> list[dict]:
    """The fixture records the family takes: a text conversation, the image demo's first two (families with images),
    and every audio / video record whose media it takes (Omni: also the clip with its sound inside)."""
    av_root = fixture_path("multimodal")
    out = [{**TEXT_RECORD, "name": "text"}]
    kinds = KINDS[family]
    if "image" in kinds:
        for k, record in enumerate(json.loads((av_root / "mllm_demo.json").read_text())[:2]):
            out.append({**record, "name": f"image{k}", "root": av_root})
    for k, record in enumerate(json.loads((av_root / "mllm_av_demo.json").read_text())):
        videos, audios = record.get("videos", []), record.get("audios", [])
        inside = bool(set(videos) & set(audios))
        if (videos and "video" not in kinds) or (audios and "audio" not in kinds) or (
                inside and family != "qwen2_5_omni_thinker"):
            continue
        out.append({**record, "name": f"av{k}", "root": av_root})
    return out


def conversations(family: str, directory: Path) -> list[Conversation]:
    proc = processor(family, directory)
    return [conversation(family, proc, record) for record in records(family)]


def conversation(family: str, proc, record: dict) -> Conversation:
    """`record` (LLaMA-Factory layout: <image> / <video> / <audio> in the turns, `images` / `videos` / `audios`
    paths) through `proc`, whole and per item."""
    from PIL import Image

    root = record.get("root")
    images = [Image.open(root / p) for p in record.get("images", [])]
    videos = [load_video(root / p) for p in record.get("videos", [])]
    inside = [p for p in record.get("audios", []) if p in record.get("videos", [])]  # a clip's own sound
    audios = [load_audio(root / p) for p in record.get("audios", [])]
    messages, order = _messages(record, inside)
    text = proc.apply_chat_template(messages, tokenize=False)
    kwargs = _media_kwargs(family, videos)
    if inside:  # Omni: the clip's audio slot names its video
        kwargs.update(load_audio_from_video=True,
                      audio_from_video_indices=[record["videos"].index(p) if p in inside else None
                                                for p in record["audios"]])
    reference = proc(text=[text], images=images or None, videos=[v for v, _ in videos] or None,
                     audio=audios or None, return_tensors="pt", **kwargs)
    reference = {k: v for k, v in reference.items() if ONLY_IN.get(k, family) == family}
    if family == "qwen2_5_omni_thinker":
        reference["use_audio_in_video"] = bool(inside)
    items = []
    for kind, index in order:  # each item alone: one turn holding only it
        alone_text = proc.apply_chat_template([{"role": "user", "content": [{"type": kind, kind: "item"}]}],
                                              tokenize=False)
        media = ({"images": [images[index]]} if kind == "image" else {"videos": [videos[index][0]]}
                 if kind == "video" else {"audio": [audios[index]]})
        alone = proc(text=[alone_text], return_tensors="pt", **media,
                     **_media_kwargs(family, videos[index:index + 1] if kind == "video" else []))
        items.append((kind, {k: v for k, v in alone.items()
                             if k in MEDIA_KEYS[kind] and ONLY_IN.get(k, family) == family}))
    return Conversation(record["name"], reference, items, bool(inside))


MEDIA_KEYS = {"image": ("pixel_values", "image_grid_thw"),
              "video": ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "video_second_per_grid"),
              "audio": ("input_features", "feature_attention_mask")}


def _messages(record: dict, inside: list) -> tuple[list, list]:
    """(the record's messages as content parts, the items in token order as (kind, index in its list)); a clip's
    own sound (`inside`) rides in its video's placeholder, right after the video's first frames."""
    counters = {"image": 0, "video": 0, "audio": 0}
    messages, order = [], []
    for message in record["messages"]:
        parts = []
        for part in re.split(r"(<image>|<video>|<audio>)", message["content"]):
            if part not in ("<image>", "<video>", "<audio>"):
                if part:
                    parts.append({"type": "text", "text": part})
                continue
            kind = part[1:-1]
            index = counters[kind]
            counters[kind] += 1
            path = record[f"{kind}s"][index]
            if kind == "audio" and path in inside:
                continue
            parts.append({"type": kind, kind: path})
            order.append((kind, index))
            if kind == "video" and path in inside:
                order.append(("audio", record["audios"].index(path)))
        messages.append({"role": message["role"], "content": parts})
    return messages, order


def _media_kwargs(family: str, videos: list) -> dict:
    kwargs = {"images_kwargs": {"size": IMAGE_SIZE}}
    if videos:
        kwargs["videos_kwargs"] = {**VIDEO_KWARGS[family], "video_metadata": [meta for _, meta in videos]}
    return kwargs


# ---------------------------------------------------------------------------------------------- models
def tiny_config(family: str):
    """A tiny `family` composite config: 2 text layers, towers of 1-2 blocks with the processors' patch, merge and
    mel sizes, the released token ids, a short rope wavelength (each M-RoPE component moves the attention)."""
    from tests.model_zoo import tiny_composite_config

    rope = {"rope_type": "default", "rope_theta": 20.0}
    if family != "qwen2_audio":
        rope["mrope_section"] = [2, 3, 3]
    if family.startswith("qwen3_vl"):
        rope["mrope_interleaved"] = True
    config = tiny_composite_config(family, vocab_size=VOCAB, rope_parameters=rope)
    if hasattr(config, "vision_config"):
        vision = config.vision_config
        vision.depth = 2
        if family.startswith("qwen3_vl"):
            vision.deepstack_visual_indexes = [0, 1]
        if family == "qwen2_vl":  # its tower's width is `embed_dim`; `hidden_size` is the merger's output
            vision.hidden_size = config.text_config.hidden_size
        if hasattr(vision, "fullatt_block_indexes"):
            vision.fullatt_block_indexes = [1]
            vision.window_size = 56  # 2 x 2 merged patches per window: several windows per frame
        if hasattr(vision, "tokens_per_second"):
            vision.tokens_per_second = 2  # the released Qwen2.5-VL value
    if family == "qwen2_5_omni_thinker":
        config.audio_config.n_window = 25  # 50-frame chunks: the fixture audios span several
        # the released thinker config.json's (its class sets no default)
        config.vision_start_token_id, config.vision_end_token_id = 151652, 151653
    return config


def tiny_model(family: str, freeze_towers: bool = False, kinds=None):
    """`PackedCausalLM` over a tiny random-init `family` composite (seed 0) with its media path, the packsft attention
    on its text decoder, query and key projections scaled up (sharper attention)."""
    from transformers import AutoModelForMultimodalLM

    from train.attention.function import ATTN_IMPLEMENTATION
    from train.families import FAMILIES
    from train.model.composite import attn_implementation, freeze_towers as freeze
    from train.model.packed import PackedCausalLM

    config = tiny_config(family)
    torch.manual_seed(0)
    lm = AutoModelForMultimodalLM.from_config(config, attn_implementation=attn_implementation(
        config, ATTN_IMPLEMENTATION), dtype=torch.float32)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".language_model." in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    if freeze_towers:
        freeze(lm, vision_tower=True, projector=True, audio_tower=True)
    return PackedCausalLM(lm, 64, 1, media=FAMILIES[family].media, media_kinds=kinds or KINDS[family])


def media_tokens(model) -> list[int]:
    return list(model.media.token_ids.values())


def targets_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Every next token but the media tokens (no label, as the data pipeline masks them); -100 after the last."""
    targets = torch.cat([ids[1:], torch.tensor([-100])])
    for token in media_tokens(model):
        targets = targets.masked_fill(targets == token, -100)
    return targets


def n_targets(model, convs: list[Conversation]) -> int:
    return sum(int((targets_of(model, c.input_ids) != -100).sum()) for c in convs)


def micro_batch(model, convs: list[Conversation], total: int):
    """The packed micro-batch of `convs` (one row) as train/steps/batch.py's make_batch lays it out, token weights
    1 / `total`, with its MediaBatch (every conversation's items in order, one audio_in_video flag per sequence)."""
    from train.model.media_batch import MediaBatch
    from train.steps.batch import MicroBatch

    ids = torch.cat([c.input_ids for c in convs])
    lengths = [c.input_ids.numel() for c in convs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    targets = torch.cat([targets_of(model, c.input_ids) for c in convs])
    return MicroBatch(
        input_ids=ids[None], position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        seq_ids=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), cu_seqlens=cu,
        max_seqlen=max(lengths), targets=targets, n_loss_tokens=int((targets != -100).sum()),
        n_trained_turns=len(lengths), n_samples=len(lengths),
        weights=(targets != -100).float() / total, target_categories=torch.zeros_like(targets),
        media=MediaBatch([item for c in convs for item in c.items], [c.audio_in_video for c in convs]))


def reference(model, convs: list[Conversation], total: int) -> tuple[float, dict, list]:
    """transformers' composite forward on each conversation alone with every key of its processor output (its own
    eager attention, towers and positions; `rope_deltas` reset before each), the same token weights: (loss,
    gradients, each conversation's logits); gradients cleared."""
    import torch.nn.functional as F

    lm = model.lm
    lm.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    logits = []
    with model.unpacked():
        for c in convs:
            model.media.reset_positions(lm)
            out = lm(**c.reference, use_cache=False).logits[0]
            logits.append(out.detach())
            loss = loss + F.cross_entropy(out.float(), targets_of(model, c.input_ids), reduction="sum") / total
    loss.backward()
    return float(loss.detach()), take_grads(lm), logits


def take_grads(lm) -> dict:
    grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    return grads


def grad_error(got: dict, want: dict) -> float:
    """The worst per-parameter relative difference (floor: 1e-3 of the largest gradient, as
    train/model/self_check.py)."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    scale = max(float(g.abs().max()) for g in want.values())
    return max(float((got[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale) for n, g in want.items())


def packed_step(model, batches: list[dict], attention=None) -> tuple[float, dict]:
    """PackedCausalLM over `batches` (accumulated): (summed loss, gradients); `attention(batch)` -> (this rank's
    batch, AttentionContext), default the whole row with the sdpa kernel."""
    from train.attention.function import BACKENDS, AttentionContext, LayerKernels

    def whole_row(batch):
        return batch, AttentionContext.for_micro_batch(batch.cu_seqlens, "cpu", LayerKernels(every=BACKENDS["sdpa"]))

    attention = attention or whole_row
    model.lm.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        row = model.row_media(batch)  # on the whole row, before any sharding
        local, attn = attention(batch)
        loss = model(local.input_ids, local.position_ids, local.targets, local.weights,
                     local.target_categories, attn, media=row)[0]
        loss.backward()
        total += float(loss.detach())
    return total, take_grads(model.lm)


def packed_logits(model, batch: dict) -> torch.Tensor:
    """The packed row's logits [T, V] (the decoder on the packed path, then the head): to compare per sequence."""
    from train.attention.function import BACKENDS, AttentionContext, LayerKernels
    from train.model.lm_head import decoder_of

    row = model.row_media(batch)
    attn = AttentionContext.for_micro_batch(batch.cu_seqlens, "cpu", LayerKernels(every=BACKENDS["sdpa"]))
    with torch.no_grad():
        inputs = {"position_ids": batch.position_ids,
                  **model.media.decoder_inputs(model.lm, batch.input_ids, row, None)}
        hidden = decoder_of(model.lm)(**inputs, use_cache=False, packsft=attn).last_hidden_state[0]
        return model.lm.get_output_embeddings()(hidden)
