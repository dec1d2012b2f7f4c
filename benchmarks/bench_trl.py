"""The baseline of the GPU trainer benchmark: TRL's `SFTTrainer` on the same sequences and model shape.

PackSFT's `bench_train_gpu` trains `--steps` optimizer steps of one packed row each, the rows the trainer's own
sampler picks (seed 0). This script takes exactly those rows' sequences (the packed data's `seq_lens` split them
back into the tokenized sequences, with their loss masks as `completion_mask`), hands them to TRL as a pre-tokenized
dataset and lets TRL do what its docs recommend for long-context SFT: BFD packing into rows of the same length,
padding-free batches (position ids restarted per sequence), one row per step, bf16 autocast over fp32 weights (as
PackSFT without DeepSpeed), activation checkpointing on (SFTConfig's default) unless `--gradient-checkpointing false`
(to match a PackSFT run whose memory plan left it off). The model is the same random-init
Qwen2.5 shape, or `--model-config FILE`'s (any family, e.g. the Qwen3-30B-A3B shape of the GPU check's `moe` phase:
its experts run as transformers' default `experts_implementation`, and MFU counts the active parameters); `--attn` lists transformers attention implementations to try, each in its own process.

Per step: wall time from TRL's step-begin to step-end callback (forward, backward, optimizer; CUDA synchronized),
tokens of the step's batch, and the step's FLOPs by bench_train_gpu's formula from the batch's sequence lengths.
Reported: tokens/s and MFU (median of steps 3..), peak memory, losses.

    python -m benchmarks.bench_trl --packed DIR/packed --shape qwen2.5-0.5b --tokenizer .fixtures/tokenizers/qwen2_5_instruct
    python -m benchmarks.bench_trl --smoke --out /tmp/trl_smoke
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import SHAPES, machine_description  # noqa: E402
from benchmarks.bench_train_gpu import (  # noqa: E402
    H100_BF16_DENSE_TFLOPS,
    MEDIAN_STEPS,
    build_packed,
    step_flops,
    time_left,
    write_atomic,
)


def step_sequences(packed: str, steps: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, completion_mask) of every sequence in the rows PackSFT's sampler gives steps 0..steps-1
    (one row per step, seed 0: what bench_train_gpu trains)."""
    from data.shards.dataset import PackedDataset
    from train.steps.sampler import StepSampler

    dataset = PackedDataset(packed)
    sampler = StepSampler(dataset, dp_size=1, dp_rank=0, grad_accum=1, micro_batch_rows=1, seed=0)
    sequences = []
    for step in range(steps):
        for r in sampler.plan(step).step_rows:
            row = dataset[int(r)]
            start = 0
            for n in row["seq_lens"]:
                ids, labels = row["input_ids"][start:start + n], row["labels"][start:start + n]
                sequences.append((ids.tolist(), (labels != -100).astype(int).tolist()))
                start += int(n)
    return sequences


def run_one(spec: dict) -> dict:
    """TRL SFTTrainer for `spec` in this process."""
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from train.plan.memory import ModelShape

    device = spec["device"]
    sequences = step_sequences(spec["packed"], spec["steps"])
    dataset = Dataset.from_dict({"input_ids": [s[0] for s in sequences], "completion_mask": [s[1] for s in sequences]})
    if spec.get("model_config"):
        raw = json.loads(Path(spec["model_config"]).read_text())
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    else:
        config = Qwen2Config(**SHAPES[spec["shape"]], max_position_embeddings=max(32768, spec["row_length"]))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=spec["attn"], dtype=torch.float32).to(device)
    shape = ModelShape.from_hf_config(config)
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])

    steps: list[dict] = []
    batch_lens: list[list[int]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            steps.append({"seconds": time.perf_counter() - self.t0})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps[-1]["loss"] = float(logs["loss"])

    class RecordingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            cu = inputs["cu_seq_lens_q"].tolist()
            batch_lens.append([b - a for a, b in zip(cu[:-1], cu[1:])])
            return super().training_step(model, inputs, *args, **kwargs)

    work = Path(spec["work_dir"]) / f"trl_{spec['attn']}"
    args = SFTConfig(
        output_dir=str(work), max_steps=spec["steps"], per_device_train_batch_size=1, gradient_accumulation_steps=1,
        learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, bf16=device == "cuda",
        use_cpu=device == "cpu", logging_steps=1, report_to=[], save_strategy="no", eval_strategy="no", seed=0,
        packing=True, packing_strategy="bfd", padding_free=True, max_length=spec["row_length"],
        completion_only_loss=True, gradient_checkpointing=spec["gradient_checkpointing"], dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = RecordingSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                  callbacks=[StepTimer()])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for step, lens in zip(steps, batch_lens):
        step.update(tokens=sum(lens), sequences=len(lens), flops=step_flops(shape, lens))
        step["tokens_per_s"] = step["tokens"] / step["seconds"]
    import transformers
    import trl

    return {"steps": steps, "peak_bytes": int(peak), "trl": trl.__version__, "transformers": transformers.__version__,
            "attn_implementation": model.config._attn_implementation,
           "gradient_checkpointing": spec["gradient_checkpointing"], "rows_in_dataset": len(trainer.train_dataset),
            "loss_finite": bool(np.isfinite([s.get("loss", np.nan) for s in steps]).all())}


def measure(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_trl", "--child", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": f"exit {proc.returncode}: " + " / ".join(line.replace("|", "/") for line in lines[-3:]),
                "stderr_tail": lines[-60:]}
    return json.loads(Path(spec["result_path"]).read_text())


def summarize(result: dict, peak_tflops: float | None) -> dict:
    if "error" in result:
        return result
    window = result["steps"][MEDIAN_STEPS] or result["steps"]
    out = {"tokens_per_s": statistics.median(s["tokens_per_s"] for s in window),
           "peak_gib": result["peak_bytes"] / 2**30,
           "first_losses": [round(s["loss"], 4) for s in result["steps"] if "loss" in s],
           "sequences_per_row": statistics.mean(s["sequences"] for s in result["steps"]),
           "trl": result["trl"], "transformers": result["transformers"], "rows_in_dataset": result["rows_in_dataset"],
           "gradient_checkpointing": result["gradient_checkpointing"]}
    if peak_tflops:
        out["mfu"] = statistics.median(s["flops"] / s["seconds"] / (peak_tflops * 1e12) for s in window)
    return out


def markdown(report: dict) -> str:
    lines = [f"## TRL SFTTrainer (BFD packing, padding-free), {report['date']}", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`", "",
             "| shape | row length | attention | tokens/s (median steps 3..) | MFU | peak memory GiB | seqs/row | "
             "activation checkpointing | losses of steps 1.. |", "|---|---:|---|---:|---:|---:|---:|---|---|"]
    for row in report["results"]:
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['row_length']} | {row['attn']} | {row['error']} | | | | | |")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
        losses = " ".join(f"{x:.4f}" for x in row["first_losses"])
        lines.append(f"| {row['shape']} | {row['row_length']} | {row['attn']} | {row['tokens_per_s']:,.0f} | {mfu} | "
                     f"{row['peak_gib']:.2f} | {row['sequences_per_row']:.0f} | "
                     f"{'on' if row['gradient_checkpointing'] else 'off'} | {losses} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="CPU check: example data and tiny model, 2K rows, 3 steps")
    ap.add_argument("--packed", help="packed directory (its meta.json gives the row length)")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help=f"one of {sorted(SHAPES)} (with --model-config: its name)")
    ap.add_argument("--model-config", type=Path, help="a model config JSON instead of --shape's (any family)")
    ap.add_argument("--tokenizer", default=str(ROOT.parent / "shared/fixtures/tokenizers/qwen2_5_instruct"))
    ap.add_argument("--attn", default="flex_attention,sdpa", help="transformers attention implementations")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--gradient-checkpointing", default="true", choices=["true", "false"])
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per attention implementation")
    ap.add_argument("--deadline", type=float, help="unix time: no run goes past it (cut short, or not started)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trl",
                    help="writes <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        Path(spec["result_path"]).write_text(json.dumps(run_one(spec)))
        return

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    peak_tflops = args.peak_tflops or (H100_BF16_DENSE_TFLOPS if device == "cuda" else None)
    report = {"date": dt.date.today().isoformat(), "machine": machine_description(device),
              "command": "python -m benchmarks.bench_trl " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
              "peak_tflops": peak_tflops, "results": []}
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        model_config, tokenizer, shape, steps = None, args.tokenizer, args.shape, args.steps
        if args.model_config is not None:
            if not args.model_config.is_file():
                raise SystemExit(f"--model-config {args.model_config}: no such file")
            model_config = str(args.model_config)
        if args.smoke:  # the rows given (gpu_check's, PackSFT's runs' own), else the example's built here
            packed = args.packed or str(build_packed(Path(tmp) / "data", 2048, fixtures=None, smoke=True))
            tokenizer = str(ROOT / json.loads((ROOT / "configs/data/example.json").read_text())["tokenizer_path"])
            steps = min(steps, 3)
            if model_config is None:
                model_config, shape = str(ROOT / "configs/model/tiny_qwen2.json"), "example-tiny"
        elif args.packed:
            packed = args.packed
        else:
            raise SystemExit("--packed DIR (a packed directory) or --smoke")
        row_length = int(json.loads((Path(packed) / "meta.json").read_text())["max_length"])
        for attn in args.attn.split(","):
            spec = {"packed": packed, "shape": shape, "model_config": model_config, "tokenizer": tokenizer,
                    "attn": attn, "steps": steps, "gradient_checkpointing": args.gradient_checkpointing == "true", "row_length": row_length, "device": device, "work_dir": tmp,
                    "result_path": str(Path(tmp) / f"result_{attn}.json")}
            timeout = time_left(args.timeout, args.deadline)
            result = measure(spec, timeout) if timeout else {"error": "not run: the run's deadline had passed"}
            row = {"shape": shape, "row_length": row_length, "attn": attn, **summarize(result, peak_tflops)}
            report["results"].append(row)
            print(json.dumps(row), flush=True)
            write_report(args.out, report)
    write_report(args.out, report)
    print(markdown(report))


def write_report(out: Path, report: dict) -> None:
    write_atomic(out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), markdown(report))


if __name__ == "__main__":
    main()
