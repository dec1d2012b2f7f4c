"""Packing quality and speed: data.shards.rows.plan (exact fill, best fit / first fit decreasing), the pack stage's rule
(partitions of 2^20 sequences planned on their own, then a global pass over the rows they release:
`plan_by_partitions`) and the OpenSFT greedy packer.

    python benchmarks/bench_pack.py [--n 1000000] [--opensft-n N] [--seed 0]
    python benchmarks/bench_pack.py --tokenized DIR [--max-lengths 4096,8192,16384,131072]   # a dataset's lengths
    python benchmarks/bench_pack.py --stage-n 100000 [--stage-max-length 16384]   # the whole pack stage

Lengths: lognormal with median 1,500 tokens and ~5% above 16,384, rounded, at least 1 and capped at the row
length (131,072; for the 16,384 run capped at 16,384). Prints a markdown table: rows, rows / lower bound, fill,
seconds. `--tokenized`: the sequence lengths of a tokenized/ directory instead (e.g. the input bench_ray.py
builds), planned by the three algorithms and the stage's rule at each row length. OpenSFT greedy, re-implemented
from its description: for each new row scan all unused records in index order, add each that fits, stop after
2,000 consecutive misses.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.pack import PARTITION_SEQUENCES, plan_by_partitions  # noqa: E402
from data.shards.rows import ALGORITHMS, DEFAULT_ALGORITHM, plan  # noqa: E402

MEDIAN = 1500
P_ABOVE_16K = 0.05


def lognormal_lengths(n: int, cap: int, seed: int) -> np.ndarray:
    sigma = math.log(16384 / MEDIAN) / 1.6448536  # P(X > 16384) = 5%
    raw = np.random.default_rng(seed).lognormal(math.log(MEDIAN), sigma, n)
    return np.clip(np.rint(raw), 1, cap).astype(np.int64)


def opensft_greedy(lengths: np.ndarray, cap: int, max_misses: int = 2000) -> list[list[int]]:
    """Rows filled by scanning the unused records in index order; a row closes after `max_misses`
    consecutive records that do not fit (or when no record is left).

    Vectorised with the same result as the plain double loop (`opensft_greedy_reference`): the unused records
    are `front` (skipped before, in index order) followed by the untouched records `tail..N-1`; each hit is
    the first record within `max_misses` after the previous hit that fits the room left. Where a row stops
    scanning does not change the order of the records left, so they are simply `candidates - hits`.
    """
    n = lengths.shape[0]
    front = np.zeros(0, dtype=np.int64)
    tail = 0
    rows = []
    while front.shape[0] or tail < n:
        cand = front
        cand_len = lengths[front]
        room, pos, hits = cap, 0, []
        while True:
            need = pos + max_misses
            if need > cand.shape[0] and tail < n:
                extra = np.arange(tail, min(n, tail + max(need - cand.shape[0], max_misses)), dtype=np.int64)
                tail = int(extra[-1]) + 1
                cand = np.concatenate([cand, extra])
                cand_len = np.concatenate([cand_len, lengths[extra]])
            fits = np.flatnonzero(cand_len[pos:need] <= room)
            if fits.size == 0:
                break
            p = pos + int(fits[0])
            hits.append(p)
            room -= int(cand_len[p])
            pos = p + 1
            if room == 0:
                break
        rows.append(cand[hits].tolist())
        keep = np.ones(cand.shape[0], dtype=bool)
        keep[hits] = False
        front = cand[keep]
    return rows


def opensft_greedy_reference(lengths, cap: int, max_misses: int = 2000) -> list[list[int]]:
    """The plain double loop (slow); used to check `opensft_greedy` on small inputs."""
    unused = list(range(len(lengths)))
    rows = []
    while unused:
        room, row, rest, misses = cap, [], [], 0
        for k, i in enumerate(unused):
            if misses >= max_misses:
                rest.extend(unused[k:])
                break
            if lengths[i] <= room:
                row.append(i)
                room -= lengths[i]
                misses = 0
            else:
                rest.append(i)
                misses += 1
        rows.append(row)
        unused = rest
    return rows


def timed(fn, *args, **kwargs):
    """(result, wall seconds, CPU seconds of this process): CPU time is the figure that survives a busy machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def summarize(name: str, rows: list[list[int]], lengths: np.ndarray, cap: int, seconds: float, cpu: float,
              n: int) -> dict:
    tokens = int(lengths[:n].sum())
    lower = math.ceil(tokens / cap)
    placed = np.zeros(n, dtype=np.int64)
    for row in rows:
        placed[row] += 1
        assert int(lengths[row].sum()) <= cap, f"{name}: row over capacity"
    assert (placed == 1).all(), f"{name}: not a partition"
    return {"algorithm": name, "n": n, "max_length": cap, "rows": len(rows), "lower_bound": lower,
            "ratio": len(rows) / lower, "fill": tokens / (len(rows) * cap), "seconds": seconds, "cpu_seconds": cpu}


def memory_status() -> str:
    """Peak and current resident set of this process (MiB): VmHWM, RssAnon (private), RssFile (mapped files)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            out[key] = f"{int(value.split()[0]) / 1024:,.0f}"
    return ", ".join(f"{k} {v} MiB" for k, v in out.items())


def bench_stage(n: int, cap: int, seed: int) -> None:
    """data.pack.run end to end on a synthetic tokenized dataset of n sequences (lengths as above)."""
    import shutil
    import tempfile

    from data.config import DataConfig
    from data.pack import run
    from data.shards.dataset import ShardWriter, token_dtype

    lengths = lognormal_lengths(n, cap, seed)
    fields = ["input_ids", "labels", "category_ids", "turn_ids"]
    rng = np.random.default_rng(seed)
    pool = np.zeros(int(lengths.max()) + (1 << 20), dtype=token_dtype(fields))
    pool["input_ids"] = rng.integers(0, 151_000, pool.shape[0])
    pool["labels"] = np.where(rng.random(pool.shape[0]) < 0.6, pool["input_ids"], -100)
    pool["category_ids"] = rng.integers(0, 8, pool.shape[0])
    pool["turn_ids"] = (pool["labels"] != -100).astype(np.int16)
    out = Path(tempfile.mkdtemp(prefix="packsft_bench_stage_"))
    try:
        w = ShardWriter(out / "tokenized", token_fields=fields, kind="tokenized")
        t = time.perf_counter()
        for i, length in enumerate(lengths.tolist()):
            start = int(rng.integers(0, pool.shape[0] - length))
            w.add_row([pool[start : start + length]], record_indices=[i], uids=[[i]])
        w.close({"categories": {i: f"c{i}" for i in range(8)}})
        write_s = time.perf_counter() - t
        cfg = DataConfig(inputs=[], output_dir=str(out), tokenizer_path="-", max_length=cap, seed=seed)
        print(f"memory before the stage: {memory_status()}", flush=True)
        (section, wall, cpu) = timed(run, cfg)
        gb = sum(f.stat().st_size for f in (out / "packed").iterdir()) / 1e9
        print(f"pack stage: {n:,} sequences, {int(lengths.sum()):,} tokens ({gb:.2f} GB packed) -> "
              f"{section['rows']:,} rows at {cap:,}: {wall:.1f} s wall, {cpu:.1f} s CPU "
              f"({n / wall:,.0f} seq/s, {gb / wall:.2f} GB/s); writing the tokenized input took {write_s:.1f} s; "
              f"memory after the stage: {memory_status()}")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--opensft-n", type=int, default=None, help="records for OpenSFT greedy (default: --n)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-opensft", type=int, default=3000, help="records to check against the plain loop")
    ap.add_argument("--reference-n", type=int, default=0,
                    help="also time the plain-loop OpenSFT greedy on this many records")
    ap.add_argument("--stage-n", type=int, default=0, help="run only the whole-stage benchmark on this many records")
    ap.add_argument("--stage-max-length", type=int, default=16384)
    ap.add_argument("--tokenized", help="plan the sequence lengths of this tokenized/ directory instead")
    ap.add_argument("--max-lengths", default="4096,8192,16384,131072", help="row lengths for --tokenized")
    args = ap.parse_args()
    if args.stage_n:
        bench_stage(args.stage_n, args.stage_max_length, args.seed)
        return

    if args.tokenized:
        bench_tokenized(args.tokenized, [int(c) for c in args.max_lengths.split(",")], args.seed)
        return

    small = lognormal_lengths(args.check_opensft, 16384, args.seed + 1)
    assert opensft_greedy(small, 16384) == opensft_greedy_reference(small.tolist(), 16384)

    results = []
    for cap in (131072, 16384):
        lengths = lognormal_lengths(args.n, cap, args.seed)
        print(f"max_length {cap}: {args.n:,} lengths, median {np.median(lengths):.0f}, "
              f"{(lengths > 16384).mean():.2%} above 16384, {int(lengths.sum()):,} tokens", flush=True)
        results += plan_all_ways(lengths, cap, args.seed)
        m = args.opensft_n or args.n
        rows, wall, cpu = timed(opensft_greedy, lengths[:m], cap)
        results.append(summarize("opensft_greedy", rows, lengths, cap, wall, cpu, m))
        print(results[-1], flush=True)
        if args.reference_n:
            sub = lengths[: args.reference_n]
            rows, wall, cpu = timed(opensft_greedy_reference, sub.tolist(), cap)
            results.append(summarize("opensft_greedy (plain loop)", rows, lengths, cap, wall, cpu, len(sub)))
            print(results[-1], flush=True)

    print_table(results)


def plan_all_ways(lengths: np.ndarray, cap: int, seed: int) -> list[dict]:
    """Each algorithm over all lengths at once, then the stage's rule (its default algorithm by partitions)."""
    results = []
    for algorithm in ALGORITHMS:
        rows, wall, cpu = timed(plan, lengths, cap, seed=seed, algorithm=algorithm)
        results.append(summarize(algorithm, rows, lengths, cap, wall, cpu, len(lengths)))
        print(results[-1], flush=True)
    partitions = -(-len(lengths) // PARTITION_SEQUENCES)
    plan_rows, wall, cpu = timed(plan_by_partitions, lengths, cap, seed=seed)
    results.append(summarize(f"{DEFAULT_ALGORITHM} by {partitions} partitions + global pass (pack.run)",
                             plan_rows.tolist(), lengths, cap, wall, cpu, len(lengths)))
    print(results[-1], flush=True)
    return results


def bench_tokenized(path: str, caps: list[int], seed: int) -> None:
    """The algorithms over the sequence lengths of a tokenized/ directory, at each row length in `caps`."""
    from data.shards.dataset import PackedDataset

    src = PackedDataset(path)
    seqs, _ = src.row_range_sequences(0, len(src))
    lengths = np.asarray(seqs["length"], dtype=np.int64)
    print(f"{path}: {len(lengths):,} sequences, {int(lengths.sum()):,} tokens, lengths min {lengths.min()}, "
          f"median {np.median(lengths):.0f}, max {lengths.max()}", flush=True)
    results = []
    for cap in caps:
        if lengths.max() > cap:
            print(f"max_length {cap:,}: skipped, sequences up to {lengths.max():,} tokens", flush=True)
            continue
        results += plan_all_ways(lengths, cap, seed)
    print_table(results)


def print_table(results: list[dict]) -> None:
    print()
    print("| max_length | algorithm | records | rows | lower bound | rows / lower bound | fill | wall s | CPU s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['max_length']:,} | {r['algorithm']} | {r['n']:,} | {r['rows']:,} | {r['lower_bound']:,} | "
              f"{r['ratio']:.5f} | {r['fill']:.4%} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} |")
    print(f"\ncpu: {os.cpu_count()} cores visible; python {sys.version.split()[0]}; numpy {np.__version__}")


if __name__ == "__main__":
    main()
