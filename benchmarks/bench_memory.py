"""Peak memory of one training step (forward + backward + AdamW step) per row length, chunked vs unchunked loss,
with and without activation checkpointing; and the longest row that fits a memory budget.

Each configuration runs in a fresh subprocess (peaks do not leak between configurations): on CPU the peak RSS
of that process (`resource.getrusage`), on CUDA `torch.cuda.max_memory_allocated`, plus tokens/s of the step.
The model is a randomly initialised Qwen2 of the chosen shape; the row is one sequence of random tokens, every
position trained (the worst case for the loss), token reduction.

    python -m benchmarks.bench_memory --shape small-152k --lengths 4096,8192,16384 \
        --out benchmarks/results/memory.md
    python -m benchmarks.bench_memory --shape qwen2.5-0.5b --lengths 16384,32768,65536,131072 --dtype bf16 \
        --budget-gb 80 --search chunked+ckpt

On CPU the child's address space is capped (`--cap-gb`, RLIMIT_AS) so that a configuration too large for the
machine fails with an allocation error inside its own process (reported as "OOM > cap") instead of waking
the kernel's OOM killer on a shared machine.
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

# Qwen2-shaped configurations (random weights). small-152k: few layers, the real 152K vocabulary.
SHAPES = {
    "small-152k": dict(vocab_size=151936, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}
MODES = {  # name -> (chunked loss, activation checkpointing)
    "unchunked": (False, False),
    "unchunked+ckpt": (False, True),
    "chunked": (True, False),
    "chunked+ckpt": (True, True),
}


# ---------------------------------------------------------------------------------------------- child
def run_step(spec: dict) -> dict:
    """One training step in this process; returns the measured figures."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    from train.model.loss import weighted_lm_loss

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[spec["shape"]], max_position_embeddings=max(spec["length"], 32768),
                      attn_implementation="sdpa", use_cache=False)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    model.train()
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    chunk_size = spec["chunk_size"] if spec["chunked"] else None

    n = spec["length"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
    targets = torch.full((n,), -100, dtype=torch.long)
    targets[:-1] = ids[0, 1:]
    weights = (targets != -100).float() / (n - 1)
    categories = torch.zeros(n, dtype=torch.long)
    ids, targets, weights, categories = (t.to(device) for t in (ids, targets, weights, categories))
    positions = torch.arange(n, device=device).unsqueeze(0)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    loss, _, _ = weighted_lm_loss(hidden[0], model.lm_head.weight, targets, weights, categories, 1, chunk_size)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(peak_bytes=int(peak), before_step_bytes=int(base), seconds=seconds, tokens_per_s=n / seconds,
                loss=float(loss), n_params=sum(p.numel() for p in model.parameters()))


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec["device"] == "cpu" and spec.get("cap_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (spec["cap_bytes"], spec["cap_bytes"]))
    try:
        result = run_step(spec)
    except (MemoryError, RuntimeError) as exc:  # torch raises RuntimeError / OutOfMemoryError on failed allocs
        msg = str(exc)
        if not isinstance(exc, MemoryError) and "memory" not in msg.lower() and "alloc" not in msg.lower():
            raise
        result = dict(oom=True, error=msg.splitlines()[0][:200] if msg else type(exc).__name__)
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------- parent
def measure(spec: dict, timeout: float, script: Path | None = None) -> dict:
    """Run `script --child SPEC` (default: this file) in a fresh process; the dict its `RESULT ` line prints, or
    an error (a kill by the OOM killer as `oom`)."""
    cmd = [sys.executable, str(script or Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    if proc.returncode in (-9, 137):
        return dict(oom=True, error="killed (out of memory)")
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(error=f"exit {proc.returncode}: {' | '.join(tail)[:300]}")


def fits(result: dict, budget_bytes: int) -> bool:
    return "peak_bytes" in result and result["peak_bytes"] <= budget_bytes


def longest_fitting(base_spec: dict, budget_bytes: int, step: int, max_len: int, timeout: float, log) -> tuple[int, dict]:
    """Binary search over multiples of `step` for the longest row whose step peaks within the budget."""
    lo, hi, best = 0, max_len // step, {}
    while lo < hi:
        mid = (lo + hi + 1) // 2
        res = measure(dict(base_spec, length=mid * step), timeout)
        log(f"  search {mid * step:>7} tokens: {describe(res)}")
        if fits(res, budget_bytes):
            lo, best = mid, res
        else:
            hi = mid - 1
    return lo * step, best


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def describe(res: dict) -> str:
    if res.get("oom"):
        return "OOM > cap"
    if "error" in res:
        return "error: " + res["error"]
    return f"{gib(res['peak_bytes'])} GiB, {res['tokens_per_s']:.0f} tok/s"


def machine_description(device: str) -> str:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} CPU threads, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, torch {torch.__version__}"
    if device == "cuda":
        desc += f", {torch.cuda.get_device_name(0)}"
    return desc


def write_atomic_append(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(old + text)
    os.replace(tmp, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small-152k")
    ap.add_argument("--lengths", default="4096,8192,16384", help="comma-separated row lengths (tokens)")
    ap.add_argument("--modes", default="unchunked,chunked,chunked+ckpt", help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--chunk-size", type=int, default=1024, help="tokens per lm-head/cross-entropy chunk")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--cap-gb", type=float, default=12.0, help="CPU: address-space cap of each child (GiB)")
    ap.add_argument("--budget-gb", type=float, default=None, help="find the longest row whose peak fits this")
    ap.add_argument("--search", default="chunked+ckpt", help="comma-separated modes searched with --budget-gb")
    ap.add_argument("--search-step", type=int, default=4096)
    ap.add_argument("--search-max", type=int, default=262144)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--out", type=Path, default=None, help="append the markdown section to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child_main(args.child)

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes + [m for m in args.search.split(",") if m]:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {list(MODES)}")
    cap = int(args.cap_gb * 2**30) if device == "cpu" else 0

    def spec(mode, length):
        chunked, ckpt = MODES[mode]
        return dict(shape=args.shape, length=length, chunked=chunked, checkpointing=ckpt, chunk_size=args.chunk_size,
                    dtype=args.dtype, device=device, cap_bytes=cap)

    lines = []

    def log(msg):
        print(msg, flush=True)

    command = "python -m benchmarks.bench_memory " + shlex.join(sys.argv[1:] if argv is None else argv)
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = {}
    for length in lengths:
        for mode in modes:
            res = measure(spec(mode, length), args.timeout)
            results[(mode, length)] = res
            log(f"{length:>7} {mode:<15} {describe(res)}")

    metric = "peak GPU memory allocated" if device == "cuda" else "peak RSS of the process"
    lines.append(f"\n## {args.shape}, {args.dtype}, {device}, {started}\n")
    lines.append(f"Command: `{command}`  ")
    lines.append(f"Machine: {machine_description(device)}  ")
    lines.append(f"Metric: {metric} over one training step (forward + backward + AdamW step), fresh process per "
                 f"configuration, chunk size {args.chunk_size}; cells read `GiB (tokens/s)`."
                 + (f" CPU children capped at {args.cap_gb:g} GiB of address space." if cap else "") + "\n")
    if lengths and modes:
        lines.append("| row length | " + " | ".join(modes) + " |")
        lines.append("|---:|" + "---:|" * len(modes))
    for length in lengths:
        cells = []
        for mode in modes:
            res = results[(mode, length)]
            if "peak_bytes" in res:
                cells.append(f"{gib(res['peak_bytes'])} ({res['tokens_per_s']:.0f})")
            else:
                cells.append(f"OOM > {args.cap_gb:g} GiB cap" if res.get("oom") and cap else describe(res))
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    first = next((r for r in results.values() if "n_params" in r), None)
    if first:
        lines.append(f"\nModel: {first['n_params'] / 1e6:.1f}M parameters; memory before the step "
                     f"(model + inputs) {gib(first['before_step_bytes'])} GiB in the first cell.")

    if args.budget_gb:
        budget = int(args.budget_gb * 2**30)
        lines.append(f"\nLongest row whose step fits {args.budget_gb:g} GiB (binary search, multiples of "
                     f"{args.search_step}, up to {args.search_max}):\n")
        for mode in [m for m in args.search.split(",") if m]:
            log(f"searching the longest row for {mode} within {args.budget_gb:g} GiB")
            base = spec(mode, 0)
            best_len, best = longest_fitting(base, budget, args.search_step, args.search_max, args.timeout, log)
            if best_len:
                lines.append(f"- {mode}: {best_len} tokens ({describe(best)})")
            else:
                lines.append(f"- {mode}: < {args.search_step} tokens (no probed length fits)")

    section = "\n".join(lines) + "\n"
    print(section)
    if args.out:
        write_atomic_append(args.out, section)


if __name__ == "__main__":
    main()
