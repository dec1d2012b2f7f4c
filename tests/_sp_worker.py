"""Helpers and the multi-process worker of tests/train/attention/test_sequence_parallel.py (gloo, CPU, fp32).

One spawned world of 4 processes runs every configuration (sp=4; dp=2 x sp=2, whose sp groups are the sp=2
checks; contiguous (varlen kernel path) and zigzag (mask path) layouts through the torch backend) for every loss
reduction, and rank 0 writes the
worst relative errors against the single-process reference to a JSON file the tests read.
"""
from __future__ import annotations

import copy
import json
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from train.steps.batch import IGNORE_INDEX, StepTotals, make_batch
from train.model.loss import weighted_lm_loss
from data.shards.dataset import Structure

NUM_CATEGORIES = 4
VOCAB = 97
REDUCTIONS = ("token", "turn", "sample")
LOSS_CHUNK = 16


def conversation(segments, seed: int) -> dict:
    """One packed sequence from segments (n_tokens, trained, category); trained segments are turns 1, 2, ..."""
    rng = np.random.default_rng(seed)
    ids, labels, cats, turns = [], [], [], []
    turn = 0
    for n, trained, cat in segments:
        seg = rng.integers(1, VOCAB, size=n)
        ids.append(seg)
        cats.append(np.full(n, cat))
        if trained:
            turn += 1
        labels.append(seg if trained else np.full(n, IGNORE_INDEX))
        turns.append(np.full(n, turn if trained else 0))
    return {
        "input_ids": np.concatenate(ids).astype(np.int32),
        "labels": np.concatenate(labels).astype(np.int32),
        "category_ids": np.concatenate(cats).astype(np.int16),
        "turn_ids": np.concatenate(turns).astype(np.int16),
    }


def packed_row(seqs: list[dict]) -> dict:
    row = {k: np.concatenate([s[k] for s in seqs]) for k in seqs[0]}
    row["seq_lens"] = np.array([len(s["input_ids"]) for s in seqs])
    return row


def sample_rows() -> list[dict]:
    """Row 0 (81 tokens): three sequences crossing every shard boundary for sp 2 and 4.
    Row 1 (67 tokens): its last loss target is token 29, so the last shard holds no loss token for sp 2 and 4."""
    row0 = packed_row([
        conversation([(5, False, 1), (8, True, 1), (4, False, 1), (6, True, 2)], seed=1),
        conversation([(6, False, 2), (20, True, 2), (15, False, 0)], seed=2),
        conversation([(3, False, 3), (14, True, 3)], seed=3),
    ])
    row1 = packed_row([
        conversation([(4, False, 1), (16, True, 1)], seed=4),
        conversation([(2, False, 2), (9, True, 2), (36, False, 2)], seed=5),
    ])
    return [row0, row1]


def with_structure(row: dict, blocks: list[tuple[int, int, int, int]]) -> dict:
    """`row` plus block_ids/path_ids: each (start, count, block, path) marks a run of row tokens."""
    row = dict(row)
    row["block_ids"] = np.zeros(len(row["input_ids"]), np.int16)
    row["path_ids"] = np.zeros(len(row["input_ids"]), np.int16)
    for start, count, block, path in blocks:
        row["block_ids"][start : start + count] = block
        row["path_ids"][start : start + count] = path
    return row


def structured_rows() -> list[dict]:
    """The test rows with Parallel-R1 blocks whose paths straddle the sp=2 and sp=4 shard boundaries."""
    row0, row1 = sample_rows()
    # row 0, sequence 1 (tokens 23..63): block 1 = tag 29, paths 30..37 / 38..47 / 48..52, tag 53
    row0 = with_structure(row0, [(29, 1, 1, 0), (30, 8, 1, 1), (38, 10, 1, 2), (48, 5, 1, 3), (53, 1, 1, 0)])
    # row 1, sequence 0 (tokens 0..19): block 1 = tag 3, paths 4..9 / 10..17, tag 18
    row1 = with_structure(row1, [(3, 1, 1, 0), (4, 6, 1, 1), (10, 8, 1, 2), (18, 1, 1, 0)])
    return [row0, row1]


def totals_of(rows: list[dict]) -> StepTotals:
    """Step normalizers as the shards count them (labels != -100, distinct turn ids, sequences with a label)."""
    n_loss = n_turns = n_samples = 0
    for row in rows:
        for start, end in zip(np.cumsum(row["seq_lens"]) - row["seq_lens"], np.cumsum(row["seq_lens"])):
            labels, turns = row["labels"][start:end], row["turn_ids"][start:end]
            n_loss += int((labels != IGNORE_INDEX).sum())
            n_turns += len(set(turns.tolist()) - {0})
            n_samples += int((labels != IGNORE_INDEX).any())
    return StepTotals(n_loss, n_turns, n_samples)


def tiny_models():
    """The same random tiny Qwen2 twice: one with the packsft attention (sp), one with plain sdpa (reference)."""
    import train.attention.function  # noqa: F401  registers attn_implementation="packsft"
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    # one config object each: from_config writes the attention implementation into the config it is given
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="packsft", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)
    reference.load_state_dict(model.state_dict())
    assert (model.config._attn_implementation, reference.config._attn_implementation) == ("packsft", "sdpa")
    return model, reference


def _full_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Reference for structure mode: one process, the whole row, the mask of train.attention.structured."""
    from train.attention.structured import structured_sdpa

    return structured_sdpa(query, key, value, kwargs["structure_mask"], scaling), None


def structured_reference_model(model):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("sp_test_full_mask", _full_mask_attention)
    config = copy.deepcopy(model.config)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sp_test_full_mask", dtype=torch.float32)
    reference.load_state_dict(model.state_dict())
    assert reference.config._attn_implementation == "sp_test_full_mask"
    return reference


def _accumulate_reference(reference, batches, hidden_of) -> dict:
    """Loss, category sums and gradients of `reference` over `batches`, with `hidden_of(batch)` the hidden states."""
    reference.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    cat_sum = torch.zeros(NUM_CATEGORIES)
    cat_count = torch.zeros(NUM_CATEGORIES, dtype=torch.int64)
    for batch in batches:
        weighted, cs, cc = loss_of(reference, hidden_of(batch), batch)
        weighted.backward()
        loss += weighted.detach()
        cat_sum += cs
        cat_count += cc
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    return {"loss": loss, "cat_sum": cat_sum, "cat_count": cat_count, "grads": grads}


def structured_reference_step(reference, batches) -> dict:
    from train.attention.structured import build_mask

    def hidden_of(batch):
        ids = (batch.seq_ids, batch.block_ids, batch.path_ids, torch.arange(batch.seq_ids.numel()))
        return reference.model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
            structure_mask=build_mask(*ids, *ids),
        ).last_hidden_state[0]

    return _accumulate_reference(reference, batches, hidden_of)


def loss_of(model, hidden, batch):
    return weighted_lm_loss(
        hidden, model.lm_head.weight, batch.targets, batch.weights, batch.target_categories,
        NUM_CATEGORIES, LOSS_CHUNK,
    )


def reference_step(reference, batches) -> dict:
    """Single process, no packing at all: every sequence runs alone through the sdpa model."""

    def hidden_of(batch):
        cu = batch.cu_seqlens.tolist()
        return torch.cat([
            reference.model(input_ids=batch.input_ids[:, a:b], use_cache=False).last_hidden_state[0]
            for a, b in zip(cu[:-1], cu[1:])
        ])

    return _accumulate_reference(reference, batches, hidden_of)


def sp_plan(model, sp_rank: int, sp_size: int, group, structure=Structure.NONE, sp_backend: str = "torch",
            ulysses_size: int = 1, ulysses_group=None, ring_group=None):
    """The attention plan train/plan/attention.py makes for `model` (CPU, fp32, attn_backend auto) on an sp group
    of `sp_size` ranks: `ulysses_size` > 1 with its Ulysses group (and, when smaller than `sp_size`, the ring group
    across the Ulysses groups)."""
    from train.plan.attention import SPLayout, plan_attention
    from train.config.sections import ModelSection, ParallelSection
    from train.distributed import Mesh

    mesh = Mesh(dist.get_world_size(), dist.get_rank(), 1, 0, sp_size, sp_rank, None, group, torch.device("cpu"),
                ulysses_size, ulysses_group, ring_group)
    parallel = ParallelSection(sequence_parallel_size=sp_size, sp_backend=sp_backend)
    return plan_attention(ModelSection(), parallel, SPLayout(sp_size, ulysses_size, "set by the test"), mesh, model,
                          structure)


def sp_step(model, batches, sp_rank, sp_size, group, layout, reduce_group, **plan) -> dict:
    """This rank's part of one optimizer step under sp, its gradients scaled as the trainer does (backward of
    local sum x world size), then averaged over `reduce_group` (the world) as DDP/DeepSpeed would. Attention runs
    what `sp_plan` chose (`plan`: its Ulysses arguments); `layout` zigzag: the torch backend's CPU reference of the
    zigzag layout, which no plan chooses."""
    world_size = dist.get_world_size(reduce_group)
    from train.attention.function import AttentionContext
    from train.attention.sequence_parallel import shard_batch

    planned = sp_plan(model, sp_rank, sp_size, group, structure=batches[0].structure, **plan)
    model.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    cat_sum = torch.zeros(NUM_CATEGORIES)
    cat_count = torch.zeros(NUM_CATEGORIES, dtype=torch.int64)
    local_losses = []
    paths = set()
    for batch in batches:
        if layout == "zigzag":
            fields, ctx = shard_batch(batch, sp_rank, sp_size, "torch", group=group, layout=layout)
            local, attn = batch.local(fields), AttentionContext(ctx.cu_seqlens, ctx.max_seqlen, planned.train, sp=ctx)
        else:
            local, attn = planned.context(batch)
            ctx = attn.sp
        if ctx.ulysses is not None:
            paths.add("ulysses" if ctx.ulysses.local.sp is None else "hybrid")
        else:
            paths.add("varlen" if ctx.bounds is not None else "mask")  # which attention path of the torch backend ran
        hidden = model.model(
            input_ids=local.input_ids, position_ids=local.position_ids, use_cache=False, packsft=attn
        ).last_hidden_state[0]
        weighted, cs, cc = loss_of(model, hidden, local)
        (weighted * world_size).backward()
        local_losses.append(weighted.item())
        loss += weighted.detach()
        cat_sum += cs
        cat_count += cc
    for tensor in (loss, cat_sum, cat_count):
        dist.all_reduce(tensor, group=reduce_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=reduce_group)
        grads[name] = g / world_size
    return {"loss": loss, "cat_sum": cat_sum, "cat_count": cat_count, "grads": grads, "local_losses": local_losses,
            "path": "+".join(sorted(paths))}


def relative_errors(got: dict, want: dict) -> dict:
    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

    return {
        "loss": rel(got["loss"], want["loss"]),
        "cat_sum": rel(got["cat_sum"], want["cat_sum"]),
        "cat_count_equal": bool(torch.equal(got["cat_count"], want["cat_count"])),
        "grad": max(rel(got["grads"][n], want["grads"][n]) for n in want["grads"]),
        "path": got["path"],
    }


def _from_rank(source: int, value: float) -> float:
    """`value` as seen on rank `source`, on every rank."""
    tensor = torch.tensor(value if dist.get_rank() == source else 0.0, dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor)


def worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        sp2_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        world_group = dist.group.WORLD
        model, reference = tiny_models()
        rows = sample_rows()
        totals = totals_of(rows)
        results = {}
        for reduction in REDUCTIONS:
            batches = [make_batch([row], totals, reduction) for row in rows]
            want = reference_step(reference, batches)
            for layout in ("contiguous", "zigzag"):
                # sp = 4, dp = 1: both rows are micro-batches of every rank
                got = sp_step(model, batches, rank, 4, world_group, layout, world_group)
                results[f"sp4/{layout}/{reduction}"] = relative_errors(got, want)
                results[f"sp4/{layout}/{reduction}"]["row1_last_rank_loss"] = _from_rank(3, got["local_losses"][1])
                # dp = 2 x sp = 2: dp rank d trains row d over the sp group {2d, 2d+1}
                dp_rank, sp_rank = divmod(rank, 2)
                got = sp_step(model, [batches[dp_rank]], sp_rank, 2, sp2_groups[dp_rank], layout, world_group)
                results[f"dp2sp2/{layout}/{reduction}"] = relative_errors(got, want)
                results[f"dp2sp2/{layout}/{reduction}"]["row1_last_rank_loss"] = _from_rank(3, got["local_losses"][0])
                # sp = 2 alone: the sp group's summed gradient is the gradient of its row's share of the step loss
                group = sp2_groups[dp_rank]
                sp_only = sp_step(model, [batches[dp_rank]], sp_rank, 2, group, layout, group)
                row_want = reference_step(reference, [batches[dp_rank]])
                errors = relative_errors(sp_only, row_want)
                worst = torch.tensor([errors["loss"], errors["cat_sum"], errors["grad"]])
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                results[f"sp2/{layout}/{reduction}"] = {"loss": float(worst[0]), "cat_sum": float(worst[1]),
                                                        "grad": float(worst[2]), "path": sp_only["path"]}
        # gradient checkpointing (non-reentrant, as the trainer enables it): the K/V all-gather runs again in the
        # recomputation inside backward, in the same order on every rank
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        batches = [make_batch([row], totals, "token") for row in rows]
        want = reference_step(reference, batches)
        got = sp_step(model, batches, rank, 4, world_group, "contiguous", world_group)
        results["checkpointing-sp4/contiguous/token"] = relative_errors(got, want)
        model.gradient_checkpointing_disable()
        # structure mode (Parallel-R1 mask), token reduction: sp = 4 and dp = 2 x sp = 2, both layouts
        structured = [make_batch([row], totals, "token", structure=Structure.PARALLEL_THINKING) for row in structured_rows()]
        want = structured_reference_step(structured_reference_model(model), structured)
        for layout in ("contiguous", "zigzag"):
            got = sp_step(model, structured, rank, 4, world_group, layout, world_group)
            results[f"structure-sp4/{layout}/token"] = relative_errors(got, want)
            dp_rank, sp_rank = divmod(rank, 2)
            got = sp_step(model, [structured[dp_rank]], sp_rank, 2, sp2_groups[dp_rank], layout, world_group)
            results[f"structure-dp2sp2/{layout}/token"] = relative_errors(got, want)
        write_results(results, out_path, rank)
    finally:
        dist.destroy_process_group()


def spawned_results(worker, nprocs: int, out_dir) -> dict:
    """Run `worker(rank, nprocs, port, out_path)` in `nprocs` gloo processes; the results rank 0 wrote."""
    import torch.multiprocessing as mp

    from tests._train_helpers import free_port

    out = os.path.join(str(out_dir), "results.json")
    mp.spawn(run_then_release, args=(worker, nprocs, free_port(), out), nprocs=nprocs, join=True)
    with open(out) as fh:
        return json.load(fh)


def run_then_release(rank: int, worker, *args) -> None:
    """`worker(rank, *args)`, then gloo's process groups freed once its frame (the models, groups and graphs it
    held) is gone, as `python -m train` does: else a rank could abort at exit (SIGABRT, "terminate called without
    an active exception") while the interpreter tears a live gloo worker thread down."""
    from train.__main__ import release_process_groups

    worker(rank, *args)
    release_process_groups()


def write_results(results: dict, out_path: str, rank: int) -> None:
    """Rank 0 writes the workers' comparison results (atomically); every rank waits for it."""
    if rank == 0:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(results, fh, indent=1)
        os.replace(tmp, out_path)
    dist.barrier()

