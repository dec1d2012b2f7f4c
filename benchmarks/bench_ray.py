"""Throughput of each pipeline stage on engine ray vs the number of Ray workers, with engine local beside it.

Input: GSM8K train (../shared/fixtures) repeated `--copies` times as one prompt/response .jsonl plus the
long-CoT messages file once, the example tokenizer, merge probability 0.2 (so merge counts tokens on the
workers), max_length 4096. For every (engine, workers) pair it runs all stages in this process (Ray: a fresh
local instance with num_cpus = workers), timing each stage and sampling every 0.2 s the RSS of the driver and
of each Ray worker process (peak of the largest worker), the driver's CPU seconds (and those of its main thread
alone: the rest are Ray Data's executor threads) and the Ray workers' CPU
seconds per stage. Every run must write the same tokenized/ and packed/ meta.json (checksums included).
Prints a Markdown table and, from the CPU seconds of the largest Ray run, the projection of a 1 TB input to 8
and 64 nodes of `--cores-per-node` cores: per stage max(driver CPU, workers CPU / cores), scaled.

With `--marginal-copies N` engine ray also runs on N copies (twice, first: the first run pays the process's
one-time imports), and a second projection uses the difference of CPU seconds between the two sizes (the per-GiB
cost, without the fixed costs a small input inflates). `--trace-memory` traces the driver's allocations
(tracemalloc, numpy arrays included) and prints each stage's peak, and with `--marginal-copies` the bytes per
added input record; it slows the driver, so the CPU figures of such a run are not comparable, and it samples
resident memory only between stages (the sampling thread's own allocations would count as the driver's).

    python benchmarks/bench_ray.py --copies 6 --workers 1 2 --marginal-copies 2
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.config import from_dict, to_dict  # noqa: E402
from data import merge, pack, preprocess, sample, tokenize  # noqa: E402
from data.config import STAGES, DataConfig  # noqa: E402

FIXTURES = ROOT.parent / "shared" / "fixtures" / "data"
STAGE_RUNS = {"preprocess": preprocess.run, "sample": sample.run, "merge": merge.run, "tokenize": tokenize.run,
              "pack": pack.run}
RAY_TASK_DRIVER_S = 0.030  # Ray Data's driver CPU per task and block, the top of the measured 20-30 ms
# (bench_ray_overhead.py): the projection's per-task term


def write_input(workdir: Path, copies: int) -> list[dict]:
    gsm8k = workdir / "gsm8k_x.jsonl"
    data = (FIXTURES / "gsm8k_train.jsonl").read_bytes()
    gsm8k.write_bytes(data * copies)
    return [{"path": str(gsm8k), "format": "prompt_response", "prompt_key": "question", "response_key": "answer",
             "category_name": "math"},
            {"path": str(FIXTURES / "skyt1_math500_longcot.messages.jsonl"), "format": "messages",
             "category_name": "longcot"}]


RSS_KINDS = ("RssAnon", "RssFile", "RssShmem")  # private memory; mapped files (page cache); shared memory


def rss_kinds() -> dict[str, int]:
    """This process's resident set by kind (bytes), from /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in RSS_KINDS:
            out[key] = int(value.split()[0]) * 1024
    return out


class ProcessSampler(threading.Thread):
    """Every 0.2 s: peak RSS of this process (in all, and of each kind in RSS_KINDS) and of each Ray worker
    process (a descendant whose command line is default_worker.py or, once it ran a task, `ray::<task>`), and
    each worker's CPU seconds so far."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.driver = 0
        self.driver_kinds = dict.fromkeys(RSS_KINDS, 0)
        self.workers: dict[int, int] = {}
        self.worker_cpu: dict[int, float] = {}

    def sample(self):
        me = psutil.Process()
        self.driver = max(self.driver, me.memory_info().rss)
        for kind, nbytes in rss_kinds().items():
            self.driver_kinds[kind] = max(self.driver_kinds[kind], nbytes)
        for proc in me.children(recursive=True):
            try:
                cmdline = " ".join(proc.cmdline())
                if cmdline.startswith("ray::") or "default_worker.py" in cmdline:
                    self.workers[proc.pid] = max(self.workers.get(proc.pid, 0), proc.memory_info().rss)
                    cpu = proc.cpu_times()
                    self.worker_cpu[proc.pid] = cpu.user + cpu.system
            except psutil.Error:
                pass

    def run(self):
        while not self.stop.wait(0.2):
            self.sample()


def _import_stages(_: int) -> None:
    import data.merge
    import data.tokenize  # noqa: F401  (transformers, tokenizers)


main_cpu: dict[str, float] = {}  # the last run's driver CPU seconds per stage in its main thread alone
# --trace-memory: the last run's peak bytes allocated by the driver's Python code (numpy arrays included) per stage,
# above what was allocated when the stage began
driver_alloc: dict[str, int] = {}


ray_maps: dict[str, list] = {}  # the last Ray run's maps per stage: (size class, chunks)


def run_once(cfg: DataConfig, engine: str, workers: int) -> tuple[dict, dict, dict, ProcessSampler]:
    """Wall seconds, driver CPU seconds and Ray workers' CPU seconds per stage, and the process sampler."""
    cfg.engine, cfg.num_workers = engine, workers
    if cfg.out.exists():
        shutil.rmtree(cfg.out)
    sampler = ProcessSampler()
    if not tracemalloc.is_tracing():  # its own allocations (psutil's) would count as the driver's
        sampler.start()
    wall, driver_cpu, worker_cpu = {}, {}, {}
    main_cpu.clear()
    driver_alloc.clear()
    ray_maps.clear()

    def timed(stage, fn):
        sampler.sample()
        start, cpu, wcpu = time.perf_counter(), time.process_time(), sum(sampler.worker_cpu.values())
        main = time.thread_time()
        if tracemalloc.is_tracing():
            tracemalloc.reset_peak()
            allocated = tracemalloc.get_traced_memory()[0]
        fn(cfg)
        if tracemalloc.is_tracing():
            driver_alloc[stage] = tracemalloc.get_traced_memory()[1] - allocated
        sampler.sample()
        wall[stage] = time.perf_counter() - start
        driver_cpu[stage] = time.process_time() - cpu
        main_cpu[stage] = time.thread_time() - main
        worker_cpu[stage] = sum(sampler.worker_cpu.values()) - wcpu

    try:
        if engine == "ray":
            from data.engine_ray import RayExecutor, ray_session

            with ray_session(cfg) as n:  # starts a local instance with num_cpus = workers, shuts it down after
                executor = RayExecutor(n)
                # worker processes start and import the stage modules once
                timed("startup", lambda _: list(executor.map(_import_stages, range(4 * n), size="records")))
                for stage in STAGES:
                    maps_before = len(executor.maps)
                    timed(stage, functools.partial(STAGE_RUNS[stage], executor=executor))
                    ray_maps[stage] = executor.maps[maps_before:]
        else:
            for stage in STAGES:
                timed(stage, STAGE_RUNS[stage])
    finally:
        sampler.stop.set()
        if sampler.is_alive():
            sampler.join()
    return wall, driver_cpu, worker_cpu, sampler


def digest(cfg: DataConfig) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name in ("tokenized/meta.json", "packed/meta.json", "report.json"):
        h.update((cfg.out / name).read_bytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=4, help="GSM8K train repeats in the input")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--engines", nargs="+", choices=["local", "ray"], default=["local", "ray"])
    parser.add_argument("--cores-per-node", type=int, default=16)
    parser.add_argument("--marginal-copies", type=int, default=0,
                        help="also run engine ray on this many copies and project from the difference of the "
                             "driver's CPU between the two sizes (its per-GiB cost without fixed costs)")
    parser.add_argument("--trace-memory", action="store_true",
                        help="trace the driver's allocations (tracemalloc; slows the driver, so its CPU figures are "
                             "not comparable) and print each stage's peak, per record with --marginal-copies")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    inputs = write_input(workdir, args.copies)
    input_bytes = sum(Path(spec["path"]).stat().st_size for spec in inputs)
    cfg = from_dict(DataConfig, {
        "inputs": inputs, "output_dir": str(workdir / "out"), "tokenizer_path": str(ROOT / "data/example/tokenizer"),
        "ratio_path": str(workdir / "ratios.json"), "max_length": 4096, "seed": 42, "merge": {"probability": 0.2},
    })
    cfg.validate()
    print(f"input: {input_bytes / 2**20:.1f} MiB, workdir {workdir}", flush=True)

    if args.trace_memory:
        tracemalloc.start()
    small_run = None
    if args.marginal_copies and "ray" in args.engines:
        # Fixed costs (imports, tokenizer loads, a Ray Data execution's start, meta/report writing, pack's plot)
        # are paid once per stage or process: the slope between two input sizes is what the driver spends per GiB
        # (and allocates per record). The small input runs twice before the large one: the first run pays the
        # process's one-time imports and caches, which the two measured runs then both skip.
        small = Path(tempfile.mkdtemp(prefix="bench_ray_small_"))
        small_inputs = write_input(small, args.marginal_copies)
        small_bytes = sum(Path(spec["path"]).stat().st_size for spec in small_inputs)
        small_cfg = from_dict(DataConfig, {**to_dict(cfg), "inputs": small_inputs, "output_dir": str(small / "out"),
                                           "ratio_path": str(small / "ratios.json")})
        run_once(small_cfg, "ray", max(args.workers))
        _, small_driver, small_workers, small_sampler = run_once(small_cfg, "ray", max(args.workers))
        small_main = dict(main_cpu)
        small_records = json.loads((small_cfg.out / "report.json").read_bytes())["preprocess"]["in"]
        small_run = (small_bytes, small_records, small_driver, small_workers, dict(driver_alloc), small_sampler)
        shutil.rmtree(small)
    rows, digests, ray_cpu, ray_alloc = [], set(), None, {}
    for engine in args.engines:
        for w in args.workers:
            times, driver_cpu, worker_cpu, sampler = run_once(cfg, engine, w)
            digests.add(digest(cfg))
            if engine == "ray" and w == max(args.workers):
                ray_cpu = (driver_cpu, worker_cpu, dict(main_cpu), times)
                ray_maps_large = dict(ray_maps)
                ray_alloc = dict(driver_alloc)
                ray_sampler = sampler
            if driver_alloc:
                print(f"{engine} w={w}: driver's peak allocation per stage (MiB): "
                      + ", ".join(f"{s} {b / 2**20:.1f}" for s, b in driver_alloc.items()), flush=True)
            worker_peak = max(sampler.workers.values(), default=0)
            rows.append((engine, w, times, sampler.driver, worker_peak, len(sampler.workers)))
            print(f"{engine} w={w}: " + ", ".join(f"{s} {t:.1f}s (driver CPU {driver_cpu[s]:.1f}s, of it main thread "
                                                  f"{main_cpu[s]:.1f}s; Ray workers CPU {worker_cpu[s]:.1f}s)"
                                                  for s, t in times.items()), flush=True)
    if len(digests) != 1:
        raise SystemExit(f"outputs differ between runs: {digests}")

    mib = input_bytes / 2**20
    print(f"\nInput {mib:.1f} MiB; every run wrote the same tokenized/packed meta.json and report.json.\n")
    print("| engine | workers | Ray start-up s | " + " | ".join(f"{s} s (MiB/s)" for s in STAGES) +
          " | stages total s | driver peak RSS MiB | largest Ray worker peak RSS MiB (workers seen) |")
    print("|---|---:|---:|" + "---:|" * (len(STAGES) + 3))
    for engine, w, times, driver, worker, n_workers in rows:
        cells = " | ".join(f"{times[s]:.1f} ({mib / times[s]:.1f})" for s in STAGES)
        wcell = f"{worker / 2**20:.0f} ({n_workers})" if engine == "ray" else "—"
        startup = f"{times['startup']:.1f}" if engine == "ray" else "—"
        print(f"| {engine} | {w} | {startup} | {cells} | {sum(times[s] for s in STAGES):.1f} | {driver / 2**20:.0f} "
              f"| {wcell} |")

    if ray_cpu is not None and small_run is not None:
        small_bytes, small_records, small_driver, small_workers, small_alloc, small_sampler = small_run
        records = json.loads((cfg.out / "report.json").read_bytes())["preprocess"]["in"]
        print(f"\nDriver peak RSS (engine ray, {max(args.workers)} workers), with {small_records:,} and "
              f"{records:,} input records, and per added record"
              + (" (tracemalloc's own bookkeeping included)" if args.trace_memory else "") + ":\n")
        print("| resident memory | small input MiB | large input MiB | marginal bytes per record |")
        print("|---|---:|---:|---:|")
        for name, lo, hi in [("RSS", small_sampler.driver, ray_sampler.driver)] + [
                (kind, small_sampler.driver_kinds[kind], ray_sampler.driver_kinds[kind]) for kind in RSS_KINDS]:
            print(f"| {name} (peak) | {lo / 2**20:,.0f} | {hi / 2**20:,.0f} | {(hi - lo) / (records - small_records):,.0f} |")
        if ray_alloc:
            print(f"\nThe driver's peak allocation per stage (tracemalloc), {small_records:,} vs {records:,} input "
                  "records, and per added record:\n")
            print("| stage | small input MiB | large input MiB | marginal bytes per record |")
            print("|---|---:|---:|---:|")
            for s in STAGES:
                lo, hi = small_alloc[s], ray_alloc[s]
                print(f"| {s} | {lo / 2**20:.1f} | {hi / 2**20:.1f} | {(hi - lo) / (records - small_records):.0f} |")
        driver_cpu, worker_cpu, main, _ = ray_cpu
        gib = (input_bytes - small_bytes) / 2**30
        from data.engine_ray import ray_tasks as projected_tasks

        scale = 2**40 / input_bytes
        print(f"\nThe issue's projection: per GiB (a) the driver's main thread, marginal between the two sizes, plus "
              f"(b) Ray Data's per-task driver cost ({RAY_TASK_DRIVER_S * 1e3:.0f} ms) times the Ray tasks per GiB that "
              f"RayExecutor launches for 1 TB on 8 and 64 nodes of {args.cores_per_node} cores (each map of the large "
              "run, its chunks scaled to 1 TB, `engine_ray.ray_tasks`); workers' CPU marginal; 1 TB as max(driver, "
              f"workers / (nodes x {args.cores_per_node} cores)):\n")
        print("| stage | driver main thread s/GiB (marginal) | maps (size: chunks) in this run | Ray tasks per GiB, 8 / 64 "
              "nodes | driver s/GiB (a + b), 8 / 64 nodes | workers CPU s/GiB (marginal) | 1 TB, 8 nodes (h) | 1 TB, "
              "64 nodes (h) |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        totals = {8: 0.0, 64: 0.0}
        for s in STAGES:
            a = (main[s] - small_main[s]) / gib
            w = (worker_cpu[s] - small_workers[s]) / gib
            tasks, d, proj = {}, {}, {}
            for nodes in totals:
                workers = nodes * args.cores_per_node
                tasks[nodes] = sum(projected_tasks(round(n * scale), size, workers) for size, n in ray_maps_large[s]) / 1024
                d[nodes] = a + tasks[nodes] * RAY_TASK_DRIVER_S
                proj[nodes] = max(d[nodes], w / workers) * 1024 / 3600
                totals[nodes] += proj[nodes]
            maps = ", ".join(f"{size}: {n}" for size, n in ray_maps_large[s])
            print(f"| {s} | {a:.2f} | {maps} | {tasks[8]:.1f} / {tasks[64]:.1f} | {d[8]:.2f} / {d[64]:.2f} | {w:,.0f} "
                  f"| {proj[8]:.2f} | {proj[64]:.2f} |")
        print(f"| total | | | | | | {totals[8]:.2f} | {totals[64]:.2f} |")
        print(f"\nMarginal CPU seconds per GiB (Ray, {max(args.workers)} workers, {small_bytes / 2**20:.1f} MiB vs "
              f"{input_bytes / 2**20:.1f} MiB) and 1 TB projected as max(driver, workers / (nodes x "
              f"{args.cores_per_node} cores)):\n")
        print("| stage | driver CPU s/GiB | workers CPU s/GiB | 1 TB, 8 nodes (h) | 1 TB, 64 nodes (h) |")
        print("|---|---:|---:|---:|---:|")
        totals = {8: 0.0, 64: 0.0}
        for s in STAGES:
            d, w = (driver_cpu[s] - small_driver[s]) / gib, (worker_cpu[s] - small_workers[s]) / gib
            proj = {nodes: max(d, w / (nodes * args.cores_per_node)) * 1024 / 3600 for nodes in totals}
            for nodes in totals:
                totals[nodes] += proj[nodes]
            print(f"| {s} | {d:,.0f} | {w:,.0f} | {proj[8]:.1f} | {proj[64]:.1f} |")
        print(f"| total | | | {totals[8]:.1f} | {totals[64]:.1f} |")

    if ray_cpu is not None:
        # A stage's driver part runs in one process; its worker part spreads over nodes x cores. With the next
        # window running while the driver consumes one, a stage takes about the larger of the two.
        driver_cpu, worker_cpu, main, times = ray_cpu
        scale = 2**40 / input_bytes
        gib = input_bytes / 2**30
        for title, bound in (
                ("all the driver's CPU taken as per-GiB work", driver_cpu),
                ("the driver's main thread only taken as per-GiB work (Ray Data's executor threads, "
                 + ", ".join(f"{s} {(driver_cpu[s] - main[s]) / times[s] * 100:.0f}%" for s in STAGES)
                 + " of a core while the stage ran, taken to run beside it for the stage's wall time)", main)):
            print(f"\nCPU seconds per GiB of input (Ray, {max(args.workers)} workers) and 1 TB ({scale:,.0f} x this "
                  f"input) projected as max(driver, workers / (nodes x {args.cores_per_node} cores)), {title}:\n")
            print("| stage | driver CPU s/GiB | workers CPU s/GiB | 1 TB, 8 nodes (h) | 1 TB, 64 nodes (h) |")
            print("|---|---:|---:|---:|---:|")
            totals = {8: 0.0, 64: 0.0}
            for s in STAGES:
                proj = {}
                for nodes in totals:
                    cores = nodes * args.cores_per_node
                    proj[nodes] = max(bound[s], worker_cpu[s] / cores) * scale / 3600
                    totals[nodes] += proj[nodes]
                print(f"| {s} | {bound[s] / gib:,.1f} | {worker_cpu[s] / gib:,.0f} | {proj[8]:.1f} | {proj[64]:.1f} |")
            print(f"| total | | | {totals[8]:.1f} | {totals[64]:.1f} |")
    shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
