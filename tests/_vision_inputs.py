"""Image conversations for the trainer's vision tests: LLaMA-Factory's demo records (../shared/fixtures/multimodal)
through the real Qwen2.5-VL processor, and a tiny random-init Qwen2.5-VL composite built from a config (the
processor's patch and merge sizes, a small tower and text decoder).

The processor's token ids are mapped into the tiny model's vocabulary (its image token kept apart): the model is random,
what the tests exercise is the processor's image tokens, pixel rows and grids against the model's image path."""
from __future__ import annotations

import json
import re

import torch

from tests.conftest import fixture_path

VOCAB = 256
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START = VOCAB - 1, VOCAB - 2, VOCAB - 3
MAX_PIXELS = 16 * 4 * 14 * 14  # 64 patches, 16 image tokens at most per image: small rows, real grids


def records() -> list[dict]:
    """Each demo record as the processor returns it: input_ids [T] (mapped into VOCAB), pixel_values [patches,
    patch_dim], image_grid_thw [n, 3], mm_token_type_ids [T]."""
    from PIL import Image
    from transformers import AutoProcessor

    root = fixture_path("multimodal")
    processor = AutoProcessor.from_pretrained(root / "qwen2_5_vl_processor")
    out = []
    for record in json.loads((root / "mllm_demo.json").read_text()):
        messages = [{"role": m["role"], "content": [{"type": "image"} if part == "<image>" else
                                                    {"type": "text", "text": part}
                                                    for part in re.split(r"(<image>)", m["content"]) if part]}
                    for m in record["messages"]]
        text = processor.apply_chat_template(messages, tokenize=False)
        images = [Image.open(root / path).convert("RGB") for path in record["images"]]
        enc = processor(text=text, images=images, return_tensors="pt",
                        images_kwargs={"size": {"shortest_edge": 4 * 14 * 14, "longest_edge": MAX_PIXELS}})
        ids = enc["input_ids"][0]
        mapped = torch.where(ids == processor.image_token_id, IMAGE_TOKEN, ids % (VOCAB - 3))
        out.append({"input_ids": mapped, "pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"],
                    "mm_token_type_ids": enc["mm_token_type_ids"][0]})
    return out


def tiny_vl_config(model_type: str = "qwen2_5_vl"):
    """A tiny Qwen2.5-VL (or Qwen2-VL) config: 2 text layers, a 2-block tower (one window, one full attention) with
    the processor's patch (14), temporal patch (2) and merge (2) sizes."""
    from tests.model_zoo import tiny_composite_config

    # a short rope wavelength: each M-RoPE component moves the attention, so wrong positions fail the tests
    rope = {"rope_type": "default", "rope_theta": 20.0, "mrope_section": [2, 3, 3]}
    if model_type.startswith("qwen3_vl"):
        rope["mrope_interleaved"] = True
    config = tiny_composite_config(model_type, vocab_size=VOCAB, rope_parameters=rope)
    vision = config.vision_config
    vision.depth = 2
    if model_type.startswith("qwen3_vl"):  # the Qwen2.5-VL processor's 14-pixel patches; deepstack at both layers
        vision.patch_size, vision.deepstack_visual_indexes = 14, [0, 1]
    if model_type == "qwen2_vl":  # its tower's width is `embed_dim`; `hidden_size` is the merger's output
        vision.hidden_size = config.text_config.hidden_size
    if hasattr(vision, "fullatt_block_indexes"):
        vision.fullatt_block_indexes = [1]
        vision.window_size = 56  # 2 x 2 merged patches per window: several windows per image
    config.image_token_id, config.video_token_id, config.vision_start_token_id = IMAGE_TOKEN, VIDEO_TOKEN, VISION_START
    return config


def tiny_vl_model(model_type: str = "qwen2_5_vl", freeze_tower: bool = False):
    """`PackedCausalLM` over a tiny random-init composite (seed 0) with its image path, the packsft attention on its
    text decoder. The text decoder's query and key projections are scaled up (sharper attention), so positions and
    placement errors move the loss well past the tolerances."""
    from transformers import AutoModelForImageTextToText

    from train.attention.function import ATTN_IMPLEMENTATION
    from train.model.composite import attn_implementation, freeze_towers
    from train.families import FAMILIES
    from train.model.packed import PackedCausalLM

    config = tiny_vl_config(model_type)
    torch.manual_seed(0)
    lm = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation(
        config, ATTN_IMPLEMENTATION), dtype=torch.float32)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".language_model." in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    if freeze_tower:
        freeze_towers(lm, vision_tower=True, projector=True)
    return PackedCausalLM(lm, 16, 1, media=FAMILIES[model_type].media, media_kinds=("image",))


def targets_of(record: dict) -> torch.Tensor:
    """Every next token but the image tokens (no label, as the data pipeline masks them); -100 after the last."""
    ids = record["input_ids"]
    targets = torch.cat([ids[1:], torch.tensor([-100])])
    return targets.masked_fill(targets == IMAGE_TOKEN, -100)


def micro_batch(recs: list[dict], n_targets: int):
    """The packed micro-batch of `recs` (one row) as train/steps/batch.py's make_batch lays it out, token weights 1 /
    `n_targets` (the step's), with its MediaBatch of images."""
    from train.model.media_batch import MediaBatch
    from train.steps.batch import MicroBatch

    ids = torch.cat([r["input_ids"] for r in recs])
    lengths = [r["input_ids"].numel() for r in recs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    targets = torch.cat([targets_of(r) for r in recs])
    return MicroBatch(
        input_ids=ids[None], position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        seq_ids=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), cu_seqlens=cu,
        max_seqlen=max(lengths), targets=targets, n_loss_tokens=int((targets != -100).sum()),
        n_trained_turns=len(lengths), n_samples=len(lengths),
        weights=(targets != -100).float() / n_targets, target_categories=torch.zeros_like(targets),
        media=MediaBatch([("image", {"pixel_values": r["pixel_values"][a:b], "image_grid_thw": grid[None]})
                          for r in recs for grid, a, b in _patch_runs(r["image_grid_thw"])]))


def _patch_runs(grids: torch.Tensor):
    """(grid, first patch row, end) of each image of a record (its processor output's rows, in order)."""
    counts = grids.prod(-1).tolist()
    ends = torch.tensor(counts).cumsum(0).tolist()
    return [(grid, end - count, end) for grid, count, end in zip(grids, counts, ends)]


def n_targets(recs: list[dict]) -> int:
    return sum(int((targets_of(r) != -100).sum()) for r in recs)


def reference(model, recs: list[dict], total: int) -> tuple[float, dict]:
    """transformers' composite forward on each record alone (its own eager attention, pixel_values, image grid and
    mm_token_type_ids: its own M-RoPE positions), the same token weights: (loss, gradients); gradients cleared."""
    import torch.nn.functional as F

    lm = model.lm
    lm.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    with model.unpacked():
        for r in recs:
            logits = lm(input_ids=r["input_ids"][None], pixel_values=r["pixel_values"],
                        image_grid_thw=r["image_grid_thw"], mm_token_type_ids=r["mm_token_type_ids"][None],
                        use_cache=False).logits[0]
            loss = loss + F.cross_entropy(logits.float(), targets_of(r), reduction="sum") / total
    loss.backward()
    return float(loss.detach()), take_grads(lm)


def take_grads(lm) -> dict:
    grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    return grads


def grad_error(got: dict, want: dict) -> float:
    """The worst per-parameter relative difference (floor: 1e-3 of the largest gradient, as train/model/self_check.py)."""
    assert sorted(got) == sorted(want)
    scale = max(float(g.abs().max()) for g in want.values())
    return max(float((got[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale) for n, g in want.items())


def save_records(recs: list[dict], path) -> None:
    from safetensors.torch import save_file

    save_file({f"{i}.{k}": v.contiguous() for i, r in enumerate(recs) for k, v in r.items()}, str(path))


def load_records(path) -> list[dict]:
    from safetensors.torch import load_file

    flat = load_file(str(path))
    recs: dict[int, dict] = {}
    for key, value in flat.items():
        i, name = key.split(".", 1)
        recs.setdefault(int(i), {})[name] = value
    return [recs[i] for i in sorted(recs)]


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
