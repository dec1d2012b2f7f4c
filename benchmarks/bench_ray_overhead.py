"""The Ray driver's own CPU per chunk of `RayChunkMap` (Ray Data's per-execution, per-task and per-block work),
for the task shapes the engine uses: one chunk a task (pack's shards), two, and `for_ranges` (the maps over
byte ranges and plan slices). Each chunk's function only sleeps, so the driver's CPU is all engine overhead.

    python benchmarks/bench_ray_overhead.py --workers 2
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.engine_ray import RayChunkMap  # noqa: E402


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=0.01, help="each chunk's sleep")
    args = parser.parse_args()

    import ray
    import ray.data

    ray.init(num_cpus=args.workers, include_dashboard=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    maps = {"1 chunk a task": RayChunkMap(args.workers, chunks_per_task=1),
            "2 chunks a task": RayChunkMap(args.workers, chunks_per_task=2),
            "for_ranges": RayChunkMap(args.workers).for_ranges()}
    list(maps["for_ranges"](nap, [0.0] * 8))  # workers started
    print(f"{args.chunks} chunks of {args.seconds * 1000:.0f} ms sleep, {args.workers} workers, ray {ray.__version__}\n")
    print("| map | chunks a task | wall s | driver CPU s | driver CPU ms per chunk | driver CPU % of a core |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, chunk_map in maps.items():
        cpu, wall = time.process_time(), time.perf_counter()
        out = list(chunk_map(nap, [args.seconds] * args.chunks))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert len(out) == args.chunks
        per_task = chunk_map.chunks_per_task or max(1, min(chunk_map.window, args.chunks) //
                                                       (chunk_map.tasks_per_worker * args.workers))
        print(f"| {name} | {per_task} | {wall:.1f} | {cpu:.2f} | {cpu / args.chunks * 1000:.2f} | "
              f"{cpu / wall * 100:.0f} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
