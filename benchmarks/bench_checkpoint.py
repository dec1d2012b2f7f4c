"""Cost of the checkpoint manifest: writing it at save (blake2b + fsync of every file) and verifying it at resume.

A synthetic checkpoint directory of `--mib` MiB (a model.pt-sized file, an optimizer.pt twice that size, small
rng / state files, like a checkpoint saved without DeepSpeed) is hashed by `train.checkpoint.write_manifest` and
checked by `verify_checkpoint`. Reported: wall and CPU seconds, and MiB/s of each. The files are read back from
the page cache right after being written, as at save time; a resume after a restart reads them from disk, which
then bounds the speed instead.

    python -m benchmarks.bench_checkpoint --mib 768 --out benchmarks/results/checkpoint.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from train.checkpoint import verify_checkpoint, write_manifest  # noqa: E402


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def make_checkpoint(directory: Path, mib: int) -> int:
    """model.pt (1/3), optimizer.pt (2/3), rng and state files; returns the total bytes."""
    (directory / "rng").mkdir(parents=True)
    chunk = os.urandom(1 << 20)
    for name, share in (("model.pt", 1), ("optimizer.pt", 2)):
        with open(directory / name, "wb") as f:
            for _ in range(mib * share // 3):
                f.write(chunk)
    (directory / "rng" / "rank_0.json").write_bytes(b"{}" * 2000)
    (directory / "rng" / "rank_0.safetensors").write_bytes(os.urandom(5056))
    (directory / "trainer_state.json").write_bytes(b"{}")
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=768, help="checkpoint size in MiB")
    parser.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
    parser.add_argument("--out", default=None, help="markdown file for the results")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    try:
        size = make_checkpoint(base / "step-000001", args.mib)
        _, w_wall, w_cpu = _timed(lambda: write_manifest(base / "step-000001", 1))
        problems, v_wall, v_cpu = _timed(lambda: verify_checkpoint(base / "step-000001"))
        assert problems == [], problems
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mib = size / 2**20
    lines = [
        f"# Checkpoint manifest cost ({dt.date.today()}, {platform.node()}, {os.cpu_count()} cores)",
        "",
        f"`python -m benchmarks.bench_checkpoint --mib {args.mib}`: a {mib:.0f} MiB checkpoint directory.",
        "",
        "| operation | wall s | CPU s | MiB/s (wall) |",
        "|---|---:|---:|---:|",
        f"| write_manifest (blake2b + fsync per file) | {w_wall:.2f} | {w_cpu:.2f} | {mib / w_wall:.0f} |",
        f"| verify_checkpoint (size + blake2b per file) | {v_wall:.2f} | {v_cpu:.2f} | {mib / v_wall:.0f} |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
