"""Micro-batches built ahead on a thread (`prefetch_micro_batches`, train/steps/feed.py) vs in the loop, on image
conversations whose images are the size of a photo or screenshot. Needs .venv-vision (torchvision + Pillow).

    .venv-vision/bin/python benchmarks/bench_prefetch.py [--copies 4] [--size 1920x1080] [--steps 8] [--out F]

Data: `--copies` copies of the six LLaMA-Factory demo records of ../shared/fixtures/multimodal (8 images a copy),
every image the fixture's JPEG resized to `--size` and re-encoded at quality 90, through data_process (the
Qwen2.5-VL processor fixture, its default pixel limits; rows of 16,384 tokens). Training: the example's tiny random
Qwen2.5-VL (configs/train/example_vision.yaml: a 2-block tower trained, a 2-layer decoder) for `--steps` steps of
one 16K row each, once per depth in `--depths` and `--rounds` times over (alternating, the median kept); per run:
the median step time after the first step (tokens / tokens_per_s of log.jsonl), the mean `batch_wait_s` (what the
loop waited for its micro-batches: their whole building at depth 0), and the losses, which must be equal.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MM = ROOT.parent / "shared" / "fixtures" / "multimodal"
PROCESSOR = MM / "qwen2_5_vl_processor"
ROW = 16384


def write_records(tmp: Path, copies: int, size: tuple[int, int]) -> Path:
    from PIL import Image

    image = tmp / f"image_{size[0]}x{size[1]}.jpg"
    Image.open(MM / "mllm_demo_data" / "3.jpg").convert("RGB").resize(size, Image.BICUBIC).save(image, quality=90)
    records = json.loads((MM / "mllm_demo.json").read_text())
    data = tmp / "records.jsonl"
    with open(data, "w") as f:
        for _ in range(copies):
            for rec in records:
                f.write(json.dumps({**rec, "images": [str(image)] * len(rec["images"])}, ensure_ascii=False) + "\n")
    return data


def prepare(tmp: Path, copies: int, size: tuple[int, int]) -> tuple[Path, dict]:
    config = tmp / "data.json"
    config.write_text(json.dumps({"inputs": [{"path": str(write_records(tmp, copies, size))}],
                                  "output_dir": str(tmp / "out"), "tokenizer_path": str(PROCESSOR),
                                  "max_length": ROW, "num_workers": 1, "pack": {"max_length": ROW}}))
    subprocess.run([sys.executable, "-m", "data.pipeline", str(config)], cwd=ROOT, check=True, capture_output=True)
    packed = tmp / "out" / "packed"
    return packed, json.loads((packed / "meta.json").read_text())["counts"]


def train(tmp: Path, packed: Path, depth: int, steps: int, run: int) -> dict:
    out = tmp / f"train_{depth}_{run}"
    cmd = [sys.executable, "-m", "train", "configs/train/example_vision.yaml", f"data_path={packed}",
           f"output_dir={out}", f"max_steps={steps}", "warmup_steps=0", f"prefetch_micro_batches={depth}",
           "self_check=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    later = log[1:]
    return {"step_s": statistics.median(r["tokens"] / r["tokens_per_s"] for r in later),
            "batch_wait_s": statistics.mean(r["batch_wait_s"] for r in later),
            "losses": [r["loss"] for r in log]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--size", default="1920x1080")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--depths", default="0,2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="a markdown file for the table")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    depths = [int(d) for d in args.depths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        packed, counts = prepare(Path(tmp), args.copies, size)
        runs = {d: [] for d in depths}
        for run in range(args.rounds):
            for d in depths:
                runs[d].append(train(Path(tmp), packed, d, args.steps, run))
    losses = {tuple(r["losses"]) for rs in runs.values() for r in rs}
    if len(losses) != 1:
        raise SystemExit(f"the losses differ between depths: {losses}")
    base = statistics.median(r["step_s"] for r in runs[depths[0]])
    lines = [f"{counts['images']} images of {args.size} in {counts['rows']} rows of up to {ROW:,} tokens "
             f"({counts['image_tokens']:,} image tokens of {counts['tokens']:,}); {args.steps} steps of one row, "
             f"median of {args.rounds} runs per depth; losses equal at every depth",
             "", "| prefetch_micro_batches | step (s) | waited for micro-batches (s/step) | step time vs depth "
             f"{depths[0]} |", "|---|---|---|---|"]
    for d in depths:
        step = statistics.median(r["step_s"] for r in runs[d])
        wait = statistics.median(r["batch_wait_s"] for r in runs[d])
        lines.append(f"| {d} | {step:.3f} | {wait:.3f} | {step / base:.2f} |")
    command = " ".join(["python", "benchmarks/bench_prefetch.py", *map(shlex.quote, sys.argv[1:])])
    lines += ["", f"`{command}` on {platform.machine()}, {os.cpu_count()} cores, {dt.date.today()}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
