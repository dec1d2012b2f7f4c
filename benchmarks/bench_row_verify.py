"""Cost of per-row checksum verification: `PackedDataset(verify="rows")` vs `verify="off"` on 128K-token rows.

    python benchmarks/bench_row_verify.py [--rows 48] [--row-tokens 131072] [--repeats 5] [--dir /tmp/...]

Writes a synthetic packed dataset (4 token fields, 12 bytes per token), then reads every row `repeats` times
with each mode, interleaved, page cache warm (the steady state of an epoch), and reports the best CPU time per
row of `ds[i]` (copy out of the mapping + page release) and of the crc32 itself. The dataset is deleted at the end.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.shards.dataset import PackedDataset, ShardWriter  # noqa: E402


def write(path: Path, rows: int, row_tokens: int) -> None:
    rng = np.random.default_rng(0)
    with ShardWriter(path, kind="packed") as writer:
        for _ in range(rows):
            ids = rng.integers(0, 150_000, row_tokens, dtype=np.int32)
            writer.add_row([{"input_ids": ids, "labels": ids, "category_ids": np.ones(row_tokens, np.int16),
                             "turn_ids": np.ones(row_tokens, np.int16)}])
        writer.close({})


def per_row_seconds(ds: PackedDataset) -> float:
    start = time.process_time()
    for i in range(len(ds)):
        ds[i]
    return (time.process_time() - start) / len(ds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--row-tokens", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/packsft_bench_row_verify")
    args = ap.parse_args()
    path = Path(args.dir)
    shutil.rmtree(path, ignore_errors=True)
    try:
        write(path, args.rows, args.row_tokens)
        modes = {mode: PackedDataset(path, verify=mode) for mode in ("off", "rows")}
        best = {mode: float("inf") for mode in modes}
        for _ in range(args.repeats):
            for mode, ds in modes.items():
                best[mode] = min(best[mode], per_row_seconds(ds))
        view = modes["off"].row_tokens(0)
        start = time.process_time()
        for _ in range(20):
            zlib.crc32(view.view(np.uint8))
        crc = (time.process_time() - start) / 20
        row_mb = view.nbytes / 1e6
        print(f"{args.rows} rows x {args.row_tokens:,} tokens ({row_mb:.2f} MB per row), best of {args.repeats}, "
              "CPU time per row:")
        print(f"  ds[i], verify=off : {best['off'] * 1e6:9.0f} us")
        print(f"  ds[i], verify=rows: {best['rows'] * 1e6:9.0f} us  (+{(best['rows'] / best['off'] - 1):.0%})")
        print(f"  zlib.crc32 alone  : {crc * 1e6:9.0f} us  ({row_mb / crc / 1e3:.2f} GB/s)")
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
