"""Peak memory of the whole data pipeline (`python -m data.pipeline`) on a large synthetic input.

Writes a synthetic messages .jsonl of at least --gb gigabytes (three-turn conversations with long, varied
text, four categories), runs every stage on it in a subprocess, and samples the resident set size of the
pipeline's whole process tree (main process + workers) every 0.2 s. Prints the input size, wall time,
peak RSS of the tree and of the largest single process.

    python benchmarks/bench_pipeline_rss.py --gb 1.0 --workers 2
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the a of to and in is it that for on with as was by at be this from or an are which have one had not "
    "number water light energy model token sequence attention gradient packing rows shard memory value prime"
).split()


def synthetic_jsonl(path: Path, target_bytes: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    written = records = 0
    with path.open("wb") as out:
        while written < target_bytes:
            def text(n: int) -> str:
                return " ".join(rng.choice(WORDS) for _ in range(n))

            messages = []
            for _ in range(3):
                messages.append({"role": "user", "content": text(rng.randint(20, 200))})
                messages.append({"role": "assistant", "content": text(rng.randint(50, 600))})
            line = orjson.dumps({"messages": messages, "category": f"c{rng.randint(1, 4)}"}) + b"\n"
            out.write(line)
            written += len(line)
            records += 1
    return records


def run(config: dict, workdir: Path) -> dict:
    cfg_path = workdir / "config.json"
    cfg_path.write_bytes(orjson.dumps(config))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "data.pipeline", str(cfg_path)], cwd=ROOT, env=env)
    ps = psutil.Process(proc.pid)
    peak_tree = peak_single = 0
    while proc.poll() is None:
        try:
            procs = [ps] + ps.children(recursive=True)
            rss = [p.memory_info().rss for p in procs]
        except psutil.Error:
            continue
        peak_tree = max(peak_tree, sum(rss))
        peak_single = max(peak_single, max(rss))
        time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(f"pipeline failed with exit code {proc.returncode}")
    return {"seconds": time.perf_counter() - start, "peak_tree_rss": peak_tree, "peak_single_rss": peak_single}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokenizer", default=str(ROOT / "data/example/tokenizer"))
    ap.add_argument("--max-length", type=int, default=16384)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="packsft-rss-") as tmp:
        work = Path(tmp)
        raw = work / "raw.jsonl"
        n = synthetic_jsonl(raw, int(args.gb * 2**30))
        size = raw.stat().st_size
        print(f"input: {size / 2**30:.2f} GiB, {n:,} records")
        config = {
            "inputs": [{"path": str(raw), "format": "messages", "category_field": "category"}],
            "output_dir": str(work / "out"),
            "tokenizer_path": args.tokenizer,
            "max_length": args.max_length,
            "num_workers": args.workers,
            "merge": {"probability": 0.2},
        }
        result = run(config, work)
    print(
        f"wall {result['seconds']:.0f} s | peak RSS, whole process tree {result['peak_tree_rss'] / 2**20:.0f} MiB"
        f" | largest single process {result['peak_single_rss'] / 2**20:.0f} MiB | input {size / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
