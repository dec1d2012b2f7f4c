"""Parallel-R1 structured attention (train/attention/structured.py) on one packed row: mask building (a CPU
micro-benchmark) and, with `--attention`, forward + backward of one layer per path (FlexAttention on CUDA).

    python -m benchmarks.bench_structured_attention --length 16384 --repeat 5 --threads 1
    python -m benchmarks.bench_structured_attention --length 16384 --repeat 1 --threads 1 --attention --heads 2 \
        --kv-heads 1 --head-dim 64
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from train.attention.structured import (  # noqa: E402
    _mask_elementwise,
    _runs,
    build_mask,
    flex_structured_attention,
    structured_sdpa,
    structured_sdpa_by_sequence,
)


def _bench_row(length: int, sample_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed row of Parallel-R1-shaped samples: prompt, one block of 2 unequal paths, summary and answer."""
    seq, block, path = [], [], []
    s = 0
    while len(seq) < length:
        n = min(sample_length, length - len(seq))
        b, p = [0] * n, [0] * n
        cut = [int(n * f) for f in (0.35, 0.37, 0.6, 0.8, 0.82)]  # tag, path 1, path 2, tag, after
        for i in range(cut[0], cut[4]):
            b[i] = 1
        for i in range(cut[1], cut[2]):
            p[i] = 1
        for i in range(cut[2], cut[3]):
            p[i] = 2
        seq += [s] * n
        block += b
        path += p
        s += 1
    return torch.tensor(seq), torch.tensor(block), torch.tensor(path)


def _timed(fn, repeat: int) -> tuple[float, float, object]:
    """Best wall and CPU seconds over `repeat` runs (the machine may be shared), and the last result."""
    best_wall = best_cpu = float("inf")
    result = None
    for _ in range(repeat):
        result = None
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time building the structured attention mask of one packed row.")
    parser.add_argument("--length", type=int, default=16384, help="tokens in the packed row")
    parser.add_argument("--sample-length", type=int, default=600, help="tokens per packed sequence")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--attention", action="store_true", help="also time attention forward + backward")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    seq, block, path = _bench_row(args.length, args.sample_length)
    index = torch.arange(len(seq))
    zeros = torch.zeros_like(seq)
    n_seq = int(seq.max()) + 1
    print(f"row of {len(seq)} tokens, {n_seq} sequences of <= {args.sample_length} tokens, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    starts, ends = _runs(seq)

    def per_sequence():
        return [build_mask(seq[a:b], block[a:b], path[a:b], index[a:b], seq[a:b], block[a:b], path[a:b], index[a:b])
                for a, b in zip(starts.tolist(), ends.tolist())]

    row = (seq, block, path, index)
    plain = (seq, zeros, zeros, index)
    cases = [
        ("build_mask, structured ids, whole row", lambda: build_mask(*row, *row)),
        ("build_mask, zero ids (block-diagonal causal)", lambda: build_mask(*plain, *plain)),
        ("elementwise definition, whole row", lambda: _mask_elementwise(*row, *row)),
        ("build_mask per sequence (structured_sdpa_by_sequence)", per_sequence),
    ]
    for name, fn in cases:
        wall, cpu, result = _timed(fn, args.repeat)
        masks = result if isinstance(result, list) else [result]
        megabytes = sum(m.numel() for m in masks) / 2**20
        print(f"{name:55s} wall {wall * 1e3:9.1f} ms  cpu {cpu * 1e3:9.1f} ms  mask {megabytes:8.1f} MiB")
    if args.attention:
        _bench_attention(args, seq, block, path, index)


def _bench_attention(args, seq, block, path, index) -> None:
    """Forward + backward of one attention layer over the row, per backend (flex only on CUDA)."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ids = [t.to(device) for t in (seq, block, path, index)]
    shape = (1, args.heads, len(seq), args.head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn((1, args.kv_heads, len(seq), args.head_dim), device=device, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    backends = {
        "structured_sdpa (whole-row mask)": lambda: structured_sdpa(q, k, v, build_mask(*ids), None),
        "structured_sdpa_by_sequence": lambda: structured_sdpa_by_sequence(q, k, v, *ids, *ids, None),
    }
    if device.type == "cuda":
        backends["flex_structured_attention"] = lambda: flex_structured_attention(q, k, v, *ids, *ids, None)

    def step(fn):
        fn().float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    for name, fn in backends.items():
        step(fn)  # warm-up (compilation for flex)
        wall, cpu, _ = _timed(lambda: step(fn), args.repeat)
        print(f"{name:55s} fwd+bwd wall {wall * 1e3:9.1f} ms  ({args.heads} heads / {args.kv_heads} kv, "
              f"dim {args.head_dim}, {dtype}, {device})")


if __name__ == "__main__":
    main()
