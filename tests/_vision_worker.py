"""The two-process worker of tests/train/model/test_media_images.py (gloo, CPU, fp32): image conversations under data parallelism
(each rank a micro-batch of the step's records) and sequence parallelism (one row over both ranks, an image's tokens
straddling the boundary), each against the single-process packed step, which the one-process tests hold equal to the
composite's own forward. The records (processor outputs) are read from `records.safetensors` beside `out_path`; rank 0
writes the worst relative errors."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tests import _vision_inputs as vi
from tests._sp_worker import sp_plan, write_results

SP_ROW = (0, 3, 2)  # 289 tokens: the image run at tokens 141..150 straddles the sp = 2 boundary (145)


def summed(grads: dict) -> dict:
    for g in grads.values():
        dist.all_reduce(g)
    return grads


def worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        recs = vi.load_records(os.path.join(os.path.dirname(out_path), "records.safetensors"))
        results = {}
        for freeze in (False, True):
            model = vi.tiny_vl_model(freeze_tower=freeze)
            total = vi.n_targets(recs)
            want_loss, want = vi.packed_step(model, [vi.micro_batch(recs, total)])
            # dp = 2: rank r trains records r, r + 2, r + 4 (the step's weights), gradients summed over the ranks
            loss, got = vi.packed_step(model, [vi.micro_batch(recs[rank::2], total)])
            loss = torch.tensor(loss)
            dist.all_reduce(loss)
            results[f"dp2/{'frozen' if freeze else 'trained'}"] = {
                "loss": abs(float(loss) - want_loss) / want_loss, "grad": vi.grad_error(summed(got), want)}
            # sp = 2: one row, each rank its half; the image straddling the boundary runs on both ranks
            row = [recs[i] for i in SP_ROW]
            total = vi.n_targets(row)
            batch = vi.micro_batch(row, total)
            want_loss, want = vi.packed_step(model, [batch])
            plan = sp_plan(model.lm, rank, 2, dist.group.WORLD)
            seen = []

            def sharded(full):
                local, attn = plan.context(full)
                seen.append(attn.sp.local_range)
                return local, attn

            loss, got = vi.packed_step(model, [batch], attention=sharded)
            loss = torch.tensor(loss)
            dist.all_reduce(loss)
            results[f"sp2/{'frozen' if freeze else 'trained'}"] = {
                "loss": abs(float(loss) - want_loss) / want_loss, "grad": vi.grad_error(summed(got), want),
                "slice": list(seen[0]), "path": "varlen" if plan.context(batch)[1].sp.bounds is not None else "mask"}
        if rank == 0:
            results["sp2/straddle"] = straddles(model, batch)
        write_results(results, out_path, rank)
    finally:
        dist.destroy_process_group()


def straddles(model, batch) -> bool:
    """An image's tokens lie on both sides of the sp = 2 boundary of the padded row."""
    row = model.row_media(batch)
    half = -(-batch.input_ids.shape[1] // 2)
    before, after = set(row.feature_index[:half].tolist()), set(row.feature_index[half:].tolist())
    offsets = row.offsets
    return any(any(f in before for f in range(a, b)) and any(f in after for f in range(a, b))
               for a, b in zip(offsets[:-1], offsets[1:]))
