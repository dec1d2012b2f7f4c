"""Expert parallelism on CPU (issue 41): a tiny MoE on 2 processes (gloo), `expert_parallel_size` 2 vs 1, side by side.

The model: a random-init qwen3_moe (64 routed experts, top-8, hidden 128, moe_intermediate 64, 4 layers, 2,048-token
vocabulary, fp32; its config is MODEL below), trained on packed rows of synthetic sequences (`--row-length` tokens a
row, one row per rank and step). Every run is 2 processes started by torch.distributed.run, each going through what
`python -m train` does under `sh train.sh` (the config loaded, `preflight`, the `Trainer` with its memory plan, plain
engine and self-check), then `--steps` optimizer steps of `Trainer.train_step`. Runs (`--runs`):

- `ep1`: expert_parallel_size 1 (the experts run as transformers' experts module; `moe_kernel: auto` sets its
  `experts_implementation` to grouped_mm where torch has it; every rank holds every expert);
- `ep1_eager`: the same with `moe_kernel: loop` (transformers' `experts_implementation: eager`, its per-expert loop):
  the kernel choice without expert parallelism;
- `ep2_grouped_mm`, `ep2_loop`: expert_parallel_size 2, `moe_kernel: grouped_mm | loop` (train/model/experts.py:
  one `torch._grouped_mm` per projection over the rank's 32 experts, or one product per expert).

Measured per rank:
- the parameter, gradient and optimizer-state bytes the rank HOLDS, summed over the tensors themselves: the model's
  parameters, their gradients just before the optimizer step (read by a wrapper around `optimizer.step`), every
  tensor in the optimizer's state after the last step; split into the routed experts (parameters under `.experts.`)
  and the rest;
- beside it the memory plan's figure for the same run (train/plan/memory_plan.py's model-state estimate:
  train/plan/memory.py `model_state_bytes` with the experts divided by expert_parallel_size), and its experts part;
- the step's wall time and CPU time (process time, what a shared machine's load does not inflate), medians over the
  steps after `--warmup`; the peak RSS of the process;
- the losses (EP computes what one replica computes: the runs' losses agree within float rounding).
Ratios (EP2 / EP1) from the same invocation. Writes <out>.json and <out>.md.

    nice -n 5 python -m benchmarks.bench_moe --out benchmarks/results/moe_ep
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_train_gpu import write_atomic  # noqa: E402

VOCAB = 2048
MODEL = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=VOCAB, hidden_size=128,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             intermediate_size=384, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=8,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
             tie_word_embeddings=False, use_cache=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
RUNS = {  # name -> (trainer overrides, model config changes)
    "ep1": (["expert_parallel_size=1"], {}),
    "ep1_eager": (["expert_parallel_size=1", "moe_kernel=loop"], {}),
    "ep2_grouped_mm": (["expert_parallel_size=2", "moe_kernel=grouped_mm"], {}),
    "ep2_loop": (["expert_parallel_size=2", "moe_kernel=loop"], {}),
}
NPROC = 2


# ---------------------------------------------------------------------------------------------- data
def write_rows(path: Path, n_rows: int, row_length: int, seed: int) -> Path:
    """Packed rows of `row_length` tokens, each 2-8 synthetic sequences (an untrained prompt, a trained answer)."""
    import numpy as np

    from data.shards.dataset import ShardWriter

    rng = np.random.default_rng(seed)
    with ShardWriter(path, kind="packed", durable=False) as writer:
        for _ in range(n_rows):
            cuts = np.sort(rng.choice(np.arange(64, row_length - 64), size=int(rng.integers(1, 8)), replace=False))
            lengths = np.diff(np.concatenate([[0], cuts, [row_length]]))
            row = []
            for n in lengths:
                ids = rng.integers(3, VOCAB, size=int(n)).astype(np.int32)
                labels = np.full(int(n), -100, dtype=np.int32)
                prompt = max(1, int(n) // 3)  # no label on a sequence's first token
                labels[prompt:] = ids[prompt:]
                turns = np.zeros(int(n), dtype=np.int16)
                turns[prompt:] = 1
                row.append({"input_ids": ids, "labels": labels, "category_ids": np.ones(int(n), dtype=np.int16),
                            "turn_ids": turns})
            writer.add_row(row)
        writer.close({"categories": {"0": "untracked", "1": "synthetic"}})
    return path


# ---------------------------------------------------------------------------------------------- one run (a rank)
def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_rank(spec: dict) -> None:
    """Under torch.distributed.run: `python -m train`'s start-up (config, preflight, Trainer), then the steps."""
    import torch

    from train.config.sections import load_config
    from train.plan.memory import ModelShape, model_state_bytes
    from train.plan.memory_plan import _model_state_bytes
    from train.preflight import preflight
    from train.trainer import Trainer

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(spec["config"], spec["overrides"])
    checked = preflight(cfg, world)
    started = time.perf_counter()
    trainer = Trainer(cfg, checked=checked, console=lambda line: print(line, file=sys.stderr, flush=True))
    startup_s = time.perf_counter() - started
    rank = torch.distributed.get_rank()

    def kind(name: str) -> str:
        return "experts" if ".experts." in name else "other"

    names = {id(p): name for name, p in trainer.model.named_parameters()}
    grads: dict[str, int] = {}
    step = trainer.optimizer.step

    def measured_step(*args, **kwargs):  # the gradients as the optimizer receives them (reduced, clipped)
        grads.clear()
        for p in trainer.model.parameters():
            if p.grad is not None:
                grads[kind(names[id(p)])] = grads.get(kind(names[id(p)]), 0) + _bytes([p.grad])
        return step(*args, **kwargs)

    trainer.optimizer.step = measured_step
    steps = []
    for s in range(spec["steps"]):
        wall, cpu = time.perf_counter(), time.process_time()
        record = trainer.train_step(trainer.sampler.plan(s))
        steps.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                      "loss": record["loss"], "aux_loss": record.get("aux_loss"), "tokens": record["tokens"]})
    params = {k: _bytes(p for n, p in trainer.model.named_parameters() if kind(n) == k) for k in ("experts", "other")}
    optim = {"experts": 0, "other": 0}
    for p, state in trainer.optimizer.state.items():
        optim[kind(names[id(p)])] += _bytes(t for t in state.values() if torch.is_tensor(t))
    shape = ModelShape.from_hf_config(trainer.lm.config)
    ep = cfg.parallel.expert_parallel_size
    plan_total = _model_state_bytes(cfg, shape, world, offloads_optimizer=False)
    plan_experts = model_state_bytes(shape.expert_params // ep, shape.expert_params // ep, None, world // ep,
                                     bf16=cfg.model.bf16)
    result = {
        "rank": rank, "engine": trainer.engine.describe(), "startup_s": round(startup_s, 2),
        "experts": trainer.plan.experts.applied if trainer.plan.experts.parallel > 1 else None,  # None without EP: transformers' experts module runs
        "experts_implementation": trainer.lm.config.get_text_config()._experts_implementation,
        "params": params, "grads": {k: grads.get(k, 0) for k in ("experts", "other")}, "optimizer": optim,
        "plan_total": int(plan_total), "plan_experts": int(plan_experts),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "steps": steps,
    }
    write_atomic(Path(spec["result_dir"]) / f"rank{rank}.json", json.dumps(result))
    trainer.metrics.close()


# ---------------------------------------------------------------------------------------------- parent
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, work: Path, data: Path, steps: int, timeout: float) -> dict:
    """One run: 2 processes under torch.distributed.run, each `run_rank`."""
    overrides, model_changes = RUNS[name]
    model = work / f"model_{name}.json"
    model.write_text(json.dumps({**MODEL, **model_changes}))
    config = work / f"{name}.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "model_config": str(model), "data_path": str(data), "output_dir": str(work / f"out_{name}"),
        "max_steps": steps, "micro_batch_rows": 1, "grad_accum": 1, "lr": 1e-4, "warmup_steps": 0, "seed": 0,
        "bf16": False, "attn_backend": "sdpa", "loss_chunk_size": 1024, "plot": False, "log_backends": [],
        "save_steps": 0, "self_check": True, "output_router_logits": True, "router_aux_loss_coef": 0.001,
        "tokenizer_mismatch": "warn", "launch": {"num_processes": NPROC}}))
    result_dir = work / f"result_{name}"
    result_dir.mkdir(exist_ok=True)
    spec = {"config": str(config), "overrides": overrides, "steps": steps, "result_dir": str(result_dir)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={NPROC}", f"--master_port={free_port()}",
           "-m", "benchmarks.bench_moe", "--child", json.dumps(spec)]
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:  # the first rank's own error (the others' are the broken connection it left)
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [line for line in lines if re.match(r"\[rank\d+\]: \w*(Error|Exception)\b", line)]
        return {"error": f"exit {proc.returncode}: " + (errors or lines[-1:])[0].replace("|", "/"),
                "stderr_tail": lines[-80:]}
    ranks = [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(NPROC)]
    start_line = next((line for line in proc.stderr.splitlines() if "expert parallel" in line), None)
    return {"ranks": ranks, "process_s": round(time.time() - started, 1), "start_line": start_line,
            "overrides": overrides, "model_changes": model_changes}


def summarize(run: dict, warmup: int) -> dict:
    """Per rank: bytes held (experts, other, total), the plan's, medians of the steps after the warm-up."""
    if "error" in run:
        return run
    out = {"ranks": [], "losses": [s["loss"] for s in run["ranks"][0]["steps"]], "start_line": run["start_line"],
           "experts": run["ranks"][0]["experts"], "experts_implementation": run["ranks"][0]["experts_implementation"]}
    for r in run["ranks"]:
        held = {k: r["params"][k] + r["grads"][k] + r["optimizer"][k] for k in ("experts", "other")}
        window = r["steps"][warmup:] or r["steps"]
        out["ranks"].append({
            "rank": r["rank"], "params": r["params"], "grads": r["grads"], "optimizer": r["optimizer"],
            "held_experts": held["experts"], "held_total": held["experts"] + held["other"],
            "plan_experts": r["plan_experts"], "plan_total": r["plan_total"], "peak_rss": r["peak_rss"],
            "step_wall_s": statistics.median(s["wall_s"] for s in window),
            "step_cpu_s": statistics.median(s["cpu_s"] for s in window)})
    return out


def ratios(results: dict, base: str = "ep1") -> dict:
    """Every run over `base`, rank by rank: held experts bytes, held total, step wall and CPU time."""
    out = {}
    if "error" in results.get(base, {"error": 1}):
        return out
    for name, res in results.items():
        if name == base or "error" in res:
            continue
        out[name] = [{key: other[key] / ref[key] for key in ("held_experts", "held_total", "plan_total",
                                                                "step_wall_s", "step_cpu_s")}
                     for ref, other in zip(results[base]["ranks"], res["ranks"])]
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown(report: dict) -> str:
    lines = [f"## Expert parallelism on CPU, {report['date']}", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`", "",
             f"Model: {report['model']}. Rows: {report['row_length']} tokens, one per rank and step, "
             f"{report['steps']} steps (medians of steps {report['warmup'] + 1}..{report['steps']}), {NPROC} processes "
             "(gloo), plain engine.", "",
             "Bytes each rank holds (MiB; parameters + gradients + AdamW state, from the tensors), the memory plan's "
             "figure beside them, and the step:", "",
             "| run | rank | experts | params (experts / other) | grads (experts / other) | AdamW state (experts / "
             "other) | held: experts | held: total | plan: experts | plan: total | step wall s | step CPU s | "
             "peak RSS MiB |",
             "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in report["results"].items():
        if "error" in res:
            lines.append(f"| {name} | | {res['error']} | | | | | | | | | | |")
            continue
        how = (f"{res['experts']['local']} of {res['experts']['num_experts']} per rank, {res['experts']['kernel']}"
               if res["experts"] else f"all, transformers' {res['experts_implementation']}")
        for r in res["ranks"]:
            pair = lambda d: f"{mib(d['experts'])} / {mib(d['other'])}"  # noqa: E731
            lines.append(f"| {name} | {r['rank']} | {how} | {pair(r['params'])} | {pair(r['grads'])} | "
                         f"{pair(r['optimizer'])} | {mib(r['held_experts'])} | {mib(r['held_total'])} | "
                         f"{mib(r['plan_experts'])} | {mib(r['plan_total'])} | {r['step_wall_s']:.3f} | "
                         f"{r['step_cpu_s']:.3f} | {r['peak_rss'] / 2**20:.0f} |")
    lines += ["", "Ratios to `ep1`, rank 0 / rank 1:", "",
              "| run | held experts | held total | plan total | step wall | step CPU | max rel. loss difference |",
              "|---|---|---|---|---|---|---:|"]
    base = report["results"].get("ep1", {})
    for name, per_rank in report["ratios"].items():
        cell = lambda key: " / ".join(f"{r[key]:.3f}" for r in per_rank)  # noqa: E731
        losses = report["results"][name]["losses"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, base["losses"]))
        lines.append(f"| {name} | {cell('held_experts')} | {cell('held_total')} | {cell('plan_total')} | "
                     f"{cell('step_wall_s')} | {cell('step_cpu_s')} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {list(RUNS)} (ep1 first: the ratios' base)")
    ap.add_argument("--row-length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "moe_ep",
                    help="writes <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.child:
        return run_rank(json.loads(args.child))
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; known: {list(RUNS)}")
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be below --steps {args.steps}")
    from tqdm import tqdm

    from benchmarks.bench_memory import machine_description

    report = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine_description("cpu"),
              "command": "python -m benchmarks.bench_moe " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
              "model": (f"qwen3_moe, {MODEL['num_experts']} experts top-{MODEL['num_experts_per_tok']}, hidden "
                        f"{MODEL['hidden_size']}, moe_intermediate {MODEL['moe_intermediate_size']}, "
                        f"{MODEL['num_hidden_layers']} layers, vocab {VOCAB}, fp32"),
              "row_length": args.row_length, "steps": args.steps, "warmup": args.warmup, "results": {}, "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        work = Path(tmp)
        data = write_rows(work / "packed", NPROC * args.steps, args.row_length, seed=0)
        for name in tqdm(names, desc="runs", unit="run"):
            report["results"][name] = summarize(launch(name, work, data, args.steps, args.timeout), args.warmup)
            report["ratios"] = ratios(report["results"])
            tqdm.write(f"{name}: " + json.dumps({k: v for k, v in report["results"][name].items() if k != "losses"}))
            write_report(args.out, report)  # after every run: one cut short keeps what was measured
    print(markdown(report))


def write_report(out: Path, report: dict) -> None:
    write_atomic(out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), markdown(report))


if __name__ == "__main__":
    main()
