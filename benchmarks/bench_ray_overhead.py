"""The Ray driver's own CPU per task of `RayExecutor.map` (Ray Data's per-execution, per-task and per-block work),
for the task sizes the stages use: `records` and `ranges` (many tasks a Ray task).
Each task's function only sleeps, so the driver's CPU is all engine overhead.

    python benchmarks/bench_ray_overhead.py --workers 2
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.engine_ray import RayExecutor  # noqa: E402


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
    executor = RayExecutor(args.workers)
    list(executor.map(nap, [0.0] * 8))  # workers started
    print(f"{args.chunks} chunks of {args.seconds * 1000:.0f} ms sleep, {args.workers} workers, ray {ray.__version__}\n")
    print("| size | tasks | Ray tasks | wall s | driver CPU s | driver CPU ms per task | driver CPU % of a core |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for size in ("records", "ranges"):
        cpu, wall, ray_tasks = time.process_time(), time.perf_counter(), executor.tasks
        out = list(executor.map(nap, [args.seconds] * args.chunks, size=size))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert len(out) == args.chunks
        print(f"| {size} | {args.chunks} | {executor.tasks - ray_tasks} | {wall:.1f} | {cpu:.2f} | "
              f"{cpu / args.chunks * 1000:.2f} | {cpu / wall * 100:.0f} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
