"""Engine local, this checkout against another one (`--baseline`, e.g. a worktree of an earlier commit), side by side
in one run: the same input and config, the two pipelines run in turn (A B A B ...), each stage's seconds as the
pipeline prints them (`[stage] in=... (12.3s)`), the median per stage and the ratio this/baseline.

Input as bench_ray.py's: GSM8K train repeated `--copies` times (prompt/response) plus the long-CoT fixture once,
the example tokenizer, merge probability 0.2, max_length 4096.

    python benchmarks/bench_local_engine.py --baseline /path/to/old/checkout --copies 20 --workers 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_ray import write_input  # noqa: E402
from data.config import STAGES  # noqa: E402

STAGE_LINE = re.compile(r"^\[(\w+)\] in=.* \((\d+(?:\.\d+)?)s\)$", re.MULTILINE)


def run_pipeline(checkout: Path, config: Path, out: Path) -> dict[str, float]:
    """One `python -m data.pipeline` run of `checkout` (fresh output directory): seconds per stage."""
    if out.exists():
        shutil.rmtree(out)
    done = subprocess.run([sys.executable, "-m", "data.pipeline", str(config), f"output_dir={out}"], cwd=checkout,
                          capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                               "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode:
        raise SystemExit(f"{checkout}: pipeline failed\n{done.stderr[-3000:]}")
    return {stage: float(sec) for stage, sec in STAGE_LINE.findall(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout (its own data/ code)")
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench_local_"))
    inputs = write_input(workdir, args.copies)
    config = workdir / "config.json"
    config.write_text(json.dumps({
        "inputs": inputs, "tokenizer_path": str(ROOT / "data/example/tokenizer"),
        "ratio_path": str(workdir / "ratios.json"), "max_length": 4096, "seed": 42, "merge": {"probability": 0.2},
        "num_workers": args.workers}))
    mib = sum(Path(spec["path"]).stat().st_size for spec in inputs) / 2**20
    times: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for _ in range(args.rounds):
        for name, checkout in (("baseline", args.baseline), ("this", ROOT)):
            times[name].append(run_pipeline(checkout, config, workdir / f"out-{name}"))
    print(f"input {mib:.1f} MiB, {args.workers} workers, {args.rounds} rounds (baseline, this in turn); median s:\n")
    print("| stage | baseline s | this s | this / baseline |")
    print("|---|---:|---:|---:|")
    for stage in [*STAGES, "total"]:
        def median(name: str) -> float:
            return statistics.median(sum(r.values()) if stage == "total" else r[stage] for r in times[name])

        base, this = median("baseline"), median("this")
        print(f"| {stage} | {base:.1f} | {this:.1f} | {this / base:.2f} |")
    shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
