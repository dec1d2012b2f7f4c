"""The 2-process gloo worker of tests/test_attention_features.py: sp = 2 over the torch backend (contiguous layout:
one varlen call; zigzag: the boolean mask) for tiny gemma2 (softcap, alternating window) and gpt-oss (sinks,
alternating window) against transformers' eager attention on each sequence alone; rank 0 writes the worst relative
errors to a JSON file."""
from __future__ import annotations

import copy
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tests._sp_worker import reference_step, relative_errors, sample_rows, sp_step, totals_of
from tests.test_attention_features import tiny_model
from train.batch import make_batch

FAMILIES = ("gemma2", "gpt_oss")


def worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        rows = sample_rows()
        totals = totals_of(rows)
        batches = [make_batch([row], totals, "token") for row in rows]
        results = {}
        for family in FAMILIES:
            model = tiny_model(family).train()
            reference = copy.deepcopy(model)
            reference.set_attn_implementation("eager")
            want = reference_step(reference, batches)
            for layout in ("contiguous", "zigzag"):
                got = sp_step(model, batches, rank, world_size, dist.group.WORLD, layout, dist.group.WORLD)
                results[f"{family}/{layout}"] = relative_errors(got, want)
        if rank == 0:
            tmp = out_path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(results, fh, indent=1)
            os.replace(tmp, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
