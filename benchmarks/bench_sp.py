"""Sequence parallelism on CPU: `shard_batch` cost and the `torch` backend's attention, varlen path vs mask path.

1. `shard_batch` of one 131,072-token micro-batch (64 packed sequences of 2,048 tokens, built with
   `train.steps.batch.make_batch`), one thread, best of 5, per layout and sp size.
2. the `torch` gather backend's attention (as train/plan/attention.py gives it to a layer) forward + backward of
   one rank of a packed row (seeded random sequence lengths), one process:
   the all-gather is replaced by the row's K/V (what the collective returns), so only the attention is timed.
   "varlen" is the contiguous-layout path (bounds from `shard_batch`, one kernel call: the SDPA loop on CPU);
   "mask" is the boolean-mask path of the same context (`bounds=None`), what the contiguous layout ran before.
   Both outputs are compared (max abs difference).
3. Exactness: the multi-process world of tests/train/attention/test_sequence_parallel.py (4 gloo processes, 23 configurations),
   worst relative errors against the single-process run, per attention path of the torch backend.

    python -m benchmarks.bench_sp --out benchmarks/results/sp_bench.md

4. `--compare`: bytes moved per layer and rank and per-rank peak memory of one attention layer (forward +
   backward) for Ulysses, the hybrid (Ulysses 2 x torch gather), the `torch` gather backend and the ring-flash-attn
   backends, versus row length L, heads H and sp, in one spawned world of 4 gloo processes (sp = 2: two groups
   side by side). Bytes are counted from the collectives the backends issue (`dist.all_gather`, `all_reduce`,
   `all_to_all_single`, `reduce_scatter` wrapped): what a rank receives under the usual algorithms (all-gather
   (p-1)·n, all-to-all n·(p-1)/p, ring all-reduce 2·n·(p-1)/p, reduce-scatter n·(p-1)/p for an n-byte input).
   The ring backends need CUDA: their bytes are computed from their algorithms, not measured. Peak memory: the
   peak of live CPU tensor bytes during the layer above what existed before it (the autograd profiler's per-operator
   allocations in time order), on the rank with the largest peak.

    python -m benchmarks.bench_sp --compare --out benchmarks/results/sp_ulysses.md

5. `--limits`: the longest row per GPU each backend allows for Qwen2.5 0.5B / 1.5B / 7B shapes, COMPUTED from the
   memory model of train/plan/memory.py (80 GB GPUs, 10% headroom, bf16, DeepSpeed ZeRO-3 over the 8 ranks,
   gradient checkpointing, fused attention kernels: no L² term) plus each backend's per-layer transient buffers
   (`sp_transient_bytes`); nothing is measured.

    python -m benchmarks.bench_sp --limits
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train.attention.sequence_parallel as sequence_parallel  # noqa: E402
from train.steps.batch import StepTotals, make_batch  # noqa: E402
from train.attention.function import BACKENDS, AttentionContext, LayerKernels  # noqa: E402
from train.plan.attention import ring_kernel  # noqa: E402
from train.attention.sequence_parallel import shard_batch  # noqa: E402
from train.attention.varlen_kernels import NO_FEATURES  # noqa: E402


def _row(lengths: list[int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    total = int(sum(lengths))
    ids = rng.integers(1, 1000, size=total).astype(np.int32)
    labels = ids.copy()
    labels[np.cumsum(lengths) - np.array(lengths)] = -100  # no token predicts a sequence's first token
    return {"input_ids": ids, "labels": labels, "category_ids": np.zeros(total, np.int16),
            "turn_ids": np.ones(total, np.int16), "seq_lens": np.array(lengths)}


def _best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def shard_cost() -> list[str]:
    row = _row([2048] * 64, seed=0)
    batch = make_batch([row], StepTotals(131_072 - 64, 64, 64), "token")
    lines = ["| layout | sp = 2 | sp = 8 |", "|---|---|---|"]
    for layout in ("contiguous", "zigzag"):
        cells = [f"{_best_ms(lambda: shard_batch(batch, sp - 1, sp, 'torch', layout=layout), 5):.1f} ms"
                 for sp in (2, 8)]
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    return lines


def attention_time(total: int, sp: int, rank: int, heads: int, kv_heads: int, dim: int) -> tuple[float, float, float]:
    gen = np.random.default_rng(1)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(min(gen.integers(64, 1024), total - sum(lengths))))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    _, ctx = shard_batch({"input_ids": torch.zeros(1, total, dtype=torch.long), "cu_seqlens": cu}, rank, sp, "torch")
    torch.manual_seed(0)
    q, k, v = (torch.randn(ctx.padded_length, h, dim) for h in (heads, kv_heads, kv_heads))
    start, end = ctx.local_range
    row_kv = {1: torch.stack([k, v]), 2: torch.cat([k, v], 1).transpose(0, 1).unsqueeze(0)}  # per gather layout

    def local_gather(kv, group, dim):
        """What the all-gather returns: the row's K/V, this rank's part being its own (autograd) tensor."""
        row = row_kv[dim]
        return torch.cat([row.narrow(dim, 0, start), kv, row.narrow(dim, end, row.shape[dim] - end)], dim=dim)

    sequence_parallel._GatherSequence.apply = staticmethod(local_gather)
    gather = ring_kernel("torch", q, NO_FEATURES, structure=False)
    outs = {}

    def run(context):
        inputs = [t[start:end].transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v)]
        attn = AttentionContext(context.cu_seqlens, context.max_seqlen, sp=context)
        out = gather.fn(*inputs, attn, dim ** -0.5, NO_FEATURES, None)
        out.square().sum().backward()
        outs[context.bounds is not None] = out.detach()

    varlen_ms = _best_ms(lambda: run(ctx), 3)
    mask_ms = _best_ms(lambda: run(dataclasses.replace(ctx, bounds=None)), 3)
    return varlen_ms, mask_ms, float((outs[True] - outs[False]).abs().max())


def exactness() -> list[str]:
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from tests._sp_worker import worker

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        mp.spawn(worker, args=(4, port, str(out)), nprocs=4, join=True)
        results = json.loads(out.read_text())
    lines = ["| path | configurations | loss | category sums | gradients |", "|---|---|---|---|---|"]
    for path in ("varlen", "mask"):
        chosen = [r for r in results.values() if r["path"] == path]
        worst = {key: max(r[key] for r in chosen) for key in ("loss", "cat_sum", "grad")}
        lines.append(f"| {path} | {len(chosen)} | {worst['loss']:.1e} | {worst['cat_sum']:.1e} | {worst['grad']:.1e} |")
    return lines


# ---------------------------------------------------------------------------------------------- --compare
COMPARE_CASES = [  # (row tokens L, heads H, kv heads, sp)
    (4096, 8, 2, 2), (4096, 8, 2, 4), (16384, 8, 2, 4), (16384, 16, 16, 4), (16384, 32, 8, 4),
]
HEAD_DIM = 64
BYTES = 4  # fp32 on CPU


class CollectiveCounter:
    """Wraps torch.distributed's collectives in this process and adds up what this rank receives, per phase."""

    def __init__(self):
        import torch.distributed as dist

        self.phase = "forward"
        self.received = {"forward": 0, "backward": 0}
        self.calls = {"forward": [], "backward": []}
        received = {
            "all_gather": lambda args, p: (p - 1) * _nbytes(args[1]),
            "all_to_all_single": lambda args, p: _nbytes(args[1]) * (p - 1) // p,
            "all_reduce": lambda args, p: 2 * _nbytes(args[0]) * (p - 1) // p,
            "reduce_scatter": lambda args, p: sum(_nbytes(t) for t in args[1]) * (p - 1) // p,
        }
        for name, count in received.items():
            setattr(dist, name, self._counting(name, getattr(dist, name), count))

    def _counting(self, name, collective, count):
        import torch.distributed as dist

        def wrapped(*args, group=None, **kwargs):
            size = dist.get_world_size(group)
            self.received[self.phase] += count(args, size)
            self.calls[self.phase].append(name)
            return collective(*args, group=group, **kwargs)

        return wrapped


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _peak_bytes(run) -> int:
    """Peak of live CPU tensor bytes while `run()` executes, above the start (per-operator net allocations and
    the frees between operators, in time order)."""
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
        run()
    events = sorted(prof.function_events, key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _packed_lengths(total: int, seed: int) -> list[int]:
    gen = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(min(gen.integers(64, 2048), total - sum(lengths))))
    return lengths


def _layer(backend: str, total: int, heads: int, kv_heads: int, sp: int, groups: dict, counter: CollectiveCounter):
    """Forward + backward of one attention layer on this rank under `backend`; (bytes fwd, bytes bwd, peak)."""
    import torch.distributed as dist

    from train.attention.ulysses import UlyssesSpec, ulysses_attention, ulysses_shard

    rank = dist.get_rank()
    sp_rank = rank % sp
    group = groups["world"] if sp == 4 else groups["pairs"][rank // 2]
    lengths = _packed_lengths(total, seed=total + heads)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.long), "cu_seqlens": cu}
    gather = ring_kernel("torch", torch.empty(0), NO_FEATURES, structure=False)  # what the plan gives on CPU
    if backend == "gather":
        _, ctx = shard_batch(batch, sp_rank, sp, "torch", group=group)
        attention = gather.fn
    else:
        if backend == "ulysses":  # the packed attention on the whole row
            spec = UlyssesSpec(size=sp, group=group, local=LayerKernels(every=BACKENDS["sdpa"]))
        else:  # the gather backend across the Ulysses groups
            spec = UlyssesSpec(size=2, group=groups["pairs"][rank // 2], ring_group=groups["rings"][rank % 2],
                               local=LayerKernels(every=gather))
        _, ctx = ulysses_shard(batch, sp_rank, sp, spec, group=group)
        attention = ulysses_attention
    attn = AttentionContext(ctx.cu_seqlens, ctx.max_seqlen, sp=ctx)
    torch.manual_seed(rank)
    local = ctx.local_length
    q, k, v = (torch.randn(1, h, local, HEAD_DIM, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    counter.received = {"forward": 0, "backward": 0}

    def run():
        counter.phase = "forward"
        out = attention(q, k, v, attn, HEAD_DIM ** -0.5, NO_FEATURES, None)
        counter.phase = "backward"
        out.square().sum().backward()

    dist.barrier()
    peak = _peak_bytes(run)
    return counter.received["forward"], counter.received["backward"], peak


def ring_bytes(total: int, kv_heads: int, sp: int) -> tuple[int, int]:
    """(forward, backward) bytes a rank receives per layer under ring-flash-attn, computed from its algorithms
    (the same for both): llama3 all-gathers the row's K/V in forward (in heads_k_stride slices: the same bytes),
    again in backward, then reduce-scatters dK/dV; zigzag passes the K/V blocks around the ring (sp - 1 steps) in
    forward, K/V and dK/dV in backward."""
    kv_block = total // sp * 2 * kv_heads * HEAD_DIM * BYTES  # one rank's K and V
    return (sp - 1) * kv_block, 2 * (sp - 1) * kv_block


def compare_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    import json
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=600))
    try:
        groups = {"world": dist.group.WORLD, "pairs": [dist.new_group([0, 1]), dist.new_group([2, 3])],
                  "rings": [dist.new_group([0, 2]), dist.new_group([1, 3])]}
        counter = CollectiveCounter()
        results = []
        for total, heads, kv_heads, sp in COMPARE_CASES:
            for backend in ("ulysses", "hybrid", "gather"):
                if backend == "hybrid" and sp != 4:
                    continue
                fwd, bwd, peak = _layer(backend, total, heads, kv_heads, sp, groups, counter)
                worst = torch.tensor([fwd, bwd, peak], dtype=torch.float64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                results.append({"L": total, "H": heads, "Hkv": kv_heads, "sp": sp, "backend": backend,
                                "forward": int(worst[0]), "backward": int(worst[1]), "peak": int(worst[2])})
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(results, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def compare() -> list[str]:
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare.json"
        mp.spawn(compare_worker, args=(4, port, str(out)), nprocs=4, join=True)
        results = json.loads(out.read_text())
    mib = 1 << 20
    lines = ["| L | H / kv | sp | backend | fwd MiB | bwd MiB | total MiB | peak MiB | |",
             "|---|---|---|---|---|---|---|---|---|"]
    for total, heads, kv_heads, sp in COMPARE_CASES:
        for r in (r for r in results if (r["L"], r["H"], r["Hkv"], r["sp"]) == (total, heads, kv_heads, sp)):
            name = {"ulysses": f"ulysses {sp}", "hybrid": "hybrid ulysses 2 x gather 2",
                    "gather": "torch (all-gather)"}[r["backend"]]
            lines.append(f"| {total} | {heads} / {kv_heads} | {sp} | {name} | {r['forward'] / mib:.2f} | "
                         f"{r['backward'] / mib:.2f} | {(r['forward'] + r['backward']) / mib:.2f} | "
                         f"{r['peak'] / mib:.1f} | measured |")
        fwd, bwd = ring_bytes(total, kv_heads, sp)
        lines.append(f"| {total} | {heads} / {kv_heads} | {sp} | llama3 / zigzag (ring-flash-attn) | {fwd / mib:.2f} | "
                     f"{bwd / mib:.2f} | {(fwd + bwd) / mib:.2f} | – | computed |")
    return lines


# ---------------------------------------------------------------------------------------------- --limits
QWEN25 = {  # Qwen2.5 configs (hidden, layers, heads, kv heads, head dim, intermediate, vocab, tied)
    "Qwen2.5 0.5B": (896, 24, 14, 2, 64, 4864, 151936, True),
    "Qwen2.5 1.5B": (1536, 28, 12, 2, 128, 8960, 151936, True),
    "Qwen2.5 7B": (3584, 28, 28, 4, 128, 18944, 152064, False),
}
GPU_BYTES = 80 * 10**9
WORLD = 8  # one node of 8 GPUs; ZeRO-3 partitions the model state over all of them


def sp_transient_bytes(shape, backend: str, row: int, sp: int, ulysses: int, act_bytes: int = 2) -> int:
    """Bytes one layer's sequence-parallel attention adds on a rank for a row of `row` tokens (forward buffers and
    their gradients in backward):
    - torch / llama3: the all-gathered K/V of the whole row and its gradient: 2 · row · 2 · kv_dim;
    - zigzag: two K/V blocks of row/sp in flight, and their gradients: 4 · row/sp · 2 · kv_dim;
    - Ulysses of degree u (inside sp): the exchanged q/k/v and output (send and receive buffers) of row/sp tokens,
      with kv heads repeated up to u: 2 · row/sp · (2 · q_dim + 2 · kv_dim'); in the hybrid, plus the torch
      gather of the rank's head slice over the row: 2 · row · 2 · kv_dim'/u."""
    from train.config.sp_rules import kv_heads_after_repeat

    kv_dim, q_dim, local = shape.kv_dim, shape.n_heads * shape.head_dim, row // sp
    if backend in ("torch", "llama3"):
        return act_bytes * 2 * row * 2 * kv_dim
    if backend == "zigzag":
        return act_bytes * 4 * local * 2 * kv_dim
    kv_dim_repeated = kv_heads_after_repeat(shape.n_kv_heads, ulysses) * shape.head_dim
    exchange = 2 * local * (2 * q_dim + 2 * kv_dim_repeated)
    ring = 2 * row * 2 * kv_dim_repeated // ulysses if ulysses < sp else 0
    return act_bytes * (exchange + ring)


def longest_row(shape, backend: str, sp: int, ulysses: int = 1) -> int:
    """The longest row (tokens, a multiple of 1024) whose rank's share fits the GPU under the memory model."""
    from train.plan.memory import activation_bytes, model_state_bytes

    state = model_state_bytes(shape.n_params, shape.n_params, 3, WORLD, bf16=True)
    usable = int(GPU_BYTES * 0.9)

    def fits(row: int) -> bool:
        act = activation_bytes(shape, row // sp, 2, checkpointing=True, loss_chunk=4096)
        return state + act + sp_transient_bytes(shape, backend, row, sp, ulysses) <= usable

    low, high = 0, 1 << 26
    while high - low > 1024:
        mid = (low + high) // 2 // 1024 * 1024
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def limits() -> list[str]:
    from train.plan.memory import ModelShape
    from train.config.sp_rules import allowed_degrees

    lines = ["| model (H / kv heads) | sp | torch (gather) | llama3 | zigzag | Ulysses (degree) |",
             "|---|---|---|---|---|---|"]
    for name, (hidden, layers, heads, kv, head_dim, inter, vocab, tied) in QWEN25.items():
        shape = ModelShape(hidden, layers, heads, kv, head_dim, inter, vocab, tied)
        for sp in (4, 8):
            cells = [f"{longest_row(shape, b, sp) // 1024}K" for b in ("torch", "llama3", "zigzag")]
            degrees = allowed_degrees(heads, kv, sp)
            if not degrees:
                ulysses = "– (heads allow no degree)"
            else:
                u = degrees[-1]
                kind = f"ulysses {u}" if u == sp else f"hybrid {u} x {sp // u}"
                ulysses = f"{longest_row(shape, 'ulysses', sp, u) // 1024}K ({kind})"
            lines.append(f"| {name} ({heads} / {kv}) | {sp} | " + " | ".join(cells) + f" | {ulysses} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", action="store_true", help="only section 4: ulysses, hybrid, gather, ring")
    parser.add_argument("--limits", action="store_true", help="only section 5 (computed), printed")
    args = parser.parse_args()
    if args.limits:
        print("\n".join(limits()))
        return
    if args.out is None:
        parser.error("--out is required (except with --limits)")
    torch.set_num_threads(1)
    if args.compare:
        stamp = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
        lines = [f"# SP backends side by side on CPU ({platform.processor() or platform.machine()}, torch "
                 f"{torch.__version__}, 4 gloo processes, one thread each, {stamp})", "",
                 f"One attention layer, forward + backward, fp32, head dim {HEAD_DIM}; bytes "
                 "received per rank per layer; peak: live tensor bytes above the layer's inputs, worst rank.", "",
                 *compare()]
        args.out.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    lines = [f"# SP on CPU ({platform.processor() or platform.machine()}, torch {torch.__version__}, one thread, "
             f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             "## shard_batch, 131,072 tokens, 64 sequences, best of 5", "", *shard_cost(), "",
             "## the torch gather backend's attention forward + backward, one rank, fp32, 4 heads / 2 kv heads, dim 64, "
             "best of 3", "",
             "| row tokens | sp | rank | varlen path | mask path | max abs diff |", "|---|---|---|---|---|---|"]
    for total, sp, rank in ((8192, 4, 0), (8192, 4, 3), (16384, 8, 7)):
        varlen_ms, mask_ms, diff = attention_time(total, sp, rank, 4, 2, 64)
        lines.append(f"| {total} | {sp} | {rank} | {varlen_ms:.0f} ms | {mask_ms:.0f} ms | {diff:.1e} |")
    lines += ["", "## Exactness against the single-process run (worst relative error, gloo, fp32)", "", *exactness()]
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
