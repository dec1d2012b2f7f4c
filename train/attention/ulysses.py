"""Ulysses sequence parallelism, alone or around the gather / ring backends (the hybrid).

Ulysses (`sp_backend: ulysses`, DeepSpeed-Ulysses' scheme). The row is laid out as for the `torch` backend
(contiguous: padded at the end to a multiple of sp with one padding sequence that attends only to itself, rank i
holding slice i). In every layer one all-to-all over the Ulysses group of u ranks turns this rank's q/k/v
[L/sp tokens, all heads] into [u·L/sp tokens, heads/u]; the rank then runs ordinary packed attention on those
tokens for its heads, and a second all-to-all returns the output to [L/sp tokens, all heads]. Both exchanges are
autograd-aware (`_AllToAll`: the backward of an all-to-all is the inverse all-to-all).
- u = sp (pure Ulysses): the rank holds the WHOLE row for its heads, so the local attention is the packed path of
  train/attention/function.py (the backend the attention plan chose for the layer's kind, with every per-layer feature, or
  the Parallel-R1 mask) over the whole row's boundaries, nothing sequence-parallel about it.
- u < sp (hybrid, sp = u × r): ranks are numbered sp_rank = ring_rank · u + ulysses_rank, so a Ulysses group is
  u adjacent ranks and holds u adjacent slices: a contiguous block of the row. Across the r groups, the ranks with
  the same head slice (same ulysses_rank) form the ring group and run the `torch` gather backend (or `llama3` on
  GPUs) of train/attention/sequence_parallel.py on those blocks, exactly as sp = r would on the row.

Heads (the rules: train/config/sp_rules.py): query heads are split into u contiguous chunks, so u must divide the heads.
Key/value heads too; when there are fewer kv heads than u (GQA), each is repeated u / kv_heads times before the
exchange (u must then be a multiple of them), so that every rank gets the one kv head its query heads read. Per-head parameters (attention
sinks `s_aux` [H]) are sliced to the rank's heads; the slice's gradient flows back to the full parameter.

Recurrent token mixers (hybrid linear-attention / state-space models) stay refused under every SP backend,
Ulysses included (train/model/patches/recurrent.py): they are not attention, so no head exchange reaches them and each rank
would still see only its slice of every sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from data.shards.dataset import Structure
from train.attention.function import AttentionContext, LayerKernels
from train.config.backend_names import TORCH
from train.attention.sequence_parallel import SPContext, shard_batch
from train.config.sp_rules import degree_problem, heads_problem, kv_heads_after_repeat
from train.attention.varlen_kernels import NO_FEATURES, AttentionFeatures


# ---------------------------------------------------------------------------------------------- collectives
def _exchange(tensor: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all over `group`: chunk i of `scatter_dim` goes to rank i; the chunks received are concatenated
    along `gather_dim` in rank order."""
    world = dist.get_world_size(group)
    if tensor.shape[scatter_dim] % world:
        raise ValueError(f"all-to-all: dimension {scatter_dim} of {tuple(tensor.shape)} does not split over "
                         f"{world} ranks")
    send = torch.stack(tensor.chunk(world, dim=scatter_dim))  # [world, ...]: one contiguous buffer
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_exchange`, differentiable: backward exchanges the gradient the other way (scatter the gathered dim, gather
    the scattered one). Written like `_GatherSequence` rather than with torch.distributed.nn's all_to_all, whose
    gloo emulation mixes group and global ranks in sub-groups (every sp group but the first when dp > 1)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(tensor, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(tensor: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return _AllToAll.apply(tensor, group, scatter_dim, gather_dim)


# ---------------------------------------------------------------------------------------------- per micro-batch
@dataclass(frozen=True)
class UlyssesSpec:
    """The process groups and local kernels of Ulysses, fixed for a run (train/plan/attention.py builds it once)."""

    size: int  # ranks of one Ulysses group (adjacent sp ranks)
    group: Any  # this rank's Ulysses group
    ring_group: Any = None  # this rank's group across the Ulysses groups (same heads), when size < sp
    ring_backend: str = TORCH  # across the groups: torch (all-gathered K/V) or llama3
    # what the local attention runs per kind of layer: the packed kernels on the whole row (pure Ulysses) or the
    # ring backend over the ring group (the hybrid)
    local: LayerKernels = field(default_factory=LayerKernels)


@dataclass
class UlyssesContext:
    """What `ulysses_attention` needs for one micro-batch: the groups, and `local`, the context of the local
    attention: the whole padded row as one packed micro-batch (pure Ulysses), or this Ulysses group's block of the
    row sharded over the ring group (`local.sp`, the hybrid)."""

    group: Any
    size: int
    rank: int
    local: AttentionContext

    def to(self, device: torch.device | str) -> "UlyssesContext":
        local = self.local
        if local.sp is not None:
            ring = local.sp.to(device)
            moved = AttentionContext(ring.cu_seqlens, ring.max_seqlen, local.kernels, sp=ring)
        else:
            structure = {name: getattr(local, name).to(device) for name in ("seq_ids", "block_ids", "path_ids")
                         if getattr(local, name) is not None}
            moved = AttentionContext.for_micro_batch(torch.tensor(local.bounds.host_cu_q), device, local.kernels,
                                                     **structure)
        return replace(self, local=moved)


def ulysses_context(spec: UlyssesSpec, sp_rank: int, sp_size: int, padded_cu: torch.Tensor,
                    structure: dict[str, torch.Tensor] | None) -> UlyssesContext:
    """The UlyssesContext of rank `sp_rank` for a padded row with sequence offsets `padded_cu` (a multiple of sp
    tokens long) and, in structure mode, the padded row's seq/block/path ids."""
    if spec.size < 2 or (problem := degree_problem(sp_size, spec.size)):
        raise ValueError(f"Ulysses degree {spec.size}: must be > 1; {problem}")
    ring_size = sp_size // spec.size
    ring_rank, rank = divmod(sp_rank, spec.size)
    if ring_size == 1:
        row = AttentionContext.for_micro_batch(padded_cu, "cpu", spec.local, **(structure or {}))
        return UlyssesContext(spec.group, spec.size, rank, row)
    if spec.ring_group is None:
        raise ValueError(f"the hybrid (Ulysses {spec.size} x {ring_size}) needs the ring group")
    padded_length = int(padded_cu[-1])
    row = {"input_ids": torch.zeros(1, padded_length, dtype=torch.int64), "cu_seqlens": padded_cu}
    row.update(structure or {})
    _, ring = shard_batch(row, ring_rank, ring_size, spec.ring_backend, group=spec.ring_group,
                          structure=Structure.PARALLEL_THINKING if structure else Structure.NONE)
    return UlyssesContext(spec.group, spec.size, rank, AttentionContext(ring.cu_seqlens, ring.max_seqlen, spec.local,
                                                                        sp=ring))


def ulysses_shard(batch: dict, sp_rank: int, sp_size: int, spec: UlyssesSpec, group: Any = None,
                  structure: Structure = Structure.NONE) -> tuple[dict, SPContext]:
    """`shard_batch` for Ulysses: this rank's contiguous slice of the row, and an SPContext whose `ulysses` holds the
    UlyssesContext of the micro-batch."""
    local, ctx = shard_batch(batch, sp_rank, sp_size, None, group=group, structure=structure)
    row_structure = None if ctx.structure is None else {"seq_ids": ctx.seq_ids, **ctx.structure}
    ctx.ulysses = ulysses_context(spec, sp_rank, sp_size, ctx.cu_seqlens, row_structure)
    return local, ctx


# ---------------------------------------------------------------------------------------------- attention
def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: AttentionContext,
                      scaling: float | None, features: AttentionFeatures = NO_FEATURES,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [1, H, L, D], key/value [1, Hkv, L, D] of this rank's L tokens -> [1, L, H, D]: exchange to the
    group's tokens for H/u heads, attend (the local context's kernel for this kind of layer), exchange back.
    `ctx.sp.ulysses`: the micro-batch's UlyssesContext."""
    uctx = ctx.sp.ulysses
    degree = uctx.size
    n_heads, n_kv_heads, length, head_dim = query.shape[1], key.shape[1], query.shape[2], query.shape[3]
    if problem := heads_problem(n_heads, n_kv_heads, degree):
        raise ValueError(f"Ulysses: {problem}")
    repeat = kv_heads_after_repeat(n_kv_heads, degree) // n_kv_heads
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q_per_rank, kv_per_rank = n_heads // degree, key.shape[1] // degree
    # one exchange for q, k and v: per destination rank its query heads, then its key and value heads
    chunks = [t[0].reshape(degree, heads, length, head_dim)
              for t, heads in ((query, q_per_rank), (key, kv_per_rank), (value, kv_per_rank))]
    packed = torch.cat(chunks, dim=1).reshape(-1, length, head_dim)  # [degree · heads per rank, L, D]
    gathered = all_to_all(packed, uctx.group, scatter_dim=0, gather_dim=1)  # [heads per rank, degree · L, D]
    q, k, v = (t.unsqueeze(0) for t in gathered.split([q_per_rank, kv_per_rank, kv_per_rank], dim=0))
    if sinks is not None:
        sinks = sinks[uctx.rank * q_per_rank:(uctx.rank + 1) * q_per_rank]
    out = uctx.local.attend(q, k, v, scaling, features, sinks)
    # [1, degree · L, H/u, D] -> [1, L, H, D]: token chunk i to rank i, heads gathered in rank order
    return all_to_all(out[0], uctx.group, scatter_dim=0, gather_dim=1).unsqueeze(0)
