"""GPU throughput of the REAL trainer step (train.trainer.Trainer.train_step), per attention backend side by side.

For every (model shape, row length) and every backend in `--backends`, one fresh subprocess builds a `Trainer` from a
config written here (random init from a Qwen2.5-shaped config, bf16 on CUDA, `attn_backend=<backend>`) and runs
`--steps` optimizer steps of one packed row each on real-length-distributed packed data; it reports

- tokens/s: the trainer's own per-step figure (packed tokens / wall time of `train_step`), median of steps 3..8;
- MFU: model FLOPs per second over `--peak-tflops` (989 = H100 SXM dense bf16), median of the same steps, with

      FLOPs(step) = 6 · N · T  +  6 · n_layers · n_heads · head_dim · Σ_i L_i²

  N = parameters that take part in a matmul per token (every decoder-layer weight and the lm head; the input
  embedding is a lookup: `train.plan.memory.ModelShape.matmul_params`), T = tokens of the step, L_i = length of
  packed sequence i of the step. The attention term is causal QKᵀ and PV: forward 2 matmuls · 2 FLOPs per
  multiply-add · H · d · L²/2 (causal half) = 2·H·d·L², backward twice the forward, so 3 · 2·H·d·L² per layer.
  Recomputation under activation checkpointing is NOT counted (the usual MFU convention: useful work only);
- peak memory: torch.cuda.max_memory_allocated over the run (CPU: the process's peak RSS);
- the first losses (equal across backends within bf16 tolerance: the same seed gives the same initial weights).

Data: the project's own pipeline (`data.pipeline.run_pipeline`) on the shared fixtures (GSM8K, long chain-of-thought,
ShareGPT chats, tool calls; Qwen2.5 tokenizer), packed at each row length; `--fixtures DIR` points at a copy of
../shared/fixtures (the GPU machine receives only the checkout: carry a copy, see BENCHMARKS.md), or `--packed DIR`
(repeatable) gives pre-built packed directories, matched to a row length by their meta.json max_length.
`--smoke`: the CPU check of this script (the embedded example data and its tiny model, 2K rows, fp32, 3 steps).
A backend may carry trainer options after `+`: `torch_varlen+liger` (Liger's fused kernels), `flex+compile`
(`compile_layers`), `+compile_loss` (the loss chunk's softmax and gradient compiled into one kernel), `+ckpt` (every
layer checkpointed, whatever `--gradient-checkpointing` says); on a mixture of experts `+moe_grouped_mm` / `+moe_loop`
set the trainer's `moe_kernel` (grouped_mm / loop: one grouped GEMM per projection, or the per-expert loop; on one
process, without expert parallelism, it sets transformers' `experts_implementation`: grouped_mm / eager); without
either, `moe_kernel: auto` (grouped_mm where it runs).
`--model-config FILE` runs that model config (any family: a mixture of experts' MFU counts its ACTIVE parameters,
the top-k experts a token runs) instead of `--shapes`, named `--model-name` in the tables; with `--smoke` too.
Besides tokens/s, the trained (loss) tokens per second: what compares rows that store the same targets in fewer
tokens (stepwise prefix trees against the same steps expanded as samples).
`--prepare DIR` only builds the packed data (DIR/data_<length>/packed) and exits;
`--profile-out FILE` profiles one more step of each run with torch.profiler and appends its table to FILE.

    python -m benchmarks.bench_train_gpu --fixtures .fixtures --shapes qwen2.5-0.5b --row-lengths 32768,131072
    python -m benchmarks.bench_train_gpu --smoke --out /tmp/smoke
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

BACKENDS = ("sdpa", "torch_varlen", "flex", "flash_varlen")
BACKEND_OPTIONS = {"liger": "liger", "compile": "compile_layers", "compile_loss": "compile_loss",  # `+<option>` ->
                   "ckpt": "gradient_checkpointing"}  # config key set true
MOE_OPTIONS = {"moe_grouped_mm": "grouped_mm", "moe_loop": "loop"}  # `+<option>` -> moe_kernel
H100_BF16_DENSE_TFLOPS = 989.0
MEDIAN_STEPS = slice(2, 8)  # steps 3..8 (1-based)
FIXTURE_INPUTS = [  # (file under <fixtures>/data, InputSpec fields)
    ("gsm8k_train.jsonl", {"format": "prompt_response", "prompt_key": "question", "response_key": "answer",
                           "category_name": "math"}),
    ("skyt1_math500_longcot.messages.jsonl", {"format": "messages", "category_name": "longcot"}),
    ("fastchat_dummy_conversation.json", {"format": "sharegpt", "category_name": "chat"}),
    ("llamafactory_glaive_toolcall_en_demo.json", {"format": "sharegpt", "category_name": "tools"}),
    ("llamafactory_reason_tool_use_demo_50.jsonl", {"format": "messages", "category_name": "tools"}),
]


# ---------------------------------------------------------------------------------------------- data
def build_packed(out_dir: Path, row_length: int, fixtures: Path | None, smoke: bool) -> Path:
    """Packed rows of `row_length` tokens through the project's pipeline (all stages), in `out_dir`."""
    from common.config import from_dict
    from data.config import DataConfig
    from data.pipeline import run_pipeline

    if smoke:
        raw = json.loads((ROOT / "configs/data/example.json").read_text())
        for spec in raw["inputs"]:
            spec["path"] = str(ROOT / spec["path"])
        raw.update(tokenizer_path=str(ROOT / raw["tokenizer_path"]))  # the ratio file: written into output_dir
    else:
        if fixtures is None or not (fixtures / "data").is_dir():
            raise SystemExit(f"--fixtures {fixtures}: no data/ directory (a copy of ../shared/fixtures); or --packed")
        raw = {
            "inputs": [{"path": str(fixtures / "data" / name), **spec} for name, spec in FIXTURE_INPUTS],
            "tokenizer_path": str(fixtures / "tokenizers" / "qwen2_5_instruct"),
            "merge": {"probability": 0.0},
            "on_error": "skip",
        }
    raw.update(output_dir=str(out_dir), max_length=row_length, pack={"max_length": row_length}, num_workers=0,
               overlong="drop")
    run_pipeline(from_dict(DataConfig, raw, where="bench_train_gpu data config"))
    return out_dir / "packed"


def packed_by_length(dirs: list[str]) -> dict[int, Path]:
    found = {}
    for d in dirs:
        meta = json.loads((Path(d) / "meta.json").read_text())
        found[int(meta["max_length"])] = Path(d)
    return found


def parse_variant(variant: str) -> tuple[str, dict]:
    """`torch_varlen+liger+compile` -> ("torch_varlen", {"liger": True, "compile_layers": True}); `+moe_loop` ->
    {"moe_kernel": "loop"}."""
    backend, *options = variant.split("+")
    unknown = [o for o in options if o not in BACKEND_OPTIONS and o not in MOE_OPTIONS]
    if backend not in BACKENDS or unknown:
        raise SystemExit(f"--backends {variant!r}: backends are {BACKENDS}, options after '+' "
                         f"{sorted(BACKEND_OPTIONS) + sorted(MOE_OPTIONS)}")
    return backend, {**{BACKEND_OPTIONS[o]: True for o in options if o in BACKEND_OPTIONS},
                     **{"moe_kernel": MOE_OPTIONS[o] for o in options if o in MOE_OPTIONS}}


# ---------------------------------------------------------------------------------------------- one run (child)
def step_flops(shape, seq_lens: list[int]) -> float:
    """6·N·T + 6·n_layers·H·d·Σ L² (module docstring)."""
    tokens = sum(seq_lens)
    attention = 6 * shape.n_layers * shape.n_heads * shape.head_dim * sum(n * n for n in seq_lens)
    return 6.0 * shape.matmul_params * tokens + attention


def run_one(spec: dict) -> dict:
    """Build the Trainer for `spec` and run its steps in this process."""
    import numpy as np
    import torch
    import yaml

    from train.config.sections import load_config
    from train.plan.memory import ModelShape
    from train.trainer import Trainer

    work = Path(spec["work_dir"])
    backend, options = parse_variant(spec["backend"])
    name = spec["backend"].replace("+", "_")
    cfg_path = work / f"{name}.yaml"
    model_config = spec["model_config"]
    cfg_path.write_text(yaml.safe_dump({
        "data_path": spec["data_path"], "model_config": model_config,
        "output_dir": str(work / f"out_{name}"), "overwrite_output_dir": True,
        "bf16": spec["device"] == "cuda", "attn_backend": backend, "lr": 1e-5, "warmup_steps": 0,
        "max_steps": spec["steps"] + (1 if spec.get("profile_out") else 0), "micro_batch_rows": 1, "grad_accum": 1,
        "plot": False, "seed": 0, "gradient_checkpointing": spec["gradient_checkpointing"],
        "compile_layers": spec["compile_layers"], "compile_loss": False, "tokenizer_mismatch": "warn", **options,
    }))
    started = time.perf_counter()
    trainer = Trainer(load_config(cfg_path), console=lambda line: print(
        f"[{time.perf_counter() - started:6.1f}s] {line}", file=sys.stderr, flush=True))
    print(f"[{time.perf_counter() - started:6.1f}s] trainer built", file=sys.stderr, flush=True)
    shape = ModelShape.from_hf_config(trainer.lm.config)
    if spec["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for s in range(spec["steps"]):
        plan = trainer.sampler.plan(s)
        record = trainer.train_step(plan)
        seq_lens = [int(n) for r in plan.step_rows for n in trainer.dataset[int(r)]["seq_lens"]]
        elapsed = record["tokens"] / record["tokens_per_s"] if record["tokens_per_s"] else float("nan")
        steps.append({"loss": record["loss"], "tokens": record["tokens"], "tokens_per_s": record["tokens_per_s"],
                      "loss_tokens": record["loss_tokens"], "sequences": len(seq_lens),
                      "flops": step_flops(shape, seq_lens), "seconds": elapsed})
    if spec["device"] == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"backend": trainer.plan.attention.train.every.name, "checkpointing": trainer.plan.memory.checkpointing_reason, "steps": steps,
              "peak_bytes": int(peak), "n_params": shape.n_params, "matmul_params": shape.matmul_params,
              "experts_implementation": (getattr(trainer.lm.config.get_text_config(), "_experts_implementation", None)
                                         if shape.n_experts else None),
              "attention": trainer.plan.attention.train.every.name,
              "loss_finite": bool(np.isfinite([x["loss"] for x in steps]).all())}
    write_atomic(Path(spec["result_path"]), json.dumps(result))  # before the profile: a cut profile keeps the figures
    if spec.get("profile_out"):
        profile_step(trainer, spec["steps"], spec["device"], spec["profile_out"], spec["profile_title"])
    return result


def profile_step(trainer, step: int, device: str, out: str, title: str) -> None:
    """One more optimizer step under torch.profiler; its operator table (by device time on CUDA) appended to `out`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        record = trainer.train_step(trainer.sampler.plan(step))
        if device == "cuda":
            torch.cuda.synchronize()
    sort_by = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70)
    with open(out, "a") as f:
        f.write(f"## {title}: one step, {record['tokens']} tokens, {record['tokens_per_s']:,.0f} tokens/s "
                f"(profiled), sorted by {sort_by}\n\n{table}\n\n")


def child_main(spec_json: str) -> None:
    run_one(json.loads(spec_json))


MIN_RUN_SECONDS = 20.0  # a run with less time than this before the deadline is not started


def time_left(timeout: float, deadline: float | None) -> float | None:
    """Seconds the next run may take: its own timeout, cut to the deadline; None when too little is left to start."""
    if deadline is None:
        return timeout
    left = deadline - time.time()
    return min(timeout, left) if left >= MIN_RUN_SECONDS else None


def measure(spec: dict, timeout: float) -> dict:
    """One backend in a fresh process (clean peak memory, own compile caches)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_train_gpu", "--child", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        lines = (exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or "").splitlines()
        if Path(spec["result_path"]).exists():  # the steps were measured; the profile after them was cut
            return {**json.loads(Path(spec["result_path"]).read_text()), "log": lines[-40:],
                    "note": f"the profile was cut at the {timeout:.0f} s timeout"}
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": lines[-60:]}
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": f"exit {proc.returncode}: " + " / ".join(line.replace("|", "/") for line in lines[-3:]),
                "stderr_tail": lines[-60:]}
    # the trainer's start lines with their times, and the whole process's wall time (where start-up time goes)
    return {**json.loads(Path(spec["result_path"]).read_text()), "log": proc.stderr.strip().splitlines()[-40:],
            "process_s": round(time.time() - started, 1)}


# ---------------------------------------------------------------------------------------------- report
def summarize(result: dict, peak_tflops: float | None) -> dict:
    if "error" in result:
        return result
    window = result["steps"][MEDIAN_STEPS] or result["steps"]
    tps = statistics.median(s["tokens_per_s"] for s in window)
    out = {"tokens_per_s": tps, "peak_gib": result["peak_bytes"] / 2**30, "log": result.get("log", []),
           "loss_tokens_per_s": statistics.median(s["loss_tokens"] / s["seconds"] for s in window),
           "matmul_params": result["matmul_params"], "n_params": result["n_params"],
           "experts_implementation": result.get("experts_implementation"), "attention": result.get("attention"),
           "process_s": result.get("process_s"),
           "first_losses": [round(s["loss"], 4) for s in result["steps"]],
           "sequences_per_row": statistics.mean(s["sequences"] for s in result["steps"]),
           "checkpointing": result["checkpointing"]}
    if peak_tflops:
        out["mfu"] = statistics.median(s["flops"] / s["seconds"] / (peak_tflops * 1e12) for s in window)
    return out


def backend_reasons(device: str) -> dict[str, list[str]]:
    """Why each backend cannot run on this machine (bf16 on CUDA, fp32 on CPU), before any process starts."""
    import torch

    from train.attention.function import BACKENDS as TABLE
    from train.attention.varlen_kernels import NO_FEATURES

    probe = torch.empty((1, 1, 0, 1), device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return {name: TABLE[name].reasons(probe, NO_FEATURES) for name in BACKENDS}


def markdown(report: dict) -> str:
    lines = [f"## Trainer step per attention backend, {report['date']}", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`", "",
             "| shape | row length | backend | tokens/s (median steps 3–8) | trained tokens/s | MFU | peak memory GiB | "
             "seqs/row | activation checkpointing | losses of steps 1.. |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for row in report["results"]:
        if "error" in row or "skipped" in row:
            why = row.get("error") or "not run: " + row["skipped"]
            lines.append(f"| {row['shape']} | {row['row_length']} | {row['backend']} | {why} | | | | | | |")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a (no peak given)"
        losses = " ".join(f"{x:.4f}" for x in row["first_losses"])
        backend = row["backend"] + (f" ({row['attention']})" if row.get("attention") and row["attention"] not in
                                    row["backend"] else "")
        lines.append(f"| {row['shape']} | {row['row_length']} | {backend} | {row['tokens_per_s']:,.0f} | "
                     f"{row.get('loss_tokens_per_s', float('nan')):,.0f} | {mfu} | {row['peak_gib']:.2f} | "
                     f"{row['sequences_per_row']:.0f} | {row['checkpointing']} | {losses} |")
    if any(row.get("experts_implementation") for row in report["results"]):
        lines += ["", "MFU of a mixture of experts: FLOPs of its ACTIVE parameters (attention, router, the top-k "
                  "experts a token runs, lm head): " + ", ".join(
                      f"{row['backend']}: {row['matmul_params'] / 1e6:,.2f}M active of {row['n_params'] / 1e6:,.2f}M, "
                      f"experts_implementation {row['experts_implementation']}"
                      for row in report["results"] if row.get("experts_implementation"))]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="CPU check: example data, tiny model, 2K rows, 3 steps")
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--model-config", type=Path, help="a model config JSON to run instead of --shapes (any family)")
    ap.add_argument("--model-name", help="its name in the tables (default: the file's stem)")
    ap.add_argument("--row-lengths", default="32768,131072")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fixtures", type=Path, default=ROOT.parent / "shared" / "fixtures")
    ap.add_argument("--packed", action="append", default=[], help="a pre-built packed dir (repeatable)")
    ap.add_argument("--gradient-checkpointing", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--compile-layers", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help=f"peak of the device for MFU (default on CUDA: {H100_BF16_DENSE_TFLOPS}, H100 dense bf16)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per backend run")
    ap.add_argument("--deadline", type=float, help="unix time: no run goes past it (cut short, or not started)")
    ap.add_argument("--prepare", type=Path, help="only build the packed data for --row-lengths under this directory")
    ap.add_argument("--profile-out", type=Path, help="profile one more step of each run; tables appended here")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_gpu",
                    help="writes <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model_config is not None and not args.model_config.is_file():
        raise SystemExit(f"--model-config {args.model_config}: no such file")
    if args.smoke:
        shapes, lengths, steps = ["example-tiny"], [2048], min(args.steps, 3)
    elif args.model_config is not None:
        shapes, lengths, steps = [], [int(x) for x in args.row_lengths.split(",")], args.steps
    else:
        shapes, lengths, steps = args.shapes.split(","), [int(x) for x in args.row_lengths.split(",")], args.steps
        unknown = [s for s in shapes if s not in SHAPES]
        if unknown:
            raise SystemExit(f"--shapes: unknown {unknown}; known: {sorted(SHAPES)}")
    if args.prepare:
        for length in lengths:
            print(build_packed(args.prepare / f"data_{length}", length, args.fixtures, args.smoke), flush=True)
        return
    variants = args.backends.split(",")
    for variant in variants:
        parse_variant(variant)
    peak_tflops = args.peak_tflops or (H100_BF16_DENSE_TFLOPS if device == "cuda" else None)
    reasons = backend_reasons(device)
    prebuilt = packed_by_length(args.packed)
    report = {"date": dt.date.today().isoformat(), "machine": machine_description(device),
              "command": "python -m benchmarks.bench_train_gpu " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
              "flops": "6*N*T + 6*n_layers*n_heads*head_dim*sum(L_i^2); N = matmul parameters (layers + lm head)",
              "peak_tflops": peak_tflops, "results": []}
    with tempfile.TemporaryDirectory(prefix="bench_train_gpu_") as tmp:
        tmp = Path(tmp)
        for length in lengths:
            data = prebuilt.get(length) or build_packed(tmp / f"data_{length}", length, args.fixtures, args.smoke)
            if args.model_config is not None:  # its name in the tables
                shapes = [args.model_name or args.model_config.stem]
            for shape in shapes:
                if args.model_config is not None:
                    model_config = args.model_config
                elif args.smoke:
                    model_config = ROOT / "configs" / "model" / "tiny_qwen2.json"
                else:
                    from transformers import Qwen2Config

                    model_config = tmp / f"{shape}.json"
                    Qwen2Config(**SHAPES[shape], max_position_embeddings=max(32768, length)).to_json_file(model_config)
                for backend in variants:
                    row = {"shape": shape, "row_length": length, "backend": backend}
                    timeout = time_left(args.timeout, args.deadline)
                    if reasons.get(parse_variant(backend)[0]):
                        row["skipped"] = "; ".join(reasons[parse_variant(backend)[0]])
                    elif timeout is None:
                        row["skipped"] = "the run's deadline had passed"
                    else:
                        spec = {"backend": backend, "data_path": str(data), "model_config": str(model_config),
                                "work_dir": str(tmp), "steps": steps, "device": device,
                                "gradient_checkpointing": {"true": True, "false": False}.get(
                                    args.gradient_checkpointing, "auto"),
                                "compile_layers": args.compile_layers,
                                "profile_out": str(args.profile_out) if args.profile_out else None,
                                "profile_title": f"{shape}, {length}-token rows, {backend}",
                                "result_path": str(tmp / f"result_{shape}_{length}_{backend}.json")}
                        row.update(summarize(measure(spec, timeout), peak_tflops))
                    report["results"].append(row)
                    print(json.dumps(row), flush=True)
                    write_report(args.out, report)  # after every run: a run cut short keeps what was measured
    write_report(args.out, report)
    print(markdown(report))


def write_report(out: Path, report: dict) -> None:
    write_atomic(out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), markdown(report))


if __name__ == "__main__":
    main()
