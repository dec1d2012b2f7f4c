"""Process groups for data parallelism (dp) x sequence parallelism (sp), from one device mesh.

Ranks come from torch.distributed, never from accelerate: under `accelerate launch --use_deepspeed` on CPU,
accelerate reports process_index 0 and num_processes 1 on every rank (measured with accelerate 1.15 on CPU).
Layout: world rank r = dp_rank * sp_size + sp_rank, so the ranks of one sp group are neighbours. With Ulysses
sequence parallelism of degree u (train/attention/ulysses.py) the sp dimension is itself a 2-D mesh, sp_rank =
ring_rank * u + ulysses_rank: the u ranks of a Ulysses group are neighbours (one machine, where the all-to-all is
fastest) and the ring group joins the ranks holding the same heads across the Ulysses groups.

Expert parallelism of degree e (train/model/experts.py) splits the data-parallel dimension: the expert-parallel (ep)
group of a rank is the e ranks of consecutive dp ranks (dp_rank // e the same) at the same sp_rank; they hold the e
parts of every MoE layer's experts (ep_rank = dp_rank % e holds the ep_rank-th part) and exchange tokens. The
expert-data-parallel (edp) group joins every rank holding the same part (the same ep_rank, every sp rank): an expert's
gradient is summed over it, where a replicated weight's is summed over the world. With sp = 2, dp = 4, e = 2:
ranks 0..7, ep groups {0,2} {1,3} {4,6} {5,7}, edp groups {0,1,4,5} {2,3,6,7}.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist



@dataclass
class Mesh:
    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    sp_size: int
    sp_rank: int
    dp_group: dist.ProcessGroup | None
    sp_group: dist.ProcessGroup | None
    device: torch.device
    ulysses_size: int = 1  # Ulysses degree inside the sp group (1: none)
    ulysses_group: dist.ProcessGroup | None = None  # this rank's Ulysses group (adjacent ranks)
    ring_group: dist.ProcessGroup | None = None  # this rank's group across Ulysses groups (when ulysses < sp)
    ep_size: int = 1  # expert-parallel degree (1: every rank holds every expert)
    ep_rank: int = 0  # which part of the experts this rank holds
    ep_group: dist.ProcessGroup | None = None  # the ranks exchanging tokens (holding the other parts)
    edp_group: dist.ProcessGroup | None = None  # the ranks holding the same part (an expert gradient's sum)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def ranks_per_machine(configured: int) -> int:
    """The processes sharing this machine (its GPUs, its host memory): the launcher's LOCAL_WORLD_SIZE, else the
    config's `launch.processes_per_machine`."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or configured


def init_distributed(timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed from the launcher's environment, once (no-op for a single process)."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(default_device())
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))


def build_mesh(sp_size: int = 1, device: torch.device | None = None, ulysses_size: int = 1, ep_size: int = 1) -> Mesh:
    """Split the world into dp groups of sp_size consecutive ranks, each split into Ulysses groups of
    `ulysses_size` consecutive ranks; with `ep_size` > 1, the expert groups of the module docstring. Call after
    init_distributed(), with the degrees of the run's layout (train/plan/layout.py: checked there, not here)."""
    device = device or default_device()
    if not dist.is_initialized():
        if sp_size != 1 or ep_size != 1:
            what = (f"sequence_parallel_size={sp_size}" if sp_size != 1 else f"expert_parallel_size={ep_size}")
            raise ValueError(f"{what} needs {max(sp_size, ep_size)} processes, got a single process")
        return Mesh(1, 0, 1, 0, 1, 0, None, None, device)
    mesh = _build_dp_sp_mesh(sp_size, device, ulysses_size)
    if ep_size > 1:
        mesh.ep_size = ep_size
        mesh.ep_rank, mesh.ep_group, mesh.edp_group = expert_groups(
            mesh.world_size, mesh.sp_size, ep_size, mesh.rank)
    return mesh


def expert_group_ranks(world: int, sp_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ep groups, the edp groups) as lists of world ranks (the module docstring's layout)."""
    dp_size = world // sp_size
    if dp_size % ep_size:
        raise ValueError(f"expert_parallel_size={ep_size} must divide the data-parallel size {dp_size}")
    ep_groups = [[(g * ep_size + i) * sp_size + s for i in range(ep_size)]
                 for g in range(dp_size // ep_size) for s in range(sp_size)]
    edp_groups = [[d * sp_size + s for d in range(dp_size) if d % ep_size == e for s in range(sp_size)]
                  for e in range(ep_size)]
    return ep_groups, edp_groups


def expert_groups(world: int, sp_size: int, ep_size: int, rank: int):
    """(ep_rank, ep group, edp group) of `rank`; every rank creates every group, in the same order."""
    ep_groups, edp_groups = expert_group_ranks(world, sp_size, ep_size)
    mine_ep = mine_edp = None
    for ranks in ep_groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine_ep, ep_rank = group, ranks.index(rank)
    for ranks in edp_groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine_edp = group
    return ep_rank, mine_ep, mine_edp


def _build_dp_sp_mesh(sp_size: int, device: torch.device, ulysses_size: int) -> Mesh:
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_size = world // sp_size
    if ulysses_size > 1:
        ring_size = sp_size // ulysses_size
        mesh = dist.device_mesh.init_device_mesh(
            device.type, (dp_size, ring_size, ulysses_size), mesh_dim_names=("dp", "sp_ring", "sp_ulysses")
        )
        sp_mesh = mesh["sp_ring", "sp_ulysses"]._flatten("sp")
        return Mesh(
            world_size=world, rank=rank, dp_size=dp_size, dp_rank=rank // sp_size, sp_size=sp_size,
            sp_rank=rank % sp_size, dp_group=mesh.get_group("dp"), sp_group=sp_mesh.get_group(), device=device,
            ulysses_size=ulysses_size, ulysses_group=mesh.get_group("sp_ulysses"),
            ring_group=mesh.get_group("sp_ring") if ring_size > 1 else None,
        )
    mesh = dist.device_mesh.init_device_mesh(
        device.type, (dp_size, sp_size), mesh_dim_names=("dp", "sp")
    )
    return Mesh(
        world_size=world,
        rank=rank,
        dp_size=dp_size,
        dp_rank=rank // sp_size,
        sp_size=sp_size,
        sp_rank=rank % sp_size,
        dp_group=mesh.get_group("dp"),
        sp_group=mesh.get_group("sp"),
        device=device,
    )


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum over `group` (the whole world when None); identity without torch.distributed."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class _AllReduceSum(torch.autograd.Function):
    """SUM all-reduce whose backward is the SUM all-reduce of the gradient: every rank uses the reduced value, so
    the gradient of a local input is the sum of every rank's gradient of that value."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone(memory_format=torch.contiguous_format)  # never reduce into autograd's buffer
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None


def differentiable_all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Out-of-place sum over `group`, differentiable (see _AllReduceSum)."""
    return _AllReduceSum.apply(tensor, group)


def all_reduce_sum_bucketed(tensors: list[torch.Tensor], bucket_elements: int = 1 << 24,
                            group: dist.ProcessGroup | None = None) -> None:
    """In-place SUM all-reduce over `group` (None: the world; not mean: the local losses are already parts of the step
    loss), in flat buckets of same-dtype tensors rather than one collective per parameter."""
    bucket: list[torch.Tensor] = []

    def flush():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        bucket.clear()

    size = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or size + t.numel() > bucket_elements):
            flush()
            size = 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        flush()
