"""Tiny hybrid models on one packed row: recurrent mixers in one call over the row (train/model/patches/recurrent.py's one-call
forms, boundary-restarting kernels) against once per packed sequence (the path before them), side by side.

For each mixer kind a random-init hybrid model is built from its config (never downloaded): one recurrent layer and
one attention layer, hidden 256, the mixer at the shapes of a small real model (MIXERS). For each number of
sequences in a row of `--tokens` tokens (equal lengths), each path runs in a fresh process: one training step
(forward + backward, next-token loss) of the whole model with the packsft attention and the recurrent boundaries
set, exactly as the trainer calls it. Measured there: the peak memory of the first step (CPU: growth of the peak
resident set, `getrusage`; CUDA: peak allocated above what the model and inputs hold), then the best time of
`--repeats` more. The two paths' losses and every parameter's gradient are compared (the largest relative
difference is printed, gradients measured as tests/train/model/patches/test_recurrent.py measures them: both compute each sequence
alone).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_recurrent --out benchmarks/results/recurrent.md
    python -m benchmarks.bench_recurrent --device cuda --sequences 1 16 256 1024

On CPU each child runs one torch thread and its address space is capped (`--cap-gb`, RLIMIT_AS), so that a
configuration too large for the machine fails inside its own process (reported as "OOM > cap"); on CUDA a child
that runs out of GPU memory is reported the same way. The "one call" path uses the fused kernels (causal-conv1d,
mamba-ssm, flash-linear-attention) where they are installed on CUDA, the torch forms elsewhere.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 256
VOCAB = 1024
# kind -> (model type, config settings on top of tests/model_zoo.py's tiny config): one recurrent + one attention layer
MIXERS = {
    "mamba2": ("granitemoehybrid", dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=64,
                                        mamba_d_state=128, mamba_n_groups=1, mamba_chunk_size=256)),
    "gated_delta_rule": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"],
                                            linear_num_key_heads=4, linear_num_value_heads=8,
                                            linear_key_head_dim=64, linear_value_head_dim=64)),
    "kda": ("kimi_linear", dict(linear_num_heads=8, linear_head_dim=64)),
    "short_conv": ("lfm2", dict(layer_types=["conv", "full_attention"])),
}
PATHS = ("per_sequence", "one_call")


# ---------------------------------------------------------------------------------------------- child
def build_model(kind: str, device: str):
    from transformers import AutoModelForCausalLM

    import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")
    from tests.model_zoo import tiny_config

    model_type, settings = MIXERS[kind]
    config = tiny_config(model_type, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, vocab_size=VOCAB,
                         max_position_embeddings=1 << 20, **settings)
    import torch

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, attn_implementation="packsft", dtype=torch.float32)
    return lm.to(device).train()


def run_child(kind: str, sequences: int, path: str, tokens: int, repeats: int, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from train.model.patches import recurrent
    from train.attention.function import BACKENDS, AttentionContext, LayerKernels

    torch.set_num_threads(1)
    if path == "per_sequence":
        recurrent.ONE_CALL.clear()  # every mixer once per packed sequence, as before the one-call forms
    lm = build_model(kind, device)
    layers = recurrent.install_sequence_restart(lm)
    wrappers = [m for m in lm.modules() if isinstance(m, recurrent.SequenceRestart)]
    assert wrappers and all(w.one_call == (path == "one_call") for w in wrappers), [repr(w) for w in wrappers]

    cuts = [tokens * i // sequences for i in range(sequences + 1)]
    lengths = [hi - lo for lo, hi in zip(cuts[:-1], cuts[1:])]
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (1, tokens), generator=g).to(device)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    labels = input_ids.clone()
    labels[0, torch.tensor(cuts[1:]) - 1] = -100  # no sequence predicts the next one's first token
    kernels = LayerKernels(every=BACKENDS["sdpa" if device == "cpu" else "torch_varlen"])
    attn = AttentionContext(torch.tensor(cuts, dtype=torch.int32, device=device), max(lengths), kernels)

    def step():
        lm.zero_grad(set_to_none=True)
        layers.set_row(attn.bounds)
        hidden = lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, packsft=attn)
        logits = lm.lm_head(hidden.last_hidden_state[0, :-1])
        loss = F.cross_entropy(logits, labels[0, 1:], ignore_index=-100)
        loss.backward()
        return loss.detach()

    cuda = device != "cpu"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    else:
        held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss = step()
    if cuda:
        torch.cuda.synchronize()
        peak_mib = (torch.cuda.max_memory_allocated() - held) / 2**20
    else:
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - held) / 1024
    grads = {name: p.grad.detach().cpu() for name, p in lm.named_parameters() if p.grad is not None}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    torch.save({"loss": loss.cpu(), "grads": grads}, os.environ["BENCH_RECURRENT_OUT"])
    return {"peak_mib": peak_mib, "step_s": min(times), "mixer": type(wrappers[0].mixer).__name__}


# --------------------------------------------------------------------------------------------- parent
OUT_OF_MEMORY = ("can't allocate memory", "MemoryError", "OutOfMemoryError", "out of memory")


def measure(kind: str, sequences: int, path: str, args, scratch: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "BENCH_RECURRENT_OUT": str(scratch / f"{kind}-{sequences}-{path}.pt")}
    command = [sys.executable, "-m", "benchmarks.bench_recurrent", "--child", kind, str(sequences), path,
               "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--device", args.device]
    cap = int(args.cap_gb * (1 << 30))
    limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap))) if args.device == "cpu" else None
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=limit)
    if done.returncode != 0:
        if any(sign in done.stderr for sign in OUT_OF_MEMORY):
            return {"oom": True}
        raise RuntimeError(f"{kind} {sequences} {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def difference(kind: str, sequences: int, scratch: Path) -> float:
    """The largest relative difference between the two paths: the loss, and each parameter's gradient as the
    conformance suite measures it (against the larger of its own largest entry and GRAD_FLOOR of the largest
    gradient)."""
    from train.checkpoint import safe_load
    from train.model.self_check import GRAD_FLOOR

    loop, one = (safe_load(scratch / f"{kind}-{sequences}-{path}.pt") for path in PATHS)
    scale = max(float(grad.abs().max()) for grad in loop["grads"].values())
    differences = [float((one["loss"] - loop["loss"]).abs() / loop["loss"].abs())]
    for name, grad in loop["grads"].items():
        norm = max(float(grad.abs().max()), GRAD_FLOOR * scale, 1e-30)
        differences.append(float((one["grads"][name] - grad).abs().max()) / norm)
    return max(differences)


HEADER = ("| mixer | sequences × tokens | peak MiB: per sequence | one call | ratio | step s: per sequence | one call "
          "| ratio | max relative difference |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def format_row(kind: str, sequences: int, tokens: int, result: dict, diff: float | None) -> str:
    loop, one = result["per_sequence"], result["one_call"]
    shape = f"{sequences} × {tokens // sequences}"
    if loop.get("oom") or one.get("oom"):
        cells = ["OOM" if r.get("oom") else f"{r['peak_mib']:.0f}" for r in (loop, one)]
        return f"| {kind} | {shape} | {cells[0]} | {cells[1]} | | | | | |"
    return (f"| {kind} ({one['mixer']}) | {shape} | {loop['peak_mib']:.0f} | {one['peak_mib']:.0f} | "
            f"{loop['peak_mib'] / max(one['peak_mib'], 1):.1f} | {loop['step_s']:.3f} | {one['step_s']:.3f} | "
            f"{loop['step_s'] / one['step_s']:.1f} | {diff:.1e} |")


def machine(device: str) -> str:
    import torch
    import transformers

    if device == "cpu":
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor() or platform.machine())
        where = f"{cpu}, {os.cpu_count()} CPU threads, one torch thread per process"
    else:
        where = torch.cuda.get_device_name(device)
    return f"{where}; torch {torch.__version__}, transformers {transformers.__version__}"


def section(args, table: str) -> str:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    prefix = "OMP_NUM_THREADS=1 " if args.device == "cpu" else ""
    command = f"{prefix}python -m benchmarks.bench_recurrent {shlex.join(sys.argv[1:])}"
    memory = ("peak RSS growth over the first step" if args.device == "cpu"
              else "peak allocated above model and inputs over the first step")
    return (
        f"\n## {args.tokens}-token rows, fp32, {args.device}, {now}\n\n"
        f"Command: `{command}`  \n"
        f"Machine: {machine(args.device)}  \n"
        f"Metric: one training step of the whole model, fresh process per cell; {memory}; step time the best of "
        f"{args.repeats} further steps; ratios = per sequence / one call; OOM: over the {args.cap_gb:g} GiB "
        "address-space cap (CPU) or the GPU's memory.\n\n"
        f"{table}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--kinds", nargs="+", default=list(MIXERS), choices=list(MIXERS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or a CUDA device (cuda, cuda:1)")
    parser.add_argument("--cap-gb", type=float, default=12.0, help="address-space cap of each CPU child")
    parser.add_argument("--out", type=Path, help="append a markdown section to this file")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SEQUENCES", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, sequences, path = args.child
        print(json.dumps(run_child(kind, int(sequences), path, args.tokens, args.repeats, args.device)))
        return

    from tqdm import tqdm

    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_recurrent_{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    cells = [(kind, sequences) for kind in args.kinds for sequences in args.sequences]
    rows = []
    for kind, sequences in tqdm(cells, desc="cells", unit="cell"):
        result = {path: measure(kind, sequences, path, args, scratch) for path in PATHS}
        both = not any(r.get("oom") for r in result.values())
        rows.append(format_row(kind, sequences, args.tokens, result,
                               difference(kind, sequences, scratch) if both else None))
        tqdm.write(rows[-1])
    table = "\n".join([HEADER, *rows])
    if args.out:
        with args.out.open("a") as f:
            f.write(section(args, table))
    print(table)


if __name__ == "__main__":
    main()
