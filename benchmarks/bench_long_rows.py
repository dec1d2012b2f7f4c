"""Peak memory and tokens/s of one training step on a long packed row with each long-row option on and off: activation
checkpointing, tiled MLP (train/model/patches/tiled_mlp.py), activation offload (train/model/patches/offload.py), measured side by
side in one run.

The model has the layer sizes of `--shape` (Qwen2.5-1.5B: hidden 1536, intermediate 8960, 12 / 2 heads, the
151,936-token vocabulary; Llama-3-8B: hidden 4096, intermediate 14336, 32 / 8 heads, 128,256 tokens; `example-tiny`:
configs/model/tiny_qwen2.json, the CPU check's) with `--layers` decoder layers (0: the shape's own), random weights
built on the device, fp32 (`--bf16`: bf16 weights under bf16 autocast), through PackSFT's own path
(`PackedCausalLM`, packed attention on the `sdpa` backend (CPU) or `torch_varlen` (CUDA), chunked loss, AdamW step).
`--lora R` freezes the base weights and trains rank-R adapters on every linear layer (train/model/lora.py), only those in
the optimizer: how an 8B model's row is measured on one 80 GB GPU, whose memory its full fine-tuning state (16 bytes
a parameter, 128 GB) does not fit; the activations of the row, the figure here, are about a full fine-tune's (the
adapters keep every linear layer's input). The row packs sequences of `--sequence` tokens; the last `--trained`
tokens of each sequence carry the loss (an SFT row's answers: the lm head's cost stays small and the body's
activations are what the options change). Each configuration runs in a fresh process; the figure is the process's
peak RSS (`ru_maxrss`) over model build, the step and the optimizer update, or on CUDA the peak allocated GPU
memory. `--steps N` runs N steps and times the last (tokens/s = row / its seconds; the first step carries the
one-time costs). On the CPU the offload keeps each tensor where it is (nothing to move), so it is measured only
where a GPU is used; an offload whose host copies (layers x row x hidden x bytes, each rounded up to a power of two)
would not fit the host's available memory is not started (its cell says why), nor is any run after `--deadline`.

    python -m benchmarks.bench_long_rows --lengths 16384,32768 --out benchmarks/results/long_rows.md
    python -m benchmarks.bench_long_rows --device cuda --shape llama3-8b --layers 0 --bf16 --lora 16 \
        --lengths 262144 --options ckpt+tiled+offload --steps 1 --out long_rows_gpu.md
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
SHAPES = {  # name -> (transformers config class, its fields; num_hidden_layers the published model's)
    "qwen2.5-1.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                         tie_word_embeddings=True)),
    "llama3-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      tie_word_embeddings=False, rope_theta=500000.0)),
    "example-tiny": ("Qwen2Config", "configs/model/tiny_qwen2.json"),
}
OPTIONS = {  # name -> (gradient checkpointing, tiled MLP, activation offload)
    "plain": (False, False, False),
    "tiled": (False, True, False),
    "ckpt": (True, False, False),
    "ckpt+tiled": (True, True, False),
    "ckpt+offload": (True, False, True),
    "ckpt+tiled+offload": (True, True, True),
}


def model_config(shape: str, layers: int | None, max_positions: int):
    """The transformers config of `shape` with `layers` decoder layers (None: the shape's own)."""
    import transformers

    class_name, fields = SHAPES[shape]
    cls = getattr(transformers, class_name)
    if isinstance(fields, str):
        fields = {k: v for k, v in json.loads((ROOT / fields).read_text()).items()
                  if k not in ("transformers_version", "architectures", "model_type")}
    fields = dict(fields, use_cache=False, max_position_embeddings=max(max_positions, fields.get(
        "max_position_embeddings", 0)))
    if layers:
        fields.update(num_hidden_layers=layers, **({"layer_types": None} if "layer_types" in fields else {}))
    return cls(**fields)


def run_step(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    import train.attention.function  # noqa: F401
    from train.model.patches.offload import HostOffload
    from train.attention.function import BACKENDS, AttentionContext, LayerKernels
    from train.plan.memory import default_tile_tokens
    from train.model.packed import PackedCausalLM
    from train.model.patches.tiled_mlp import install_tiled_mlp

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    checkpointing, tiled, offload = OPTIONS[spec["option"]]
    bf16 = spec.get("bf16", False)
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    cfg = model_config(spec.get("shape", "qwen2.5-1.5b"), spec["layers"], spec["sequence"])
    with torch.device(device):  # built where it trains: an 8B model's random init on the CPU takes minutes
        lm = AutoModelForCausalLM.from_config(cfg, attn_implementation="packsft", dtype=dtype)
    tile = default_tile_tokens(cfg.intermediate_size, 2 if bf16 else 4)
    if tiled:
        install_tiled_mlp(lm, tile)
    if checkpointing:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if offload:
            HostOffload().install(lm)
    if spec.get("lora"):
        from train.model.lora import apply_lora

        lm = apply_lora(lm, spec["lora"])
    model = PackedCausalLM(lm, chunk_size=1024, num_categories=1).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

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
    for _ in range(spec.get("steps", 1)):
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids[None], positions[None], targets, weights, torch.zeros_like(targets), attn)[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(peak_bytes=peak, before_step_bytes=before, seconds=seconds, tokens_per_s=n / seconds,
                loss=float(loss), tile=tile, trained_params=sum(p.numel() for p in params))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def table(results: dict, lengths: list[int], options: list[str]) -> list[str]:
    """Peak GiB per option and row length, then each option's ratio to `ckpt` (or to the first option), then the
    same for tokens/s."""
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
    lines += ["", "| row | " + " | ".join(f"{o} tokens/s" for o in options) + " | "
              + " | ".join(f"{o} / {base}" for o in options if o != base) + " |",
              "|---:|" + "---:|" * (2 * len(options) - 1)]
    for length in lengths:
        speed = {o: results[(o, length)].get("tokens_per_s") for o in options}
        cells = [f"{speed[o]:,.0f}" if speed[o] else "–" for o in options]
        ratios = [f"{speed[o] / speed[base]:.2f}" if speed[o] and speed[base] else "–" for o in options if o != base]
        lines.append(f"| {length // 1024}K | " + " | ".join(cells + ratios) + " |")
    return lines


def not_started(spec: dict, deadline: float | None) -> str | None:
    """Why this configuration is not run: the deadline passed, or its offload would not fit the host's memory."""
    if deadline is not None and time.time() >= deadline:
        return "not run: the deadline had passed"
    if OPTIONS[spec["option"]][2] and spec["device"] == "cuda":
        from train.plan import memory as memory_plan

        shape = memory_plan.ModelShape.from_hf_config(model_config(spec["shape"], spec["layers"], spec["sequence"]))
        problem = memory_plan.host_offload_problem(shape, spec["length"], 2 if spec["bf16"] else 4,
                                                   memory_plan.available_host_bytes())
        if problem:
            return f"not run: {problem}"
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--options", default="plain,tiled,ckpt,ckpt+tiled", help=f"of {list(OPTIONS)}")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers; 0: the shape's own")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights under bf16 autocast (default fp32)")
    parser.add_argument("--lora", type=int, default=0,
                        help="rank of adapters on every linear layer, the base frozen (0: every weight trained)")
    parser.add_argument("--steps", type=int, default=1, help="steps per configuration; the last is timed")
    parser.add_argument("--deadline", type=float, help="unix time: no configuration starts after it")
    parser.add_argument("--sequence", type=int, default=2048, help="tokens per packed sequence")
    parser.add_argument("--trained", type=int, default=128, help="trained tokens at the end of each sequence")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--cap-gb", type=float, default=16.0, help="CPU: address-space cap of each child (GiB)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path, help="also write every configuration's result here (a list)")
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
    from benchmarks.bench_train_gpu import write_atomic

    lengths = [int(x) for x in args.lengths.split(",")]
    options = args.options.split(",")
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = {}
    runs = [(option, length) for length in lengths for option in options]
    for option, length in tqdm(runs, desc="configurations"):
        spec = dict(option=option, length=length, layers=args.layers, sequence=args.sequence, trained=args.trained,
                    device=args.device, threads=args.threads, shape=args.shape, bf16=args.bf16, lora=args.lora,
                    steps=args.steps, cap_bytes=int(args.cap_gb * 2**30) if args.device == "cpu" else 0)
        skipped = not_started(spec, args.deadline)
        timeout = args.timeout if args.deadline is None else max(1.0, min(args.timeout, args.deadline - time.time()))
        results[(option, length)] = dict(error=skipped) if skipped else measure(
            spec, timeout, script=Path(__file__).resolve())
        tqdm.write(f"{length:>7} {option:<20} {results[(option, length)]}")
        if args.json:  # after every configuration: a run stopped from outside keeps what was measured
            write_atomic(args.json, json.dumps([dict(option=o, length=n, shape=args.shape, bf16=args.bf16,
                                                     lora=args.lora, **r) for (o, n), r in results.items()]) + "\n")
    tile = next((r["tile"] for r in results.values() if "tile" in r), None)
    metric = "peak allocated GPU memory" if args.device == "cuda" else "peak RSS of the process"
    command = "python -m benchmarks.bench_long_rows " + shlex.join(sys.argv[1:] if argv is None else argv)
    layers = model_config(args.shape, args.layers, args.sequence).num_hidden_layers
    weights = ("bf16 weights under bf16 autocast" if args.bf16 else "fp32") + (
        f", base frozen, rank-{args.lora} adapters on every linear layer trained" if args.lora else "")
    lines = [f"\n## Long rows: {args.shape} layer sizes, {layers} layers, {weights}, {args.device}, {started}\n",
             f"Command: `{command}`  ", f"Machine: {machine_description(args.device)}  ",
             f"Metric: {metric} over the step(s) (forward, backward, AdamW update; on the CPU the model build too), "
             f"a fresh process per configuration" + (f", capped at {args.cap_gb:g} GiB of address space" if args.device == "cpu" else "")
             + f"; rows of {args.sequence}-token sequences, the last {args.trained} of each trained; tiled "
             f"MLP tile {tile} tokens (the default for {'bf16' if args.bf16 else 'fp32'}). Cells: `GiB (seconds of "
             f"the step)`, then ratios; then tokens/s of the last of {args.steps} step(s) per configuration.\n"]
    lines += table(results, lengths, options)
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(section)


if __name__ == "__main__":
    main()
