"""The two-process worker of tests/train/test_media.py (gloo, CPU, fp32): a row of video conversations over sp = 2
under Ulysses, the torch ring (contiguous layout) and the zigzag layout, against the single-process packed step
(which the one-process tests hold equal to the composite's own forward). The conversations (processor outputs) are
read from `<family>.pt` beside `out_path`; rank 0 writes the worst relative errors and what the towers encoded."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tests import _media_inputs as mi
from tests._sp_worker import sp_plan, write_results

CASES = ("qwen2_5_vl", "qwen2_5_omni_thinker")
LAYOUTS = ("ulysses", "torch", "zigzag")


def save_conversations(conversations: list, path) -> None:
    torch.save([(c.name, c.reference, c.items, c.audio_in_video) for c in conversations], str(path))


def load_conversations(path) -> list:
    from train.checkpoint import safe_load  # tensors and plain containers only

    return [mi.Conversation(*fields) for fields in safe_load(path)]


def video_row(model, conversations: list) -> list:
    """The text and video conversations (with their sound, Omni) ordered so that a clip straddles the sp = 2
    boundary with temporal patches on both sides: the first rotation that does."""
    chosen = [c for c in conversations if not c.items or any(kind == "video" for kind, _ in c.items)]
    video = model.media.token_ids["video"]
    for shift in range(len(chosen)):
        row = chosen[shift:] + chosen[:shift]
        ids = torch.cat([c.input_ids for c in row])
        half = -(-ids.numel() // 2)
        if bool(ids[half - 2] == video) and bool(ids[half + 2] == video):
            return row
    raise AssertionError("no order of the conversations puts a clip across the sp = 2 boundary")


def counted(model) -> dict:
    """Count the patch rows the vision tower encodes (wrapping the composite's feature functions)."""
    body = model.lm.model
    count = {"rows": 0}
    for name in ("get_image_features", "get_video_features"):
        original = getattr(body, name)

        def wrapper(pixels, grid, *args, _original=original, **kwargs):
            count["rows"] += int(pixels.shape[0])
            return _original(pixels, grid, *args, **kwargs)
        setattr(body, name, wrapper)
    return count


def worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        from train.attention.function import AttentionContext
        from train.attention.sequence_parallel import shard_batch

        world = dist.group.WORLD
        results = {}
        for family in CASES:
            conversations = load_conversations(os.path.join(os.path.dirname(out_path), f"{family}.pt"))
            model = mi.tiny_model(family)
            row = video_row(model, conversations)
            total = mi.n_targets(model, row)
            batch = mi.micro_batch(model, row, total)
            want_loss, want = mi.packed_step(model, [batch])
            count = counted(model)
            row_patches = sum(int(inputs[key].shape[0]) for kind, inputs in batch.media.items
                              for key in ("pixel_values", "pixel_values_videos") if key in inputs)
            for layout in LAYOUTS:
                if layout == "ulysses":
                    plan = sp_plan(model.lm, rank, 2, world, sp_backend="ulysses", ulysses_size=2, ulysses_group=world)
                else:
                    plan = sp_plan(model.lm, rank, 2, world)
                split = []

                def sharded(full, plan=plan, layout=layout, split=split):
                    if layout == "zigzag":  # the torch backend's CPU reference of the zigzag layout
                        fields, ctx = shard_batch(full, rank, 2, "torch", group=world, layout="zigzag")
                        local = full.local(fields)
                        attn = AttentionContext(ctx.cu_seqlens, ctx.max_seqlen, plan.train, sp=ctx)
                    else:
                        local, attn = plan.context(full)
                    split.append(_split_clip(model, full, attn.sp))
                    return local, attn

                count["rows"] = 0
                loss, got = mi.packed_step(model, [batch], attention=sharded)
                encoded = torch.tensor(count["rows"])
                dist.all_reduce(encoded)
                for g in got.values():
                    dist.all_reduce(g)
                loss = torch.tensor(loss)
                dist.all_reduce(loss)
                results[f"{family}/{layout}"] = {
                    "loss": abs(float(loss) - want_loss) / want_loss, "grad": mi.grad_error(got, want),
                    "split_clip": split[0], "encoded_patches": int(encoded) - 2 * _blank_rows(model, batch),
                    "row_patches": row_patches}
        write_results(results, out_path, rank)
    finally:
        dist.destroy_process_group()


def _split_clip(model, batch, sp) -> bool:
    """Some clip's temporal patches lie partly on this rank and partly elsewhere (its tokens straddle ranks)."""
    row = model.row_media(batch)
    local, _ = row.local(sp)
    mine = set(local[local >= 0].tolist())
    for k, (kind, _) in enumerate(row.media.items):
        features = set(range(row.offsets[k], row.offsets[k + 1]))
        if kind == "video" and features & mine and features - mine:
            return True
    return False


def _blank_rows(model, batch) -> int:
    """Patch rows of the blank image each rank encodes (the run's kinds include images; these rows hold none)."""
    return model.media.merge ** 2 if "image" in model.media.kinds and not any(
        kind == "image" for kind, _ in batch.media.items) else 0
