"""The example's training speed per CPU-thread setting, on an idle machine and beside busy loops (issue 52 item 2).

    python benchmarks/bench_threads.py [--threads 2,auto] [--burners 0,2] [--repeats 3] [--steps 40] [--out F]

Each run is `sh train.sh` on the example (configs/train/example.yaml on outputs/example/packed: `sh data_process.sh`
first) with `launch.cpu_threads_per_process=N` (`auto`: the key left unset, OMP_NUM_THREADS unset: what
train/machines/threads.py chooses), `--steps` steps, beside `--burners` busy Python loops (the other jobs of a shared
machine). Per run: the median of log.jsonl's `tokens_per_s` over the steps after the first two, the run's wall time,
the `cpu threads:` line it printed, and the load average before and after (`/proc/loadavg`: on a shared machine an
"idle" figure holds only if the load stayed low). Settings alternate within each repeat, so a change of the
machine's other load falls on all of them alike. Writes a Markdown table (`--out`, default
benchmarks/results/cpu_threads.md) and the raw runs beside it (.json).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(tmp: Path, threads: str, burners: int, steps: int, index: int) -> dict:
    out = tmp / f"run_{index}"
    cmd = ["sh", "train.sh", "configs/train/example.yaml", f"output_dir={out}", f"max_steps={steps}", "save_steps=0",
           "plot=false", "log_backends=[]"]
    if threads != "auto":
        cmd.append(f"launch.cpu_threads_per_process={threads}")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    before, start = load(), time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    wall, after = time.perf_counter() - start, load()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    said = [line for line in proc.stdout.splitlines() if line.startswith("cpu threads:")]
    return {"threads": threads, "burners": burners, "said": said[0] if said else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[2:]), "wall_s": wall,
            "load_before": before, "load_after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2,auto", help="comma-separated: a thread count or auto")
    parser.add_argument("--burners", default="0,2", help="comma-separated: busy loops beside the run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_threads.md")
    args = parser.parse_args()
    if not (ROOT / "outputs" / "example" / "packed").is_dir():
        raise SystemExit("outputs/example/packed is missing: run `sh data_process.sh` first")
    settings = [(t, int(b)) for b in args.burners.split(",") for t in args.threads.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for threads, burners in settings:
                runs.append(run(Path(tmp), threads, burners, args.steps, len(runs)))
                print(json.dumps(runs[-1]), flush=True)
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    lines = [f"# CPU threads per process: the example's tokens/s ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} "
             "UTC)", "", f"`python benchmarks/bench_threads.py --threads {args.threads} --burners {args.burners} "
             f"--repeats {args.repeats} --steps {args.steps}` on {machine}.", "",
             "| threads | busy loops | tokens/s (median of steps 3+, each run) | wall s | load before → after "
             "| said |",
             "|---|---:|---|---|---|---|"]
    for threads, burners in settings:
        mine = [r for r in runs if (r["threads"], r["burners"]) == (threads, burners)]
        speeds = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in mine)
        walls = ", ".join(f"{r['wall_s']:.0f}" for r in mine)
        loads = "; ".join(f"{r['load_before']} → {r['load_after']}" for r in mine)
        lines.append(f"| {threads} | {burners} | {speeds} | {walls} | {loads} | {mine[0]['said']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
