"""Peak memory of one training step on a long packed row with each long-row option on and off: activation
checkpointing, tiled MLP (train/tiled_mlp.py), activation offload (train/activation_offload.py), measured side by
side in one run.

The model has Qwen2.5-1.5B's layer sizes (hidden 1536, intermediate 8960, 12 / 2 heads, the 151,936-token
vocabulary) with `--layers` decoder layers, random weights, fp32, through PackSFT's own path (`PackedCausalLM`,
packed attention on the `sdpa` backend, chunked loss, AdamW step). The row packs sequences of `--sequence` tokens;
the last `--trained` tokens of each sequence carry the loss (an SFT row's answers: the lm head's cost stays small and
the body's activations are what the options change). Each configuration runs in a fresh process; the figure is the
process's peak RSS (`ru_maxrss`) over model build, the step and the optimizer update. On the CPU the offload keeps
each tensor where it is (nothing to move), so it is measured only where a GPU is used (`--device cuda`: peak
allocated GPU memory).

    python -m benchmarks.bench_long_rows --lengths 16384,32768 --out benchmarks/results/long_rows.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN25_15B_LAYER = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                        num_key_value_heads=2, tie_word_embeddings=True)
OPTIONS = {  # name -> (gradient checkpointing, tiled MLP, activation offload)
    "plain": (False, False, False),
    "tiled": (False, True, False),
    "ckpt": (True, False, False),
    "ckpt+tiled": (True, True, False),
    "ckpt+offload": (True, False, True),
    "ckpt+tiled+offload": (True, True, True),
}


def run_step(spec: dict) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    import train.attention  # noqa: F401
    from train.activation_offload import HostOffload
    from train.attention import BACKENDS, AttentionContext, LayerKernels
    from train.memory_plan import default_tile_tokens
    from train.packed_model import PackedCausalLM
    from train.tiled_mlp import install_tiled_mlp

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    checkpointing, tiled, offload = OPTIONS[spec["option"]]
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN25_15B_LAYER, num_hidden_layers=spec["layers"], max_position_embeddings=spec["sequence"],
                      use_cache=False)
    lm = Qwen2ForCausalLM._from_config(cfg, attn_implementation="packsft", dtype=torch.float32).to(device)
    tile = default_tile_tokens(cfg.intermediate_size, 4)
    if tiled:
        install_tiled_mlp(lm, tile)
    if checkpointing:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if offload:
            HostOffload().install(lm)
    model = PackedCausalLM(lm, chunk_size=1024, num_categories=1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    n, seq = spec["length"], spec["sequence"]
    lengths = [seq] * (n // seq) + ([n % seq] if n % seq else [])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
    targets = torch.full((n,), -100, dtype=torch.long)
    start = 0
    for length in lengths:
        trained = slice(start + max(0, length - spec["trained"]), start + length - 1)
        targets[trained] = ids[trained.start + 1:trained.stop + 1]
        start += length
    weights = (targets != -100).float() / int((targets != -100).sum())
    positions = torch.cat([torch.arange(length) for length in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids, targets, weights, positions = (t.to(device) for t in (ids, targets, weights, positions))
    kernel = BACKENDS["sdpa" if device.type == "cpu" else "torch_varlen"]
    attn = AttentionContext.for_micro_batch(cu, device, LayerKernels(every=kernel))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    loss = model(ids[None], positions[None], targets, weights, torch.zeros_like(targets), attn)[0]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(peak_bytes=peak, before_step_bytes=before, seconds=seconds, loss=float(loss), tile=tile)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def table(results: dict, lengths: list[int], options: list[str]) -> list[str]:
    """Peak GiB per option and row length, then each option's ratio to `ckpt` (or to the first option)."""
    base = "ckpt" if "ckpt" in options else options[0]
    lines = ["| row | " + " | ".join(f"{o} GiB (s)" for o in options) + " | "
             + " | ".join(f"{o} / {base}" for o in options if o != base) + " |",
             "|---:|" + "---:|" * (2 * len(options) - 1)]
    for length in lengths:
        cells, ratios = [], []
        for option in options:
            res = results[(option, length)]
            cells.append(f"{gib(res['peak_bytes'])} ({res['seconds']:.0f})" if "peak_bytes" in res else res["error"])
        ref = results[(base, length)].get("peak_bytes")
        for option in options:
            if option != base:
                peak = results[(option, length)].get("peak_bytes")
                ratios.append(f"{peak / ref:.2f}" if peak and ref else "–")
        lines.append(f"| {length // 1024}K | " + " | ".join(cells + ratios) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--options", default="plain,tiled,ckpt,ckpt+tiled", help=f"of {list(OPTIONS)}")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=2048, help="tokens per packed sequence")
    parser.add_argument("--trained", type=int, default=128, help="trained tokens at the end of each sequence")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--cap-gb", type=float, default=16.0, help="CPU: address-space cap of each child (GiB)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        if spec["cap_bytes"]:  # an allocation past the cap fails in this process, not the machine's OOM killer
            resource.setrlimit(resource.RLIMIT_AS, (spec["cap_bytes"], spec["cap_bytes"]))
        try:
            result = run_step(spec)
        except (MemoryError, RuntimeError) as exc:
            message = str(exc).lower()
            if not isinstance(exc, MemoryError) and "alloc" not in message and "memory" not in message:
                raise
            result = dict(error=f"out of memory (> {spec['cap_bytes'] / 2**30:g} GiB cap)")
        print("RESULT " + json.dumps(result), flush=True)
        return
    from tqdm import tqdm

    from benchmarks.bench_memory import machine_description, measure

    lengths = [int(x) for x in args.lengths.split(",")]
    options = args.options.split(",")
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = {}
    runs = [(option, length) for length in lengths for option in options]
    for option, length in tqdm(runs, desc="configurations"):
        spec = dict(option=option, length=length, layers=args.layers, sequence=args.sequence, trained=args.trained,
                    device=args.device, threads=args.threads,
                    cap_bytes=int(args.cap_gb * 2**30) if args.device == "cpu" else 0)
        results[(option, length)] = measure(spec, args.timeout, script=Path(__file__).resolve())
        tqdm.write(f"{length:>7} {option:<20} {results[(option, length)]}")
    tile = next((r["tile"] for r in results.values() if "tile" in r), None)
    metric = "peak allocated GPU memory" if args.device == "cuda" else "peak RSS of the process"
    command = "python -m benchmarks.bench_long_rows " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [f"\n## Long rows: Qwen2.5-1.5B layer sizes, {args.layers} layers, fp32, {args.device}, {started}\n",
             f"Command: `{command}`  ", f"Machine: {machine_description(args.device)}  ",
             f"Metric: {metric} over one step (model build, forward, backward, AdamW update), a fresh process per "
             f"configuration" + (f", capped at {args.cap_gb:g} GiB of address space" if args.device == "cpu" else "")
             + f"; rows of {args.sequence}-token sequences, the last {args.trained} of each trained; tiled "
             f"MLP tile {tile} tokens (the default for fp32). Cells: `GiB (seconds of the step)`, then ratios.\n"]
    lines += table(results, lengths, options)
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(section)


if __name__ == "__main__":
    main()
