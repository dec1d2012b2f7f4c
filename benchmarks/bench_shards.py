"""PackedDataset at scale: write a >= 2 GB synthetic packed dataset, then (in fresh processes) open it and read
1,000 random rows, cold (page cache evicted with posix_fadvise) and warm, reporting time and memory.

    python benchmarks/bench_shards.py [--gb 2.2] [--dir /tmp/packsft_bench_shards] [--keep]

Memory: VmHWM is the peak resident set, which counts the memory-mapped file pages a process touched;
RssAnon (private memory) is what grows with the process's own allocations. The dataset is deleted at the end
unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.shards.dataset import PackedDataset, ShardWriter, token_dtype  # noqa: E402

ROW = 131072


def proc_status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key + "_MiB"] = round(int(value.split()[0]) / 1024, 1)
    return out


def write(path: Path, gb: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    fields = ["input_ids", "labels", "category_ids", "turn_ids"]
    dtype = token_dtype(fields)
    pool = np.zeros(1 << 22, dtype=dtype)
    pool["input_ids"] = rng.integers(0, 151_000, pool.shape[0])
    pool["labels"] = np.where(rng.random(pool.shape[0]) < 0.6, pool["input_ids"], -100)
    pool["category_ids"] = rng.integers(0, 8, pool.shape[0])
    pool["turn_ids"] = np.where(pool["labels"] != -100, 1, 0)
    n_rows = int(gb * (1 << 30) / (ROW * dtype.itemsize)) + 1
    t = time.perf_counter()
    w = ShardWriter(path, token_fields=fields, max_shard_bytes=512 << 20, kind="packed")
    seq_no = 0
    for _ in range(n_rows):
        fill = ROW - int(rng.integers(0, 64))
        cuts = np.sort(rng.integers(1, fill, int(rng.integers(5, 80))))
        lens = np.diff(np.concatenate([[0], np.unique(cuts), [fill]]))
        seqs = []
        for n in lens.tolist():
            start = int(rng.integers(0, pool.shape[0] - n))
            seqs.append(pool[start : start + n])
        w.add_row(seqs, record_indices=list(range(seq_no, seq_no + len(seqs))), uids=[[u] for u in range(seq_no, seq_no + len(seqs))])
        seq_no += len(seqs)
    meta = w.close({"max_length": ROW, "categories": {i: f"c{i}" for i in range(8)}})
    seconds = time.perf_counter() - t
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"rows": meta["counts"]["rows"], "sequences": meta["counts"]["sequences"],
            "tokens": meta["counts"]["tokens"], "shards": meta["counts"]["shards"], "bytes": size,
            "write_s": round(seconds, 2), "write_MBps": round(size / seconds / 1e6, 1)}


def evict(path: Path) -> None:
    """Drop the dataset's pages from the page cache (no root needed for clean pages)."""
    os.sync()
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read(path: Path, n: int, seed: int, verify: bool, release_pages: bool) -> dict:
    """Runs in a fresh process: open, then n random rows (every field copied out, as the trainer does)."""
    before = proc_status()
    t = time.perf_counter()
    ds = PackedDataset(path, verify=verify, release_pages=release_pages)
    open_s = time.perf_counter() - t
    after_open = proc_status()
    idx = np.random.default_rng(seed).integers(0, len(ds), n)
    t = time.perf_counter()
    nbytes = 0
    checksum = 0
    for i in idx.tolist():
        row = ds[i]
        nbytes += sum(v.nbytes for v in row.values())
        checksum += int(row["input_ids"][-1]) + int(ds.row_n_loss_tokens[i])
    read_s = time.perf_counter() - t
    return {"verify": verify, "release_pages": release_pages, "open_s": round(open_s, 4), "read_s": round(read_s, 3), "rows_read": n,
            "ms_per_row": round(1000 * read_s / n, 3), "GBps": round(nbytes / read_s / 1e9, 3),
            "status_before_open": before, "status_after_open": after_open, "status_end": proc_status()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2)
    ap.add_argument("--dir", default="/tmp/packsft_bench_shards")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--read-only", help=argparse.SUPPRESS)  # child process mode: "verify,release,seed"
    args = ap.parse_args()
    path = Path(args.dir)
    if args.read_only:
        verify, release, seed = args.read_only.split(",")
        print(json.dumps(read(path, args.rows, int(seed), verify == "1", release == "1")))
        return
    try:
        print("write:", json.dumps(write(path, args.gb, args.seed)), flush=True)
        for label, verify, release, cold in (
            ("cold open + reads", 0, 1, True),
            ("warm open + reads", 0, 1, False),
            ("warm open + reads, release_pages=False", 0, 0, False),
            ("cold open with verify=True + reads", 1, 1, True),
        ):
            if cold:
                evict(path)
            out = subprocess.run([sys.executable, __file__, "--dir", str(path), "--rows", str(args.rows),
                                  "--read-only", f"{verify},{release},{args.seed + 1}"], check=True,
                                 capture_output=True, text=True).stdout
            print(f"{label}:", out.strip(), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
