"""Sequence parallelism on CPU: `shard_batch` cost and the `torch` backend's attention, varlen path vs mask path.

1. `shard_batch` of one 131,072-token micro-batch (64 packed sequences of 2,048 tokens, built with
   `train.batch.make_batch`), one thread, best of 5, per layout and sp size.
2. `sp_attention` forward + backward of one rank of a packed row (seeded random sequence lengths), one process:
   the all-gather is replaced by the row's K/V (what the collective returns), so only the attention is timed.
   "varlen" is the contiguous-layout path (bounds from `shard_batch`, one kernel call: the SDPA loop on CPU);
   "mask" is the boolean-mask path of the same context (`bounds=None`), what the contiguous layout ran before.
   Both outputs are compared (max abs difference).
3. Exactness: the multi-process world of tests/test_sequence_parallel.py (4 gloo processes, 23 configurations),
   worst relative errors against the single-process run, per attention path of the torch backend.

    python -m benchmarks.bench_sp --out benchmarks/results/sp_bench.md
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

import train.sequence_parallel as sequence_parallel  # noqa: E402
from train.batch import StepTotals, make_batch  # noqa: E402
from train.sequence_parallel import shard_batch, sp_attention  # noqa: E402


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
    module = torch.nn.Module().eval()
    outs = {}

    def run(context):
        inputs = [t[start:end].transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v)]
        out = sp_attention(module, *inputs, context, dim ** -0.5)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [f"# SP on CPU ({platform.processor() or platform.machine()}, torch {torch.__version__}, one thread, "
             f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             "## shard_batch, 131,072 tokens, 64 sequences, best of 5", "", *shard_cost(), "",
             "## sp_attention forward + backward, one rank, fp32, 4 heads / 2 kv heads, dim 64, best of 3", "",
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
