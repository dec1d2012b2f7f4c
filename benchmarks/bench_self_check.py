"""Cost of the trainer's start-up self-check next to one optimizer step, in one process, side by side.

Builds the Trainer of a train config with `self_check=false`, then times the start-up self-check
(train/run/check.py `run_self_check`: a few sequences
packed vs the model's own unpacked eager forward, gradient probe) and `train_step` over the first steps, each
`--repeats` times; prints the medians and their ratio.

    python -m benchmarks.bench_self_check configs/train/example.yaml --steps 4 --repeats 3
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from train.config.sections import load_config
    from train.trainer import Trainer
    from train.run.check import run_self_check

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config, [f"output_dir={out}", "self_check=false", "save_steps=0"])
        trainer = Trainer(cfg, console=lambda *_: None)
        checks, steps = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run_self_check(trainer.model, trainer.plan, trainer.dataset, trainer.run.image_loader, False,
                           lambda *_: None)
            checks.append(time.perf_counter() - start)
        for step in range(args.steps):
            start = time.perf_counter()
            trainer.train_step(trainer.sampler.plan(step))
            steps.append(time.perf_counter() - start)
    check, step = statistics.median(checks), statistics.median(steps)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"self-check: median {check:.3f} s of {args.repeats} (min {min(checks):.3f}, max {max(checks):.3f})")
    print(f"train step: median {step:.3f} s of {args.steps} (min {min(steps):.3f}, max {max(steps):.3f}), "
          f"{trainer.sampler.rows_per_step} rows/step")
    print(f"self-check / step: {check / step:.3f}")


if __name__ == "__main__":
    main()
