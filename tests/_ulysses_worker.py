"""The multi-process worker of tests/train/attention/test_ulysses.py (gloo, CPU, fp32): one spawned world of 4 processes runs
Ulysses sp = 4, dp = 2 x Ulysses sp = 2 (the second sp group is ranks 2-3, not the first) and the hybrid
(Ulysses 2 x torch gather 2) on a tiny Qwen2 (4 heads, 2 kv heads: repeated to 4 at degree 4), gemma2 (sliding
window + softcap) and gpt-oss (sinks + sliding window), and the Parallel-R1 mask; two micro-batches per step
(gradient accumulation). Rank 0 writes the worst relative errors against the single-process run to a JSON file.
"""
from __future__ import annotations

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tests._sp_features_worker import tiny_model
from tests._sp_worker import (
    reference_step,
    relative_errors,
    sample_rows,
    sp_step,
    structured_reference_model,
    structured_reference_step,
    structured_rows,
    tiny_models,
    totals_of,
    write_results,
)
from train.steps.batch import make_batch
from data.shards.dataset import Structure

FAMILIES = ("qwen2", "gemma2", "gpt_oss")


def _from_rank(source: int, value: float) -> float:
    tensor = torch.tensor(value if dist.get_rank() == source else 0.0, dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor)


def _configurations(model, batches, rank, pairs, rings):
    """(name, result) of every sp configuration of one step: `batches` are the step's two micro-batches."""
    world = dist.group.WORLD
    dp_rank, sp_rank = divmod(rank, 2)
    got = sp_step(model, batches, rank, 4, world, "contiguous", world, sp_backend="ulysses", ulysses_size=4,
                  ulysses_group=world)
    yield "ulysses-sp4", got, got["local_losses"][1]
    # dp = 2 x sp = 2: dp rank d trains row d over the sp group {2d, 2d+1}, one micro-batch each
    got = sp_step(model, [batches[dp_rank]], sp_rank, 2, pairs[dp_rank], "contiguous", world, sp_backend="ulysses",
                  ulysses_size=2, ulysses_group=pairs[dp_rank])
    yield "ulysses-dp2sp2", got, got["local_losses"][0]
    # hybrid: Ulysses inside {0, 1} and {2, 3}, the torch gather backend across them ({0, 2} and {1, 3})
    got = sp_step(model, batches, rank, 4, world, "contiguous", world, sp_backend="ulysses", ulysses_size=2,
                  ulysses_group=pairs[dp_rank], ring_group=rings[sp_rank])
    yield "hybrid-sp4", got, got["local_losses"][1]


def worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        rows = sample_rows()
        totals = totals_of(rows)
        results = {}
        for family in FAMILIES:
            if family == "qwen2":
                model, reference = tiny_models()
                reductions = ("token", "sample")
            else:
                model = tiny_model(family).train()
                reference = copy.deepcopy(model)
                reference.set_attn_implementation("eager")
                reductions = ("token",)
            for reduction in reductions:
                batches = [make_batch([row], totals, reduction) for row in rows]
                want = reference_step(reference, batches)
                for name, got, row1_last in _configurations(model, batches, rank, pairs, rings):
                    key = f"{family}/{name}/{reduction}"
                    results[key] = relative_errors(got, want)
                    # row 1's last contiguous shard (rank 3) holds no loss token
                    results[key]["row1_last_rank_loss"] = _from_rank(3, row1_last)
        model, _ = tiny_models()
        structured = [make_batch([row], totals, "token", structure=Structure.PARALLEL_THINKING) for row in structured_rows()]
        want = structured_reference_step(structured_reference_model(model), structured)
        for name, got, _ in _configurations(model, structured, rank, pairs, rings):
            results[f"structure/{name}/token"] = relative_errors(got, want)
        write_results(results, out_path, rank)
    finally:
        dist.destroy_process_group()
