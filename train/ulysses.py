"""Ulysses sequence parallelism, alone or inside the gather / ring backends (the hybrid), and the choice by shape.

Ulysses (`sp_backend: ulysses`, DeepSpeed-Ulysses' scheme). The row is laid out as for the `torch` backend
(contiguous: padded at the end to a multiple of sp with one padding sequence that attends only to itself, rank i
holding slice i). In every layer one all-to-all over the Ulysses group of u ranks turns this rank's q/k/v
[L/sp tokens, all heads] into [u·L/sp tokens, heads/u]; the rank then runs ordinary packed attention on those
tokens for its heads, and a second all-to-all returns the output to [L/sp tokens, all heads]. Both exchanges are
autograd-aware (`_AllToAll`: the backward of an all-to-all is the inverse all-to-all).
- u = sp (pure Ulysses): the rank holds the WHOLE row for its heads, so the local attention is the packed path of
  train/attention.py (`packed_attention`: its backend table with every per-layer feature, or the Parallel-R1
  mask) over the whole row's boundaries, nothing sequence-parallel about it.
- u < sp (hybrid, sp = u × r): ranks are numbered sp_rank = ring_rank · u + ulysses_rank, so a Ulysses group is
  u adjacent ranks and holds u adjacent slices: a contiguous block of the row. Across the r groups, the ranks with
  the same head slice (same ulysses_rank) form the ring group and run the `torch` gather backend (or `llama3` on
  GPUs) of train/sequence_parallel.py on those blocks, exactly as sp = r would on the row.

Heads: query heads are split into u contiguous chunks, so u must divide the heads. Key/value heads too; when
there are fewer kv heads than u (GQA), each is repeated u / kv_heads times before the exchange (u must then be a
multiple of them), so that every rank gets the one kv head its query heads read. Per-head parameters (attention
sinks `s_aux` [H]) are sliced to the rank's heads; the slice's gradient flows back to the full parameter.

Recurrent token mixers (hybrid linear-attention / state-space models) stay refused under every SP backend,
Ulysses included (train/recurrent.py): they are not attention, so no head exchange reaches them and each rank
would still see only its slice of every sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from common.config import ConfigError
from train.sp_rules import (allowed_degrees, degree_problem, heads_problem, kv_heads_after_repeat, placement_problem,
                            ulysses_size_problem)
from train.varlen_kernels import NO_FEATURES, AttentionFeatures


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


# ---------------------------------------------------------------------------------------------- the choice
@dataclass(frozen=True)
class SPLayout:
    """How an sp group of `sp_size` ranks splits: Ulysses groups of `ulysses_size` (1: no Ulysses) times
    `sp_size // ulysses_size` ranks of the gather / ring backend; `reason` is the start line's explanation."""

    sp_size: int
    ulysses_size: int
    reason: str

    @property
    def ring_size(self) -> int:
        return self.sp_size // self.ulysses_size

    def describe(self, ring_backend: str | None) -> str:
        """e.g. 'ulysses 4', 'hybrid ulysses 2 x torch 2', 'torch 4' (`ring_backend`: the gather / ring backend)."""
        if self.ring_size == 1:
            return f"ulysses {self.ulysses_size}"
        if self.ulysses_size == 1:
            return f"{ring_backend} {self.ring_size}"
        return f"hybrid ulysses {self.ulysses_size} x {ring_backend} {self.ring_size}"


def choose_sp_layout(sp_backend: str, sp_size: int, ulysses_size: int | None, n_heads: int, n_kv_heads: int,
                     processes_per_machine: int) -> SPLayout:
    """The Ulysses degree of an sp group, from the config (`sp_backend`, `sp_ulysses_size`), the model's heads and
    the processes per machine. Raises ConfigError naming the numbers and the alternatives when the config asks for
    what the heads or the placement do not allow (the rules: train/sp_rules.py).

    - `sp_ulysses_size` set: that degree (1: no Ulysses; < sp: the hybrid);
    - `sp_backend: ulysses`: pure Ulysses (degree sp);
    - `sp_backend: auto`: the largest degree the heads allow that fits one machine: pure Ulysses when that is sp,
      the hybrid when it is smaller, no Ulysses (gather / ring) when the heads allow none;
    - `torch` / `llama3` / `zigzag`: no Ulysses, as before Ulysses existed."""
    if problem := (ulysses_size_problem(sp_backend, sp_size, ulysses_size)
                   or placement_problem(sp_backend, sp_size, ulysses_size, processes_per_machine)):
        raise ConfigError(problem)
    heads = f"{n_heads} heads / {n_kv_heads} kv heads"
    allowed = allowed_degrees(n_heads, n_kv_heads, sp_size)
    alternatives = (f"degrees these heads allow for sequence_parallel_size={sp_size}: "
                    f"{allowed or 'none'}; alternatives: sp_ulysses_size=<one of those> (the hybrid when smaller "
                    f"than {sp_size}) or sp_backend=torch (all-gathered K/V, any head count)")
    if ulysses_size is not None:
        if ulysses_size == 1:
            return SPLayout(sp_size, 1, "sp_ulysses_size=1: no Ulysses")
        if problem := heads_problem(n_heads, n_kv_heads, ulysses_size):
            raise ConfigError(f"sp_ulysses_size={ulysses_size}: {problem}; {alternatives}")
        return SPLayout(sp_size, ulysses_size, f"sp_ulysses_size={ulysses_size} set ({heads})")
    if sp_backend == "ulysses":
        if problem := heads_problem(n_heads, n_kv_heads, sp_size):
            raise ConfigError(f"sp_backend=ulysses with sequence_parallel_size={sp_size}: {problem}; "
                              f"{alternatives}")
        return SPLayout(sp_size, sp_size, f"sp_backend=ulysses ({heads})")
    if sp_backend != "auto":
        return SPLayout(sp_size, 1, f"sp_backend={sp_backend} set")
    fitting = [d for d in allowed if processes_per_machine % d == 0]
    if not fitting:
        why = (f"no Ulysses degree > 1 of {sp_size} splits {heads}" if not allowed else
               f"no Ulysses degree of {sp_size} allowed by {heads} ({allowed}) divides the "
               f"{processes_per_machine} processes per machine")
        return SPLayout(sp_size, 1, f"auto: {why}")
    degree = fitting[-1]
    repeat = kv_heads_after_repeat(n_kv_heads, degree)
    kv = f", kv heads repeated to {repeat}" if repeat != n_kv_heads else ""
    if degree == sp_size:
        return SPLayout(sp_size, degree, f"auto: {heads} split over {degree} ranks{kv}; the group fits one machine "
                                         f"({processes_per_machine} processes)")
    limit = ("the largest degree the heads allow" if degree == allowed[-1]
             else f"the largest degree fitting one machine ({processes_per_machine} processes)")
    return SPLayout(sp_size, degree, f"auto: Ulysses over {degree} ranks ({heads}{kv}; {limit}) x "
                                     f"{sp_size // degree} groups")


# ---------------------------------------------------------------------------------------------- per micro-batch
@dataclass(frozen=True)
class UlyssesSpec:
    """The process groups and backends of Ulysses, fixed for a run (the trainer builds it once)."""

    size: int  # ranks of one Ulysses group (adjacent sp ranks)
    group: Any  # this rank's Ulysses group
    ring_group: Any = None  # this rank's group across the Ulysses groups (same heads), when size < sp
    ring_backend: str = "torch"  # across the groups: torch (all-gathered K/V) or llama3
    attn_backend: str = "auto"  # pure Ulysses: the local attention backend (train/attention.py's table)


@dataclass
class UlyssesContext:
    """What `ulysses_attention` needs for one micro-batch: the groups, and the context of the local attention:
    `row` (pure Ulysses: the whole padded row as one packed micro-batch) or `ring` (hybrid: the SPContext of this
    Ulysses group's block of the row over the ring group)."""

    group: Any
    size: int
    rank: int
    row: Any = None  # train.attention.AttentionContext
    ring: Any = None  # train.sequence_parallel.SPContext

    def to(self, device: torch.device | str) -> "UlyssesContext":
        if self.ring is not None:
            return replace(self, ring=self.ring.to(device))
        from train.attention import AttentionContext

        row = self.row
        structure = {name: getattr(row, name).to(device) for name in ("seq_ids", "block_ids", "path_ids")
                     if getattr(row, name) is not None}
        moved = AttentionContext.for_micro_batch(torch.tensor(row.bounds.host_cu_q), device, row.backend, **structure)
        return replace(self, row=moved)


def ulysses_context(spec: UlyssesSpec, sp_rank: int, sp_size: int, padded_cu: torch.Tensor,
                    structure: dict[str, torch.Tensor] | None) -> UlyssesContext:
    """The UlyssesContext of rank `sp_rank` for a padded row with sequence offsets `padded_cu` (a multiple of sp
    tokens long) and, in structure mode, the padded row's seq/block/path ids."""
    if spec.size < 2 or (problem := degree_problem(sp_size, spec.size)):
        raise ValueError(f"Ulysses degree {spec.size}: must be > 1; {problem}")
    ring_size = sp_size // spec.size
    ring_rank, rank = divmod(sp_rank, spec.size)
    if ring_size == 1:
        from train.attention import AttentionContext

        row = AttentionContext.for_micro_batch(padded_cu, "cpu", spec.attn_backend, **(structure or {}))
        return UlyssesContext(spec.group, spec.size, rank, row=row)
    from train.sequence_parallel import shard_batch

    if spec.ring_group is None:
        raise ValueError(f"the hybrid (Ulysses {spec.size} x {ring_size}) needs the ring group")
    padded_length = int(padded_cu[-1])
    row = {"input_ids": torch.zeros(1, padded_length, dtype=torch.int64), "cu_seqlens": padded_cu}
    row.update(structure or {})
    _, ring = shard_batch(row, ring_rank, ring_size, spec.ring_backend, group=spec.ring_group)
    return UlyssesContext(spec.group, spec.size, rank, ring=ring)


# ---------------------------------------------------------------------------------------------- attention
def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      uctx: UlyssesContext, scaling: float | None, features: AttentionFeatures = NO_FEATURES,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [1, H, L, D], key/value [1, Hkv, L, D] of this rank's L tokens -> [1, L, H, D]: exchange to the
    group's tokens for H/u heads, attend, exchange back."""
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
    if uctx.ring is not None:
        from train.sequence_parallel import sp_attention

        out = sp_attention(module, q, k, v, uctx.ring, scaling, features, sinks)
    else:
        from train.attention import packed_attention

        out = packed_attention(q, k, v, uctx.row, scaling, features, sinks)
    # [1, degree · L, H/u, D] -> [1, L, H, D]: token chunk i to rank i, heads gathered in rank order
    return all_to_all(out[0], uctx.group, scatter_dim=0, gather_dim=1).unsqueeze(0)
