"""Where a clip's features are made under sequence parallelism, and what it costs: the vision tower's work per rank
for a long row of video conversations split over sp ranks (contiguous layout), under two rules:

- whole clips: each rank runs the tower on every clip its tokens touch (the image rule: a clip that straddles a rank
  boundary, or spans several ranks, is encoded whole on each of them);
- temporal patches (train/model/media.py): each rank runs the tower on the temporal patches of the clips its tokens
  touch (the tower attends within a frame group, so those features are the tower on those rows alone).

Counts (patch rows encoded per rank: the worst rank, the sum over ranks against the row's own) are exact for the row.
Time: the tower's forward + backward on the worst rank's share, one thread, fp32, on a scaled Qwen2.5-VL tower
(`--width`, `--depth`; the released one is 1280 wide, 32 deep) through the composite's own `get_video_features`,
best of `--repeats`. Nothing crosses ranks under either rule (no communication to count).

    python -m benchmarks.bench_media_sp [--clips 8] [--seconds 60] [--side 224] [--sp 2 4 8] [--time-from SP]
        [--out FILE]

A row: `--clips` clips of `--seconds` s on average (seeded lengths from a quarter to seven quarters of it), sampled
at 2 frames/s (Qwen2.5-VL's default; two frames per temporal patch), frames of `--side` x `--side` pixels (14-pixel
patches, 2 x 2 merged: (side / 28)^2 tokens per temporal patch), each clip inside a conversation of 40 text tokens.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build(width: int, depth: int):
    import torch
    from transformers import AutoModelForMultimodalLM

    from tests.model_zoo import tiny_composite_config
    from train.families import FAMILIES
    from train.model.packed import PackedCausalLM

    config = tiny_composite_config("qwen2_5_vl", vocab_size=151936,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                    "mrope_section": [2, 3, 3]})
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size, vision.depth = width, 2 * width, depth
    vision.num_heads = max(1, width // 64)
    vision.fullatt_block_indexes = [depth - 1]
    torch.manual_seed(0)
    lm = AutoModelForMultimodalLM.from_config(config, dtype=torch.float32)
    return PackedCausalLM(lm, 4096, 1, media=FAMILIES["qwen2_5_vl"].media, media_kinds=("video",))


def row_of_clips(model, clips: int, seconds: int, side: int):
    """The row's ids, cu_seqlens and MediaBatch: clips of seeded lengths, `seconds` on average (a quarter to
    seven quarters of it), so rank boundaries fall inside clips as in real rows."""
    import numpy as np
    import torch

    from train.model.media_batch import MediaBatch

    rng = np.random.default_rng(0)
    video = model.media.token_ids["video"]
    ids, items, bounds = [], [], [0]
    for _ in range(clips):
        grid = (int(rng.integers(seconds // 4, seconds * 7 // 4 + 1)), side // 14, side // 14)  # 1 temporal patch / s
        ids += [1] * 20 + [video] * (grid[0] * grid[1] * grid[2] // 4) + [1] * 20
        bounds.append(len(ids))
        items.append(("video", {"pixel_values_videos": torch.randn(grid[0] * grid[1] * grid[2], model.media.patch_dim),
                                "video_grid_thw": torch.tensor([grid]), "second_per_grid_ts": torch.tensor([1.0])}))
    return torch.tensor(ids)[None], torch.tensor(bounds, dtype=torch.int32), MediaBatch(items, [False] * clips)


def shares(model, row, length: int, sp: int):
    """Each rank's (temporal-patch parts, whole-clip parts) of the contiguous layout."""
    import torch

    from train.model.media import _runs_of_units

    out = []
    size = -(-length // sp)
    offsets = torch.tensor(row.offsets)
    per_unit = torch.tensor([u.tokens for u in row.units])
    for rank in range(sp):
        local = row.feature_index[rank * size:(rank + 1) * size]
        wanted = local[local >= 0]
        item_of = torch.bucketize(wanted, offsets[1:], right=True)
        parts = _runs_of_units(item_of, (wanted - offsets[item_of]) // per_unit[item_of])
        whole = [(item, 0, row.units[item].count) for item in sorted({p[0] for p in parts})]
        out.append((parts, whole))
    return out


def rows_of(row, parts) -> int:
    return sum(count * row.units[item].rows for item, _, count in parts)


def tower_seconds(model, row, parts, repeats: int) -> float:
    import torch

    best = float("inf")
    for _ in range(repeats):
        model.lm.zero_grad(set_to_none=True)
        start = time.process_time()
        features, _, _, _ = model.media._features(model.lm, row, parts, torch.device("cpu"))
        features.sum().backward()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-from", type=int, default=1, metavar="SP",
                        help="time the tower only from this sp degree up (a whole long row's tower activations are "
                             "GBs on one CPU process)")
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    model = build(args.width, args.depth)
    ids, cu, media = row_of_clips(model, args.clips, args.seconds, args.side)
    row = model.row_media({"input_ids": ids, "cu_seqlens": cu, "media": media})
    total_rows = sum(u.count * u.rows for u in row.units)
    whole_row = [(k, 0, u.count) for k, u in enumerate(row.units)]
    lines = [f"# Video features under sequence parallelism ({time.strftime('%Y-%m-%d')}, {platform.machine()}, "
             f"torch {torch.__version__}, one thread)", "",
             f"Row: {ids.shape[1]:,} tokens, {args.clips} clips of {args.seconds} s at 2 frames/s, "
             f"{args.side}x{args.side} frames ({sum(u.count for u in row.units)} temporal patches of "
             f"{row.units[0].tokens} tokens), {total_rows:,} patch rows; tower {args.width} wide, {args.depth} blocks; time: forward + "
             f"backward of the worst rank's share, CPU seconds, best of {args.repeats}.", "",
             f"`python -m benchmarks.bench_media_sp {' '.join(sys.argv[1:])}`".rstrip() + "", "",
             "| sp | rule | patch rows, worst rank | patch rows, all ranks / row's | tower s, worst rank |",
             "|---|---|---|---|---|"]
    def timed(sp, parts):
        return f"{tower_seconds(model, row, parts, args.repeats):.2f}" if sp >= args.time_from else "–"

    lines.append(f"| 1 | – | {total_rows:,} | 1.00 | {timed(1, whole_row)} |")
    for sp in args.sp:
        per_rank = shares(model, row, ids.shape[1], sp)
        for rule, index in (("temporal patches", 0), ("whole clips", 1)):
            counts = [rows_of(row, share[index]) for share in per_rank]
            worst = max(range(sp), key=counts.__getitem__)
            lines.append(f"| {sp} | {rule} | {counts[worst]:,} | {sum(counts) / total_rows:.2f} | "
                         f"{timed(sp, per_rank[worst][index])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
