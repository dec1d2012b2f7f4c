"""Sequence parallelism: one packed micro-batch row split over the ranks of an sp group, exact under any split.

Flow per micro-batch (see docs/ARCHITECTURE.md):
1. `train.steps.batch.make_batch` builds the FULL row: targets shifted once on the full row and the exact per-token
   loss weights of the optimizer step, so no supervised token is lost at a shard boundary.
2. `shard_batch(batch, sp_rank, sp_size, backend, group=...)` pads the row to what the backend needs and keeps
   this rank's tokens (input ids, positions, targets, weights, categories, ...) plus an `SPContext`, which the
   micro-batch's AttentionContext carries to the backend's attention in every layer.
3. Each rank computes `weighted_lm_loss` on its local tokens. The step loss is the plain sum over sp ranks, dp
   ranks and micro-batches (weights are normalised over the whole step), so token losses are never gathered;
   a rank whose shard holds no loss token contributes exactly zero but must still run forward and backward,
   because its keys/values feed the other ranks and the collectives' backward needs every rank.

Layouts:
- contiguous (`torch`, `llama3`): the row is padded at the end to a multiple of sp with one extra padding
  sequence (weight 0, target -100, attends only to itself) and cut into sp equal slices.
- zigzag (`zigzag`): every sequence is padded at its end to a multiple of 2*sp and cut into 2*sp chunks; rank i
  keeps chunks i and 2*sp-1-i of every sequence (balances causal work). The padding tokens follow the real tokens
  of their sequence, so causality keeps every real token from seeing them.

Backends (`SP_BACKENDS`, keyed by train/config/backend_names.py's gather / ring names; train/plan/attention.py chooses one
and, for `torch`, its varlen kernel per kind of layer, once at start):
- `torch`, any CPU or CUDA torch. K/V are all-gathered over the sp group with an autograd-aware collective (whose
  backward sums the K/V gradients back to their owner). Then, in the contiguous layout, ONE varlen kernel call
  (`train/attention/varlen_kernels.py`, the kernel the plan chose) runs the local queries against the gathered keys, as
  ring-flash-attn's llama3 variant does: `shard_batch` computes once per micro-batch, on the host, the
  `Row` of this rank's slice (cu_seqlens_q: the parts of the sequences inside the slice; cu_seqlens_k: from
  the start of each such sequence to its end or the slice end, whichever is first), and the kernels' bottom-right
  causal alignment supplies the offset of every query. The whole row's K/V are gathered (as llama3 does: one
  collective of equal shards); only the key window `key_range` (first local sequence's start to the slice end) is
  kept for the backward pass, so the K/V a rank saves shrink from the row to its window (rank 0: its own slice).
  The zigzag layout and structure mode (Parallel-R1 mask) keep SDPA with the boolean mask of the local queries
  against the gathered keys, built from global token indices: the CPU reference of the zigzag layout, and the
  one SP path that applies the Parallel-R1 mask.
  Per-layer features (`AttentionFeatures`): the varlen call gets them as they are (its bottom-right alignment
  makes the sliding window count from each query's global position); the mask path adds the window to the mask
  (global indices: within a sequence their differences are position differences) and computes softcap and sinks
  by the eager softmax. Sinks are per head and every rank holds all heads: nothing to slice.
- `llama3`: ring-flash-attn's `llama3_flash_attn_varlen_func` (contiguous layout).
- `zigzag`: ring-flash-attn's `zigzag_ring_flash_attn_varlen_func` (zigzag layout).
ring-flash-attn needs flash-attn and CUDA; it is imported only when one of its backends is selected. Its backends
express no sliding window, softcap or sinks here: their `feature_problems` say so before training starts.
Ulysses (train/attention/ulysses.py) builds on this module: the contiguous layout without a backend (`backend=None`), then
its all-to-all of heads around the packed attention or around one of these backends.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import ConfigError
from data.shards.dataset import Structure
from train.config.backend_names import LLAMA3, RING_BACKENDS, TORCH, ZIGZAG
from train.attention.structured import build_mask
from train.attention.varlen_kernels import AttentionFeatures, VarlenKernel, eager_attention
from train.row import Row

LAYOUTS = ("contiguous", "zigzag")

# Per-token batch fields and the value their padding tokens get; position_ids and seq_ids are computed.
TOKEN_PAD_VALUES: dict[str, int | float] = {
    "input_ids": 0,
    "labels": -100,
    "targets": -100,
    "weights": 0.0,
    "target_categories": 0,
    "category_ids": 0,
    "turn_ids": 0,
    "block_ids": 0,
    "path_ids": 0,
}
COMPUTED_TOKEN_FIELDS = ("position_ids", "seq_ids")
STRUCTURE_FIELDS = ("seq_ids", "block_ids", "path_ids")
# Row-level fields replaced by the SPContext (their meaning is the full row's).
ROW_FIELDS = ("cu_seqlens", "max_seqlen")


class SPBackendUnavailable(ConfigError):
    """The selected sequence-parallel backend cannot run here (missing CUDA, flash-attn or ring-flash-attn)."""


def _import_ring_flash_attn(backend: str):
    if not torch.cuda.is_available():
        raise SPBackendUnavailable(
            f"sp_backend={backend!r} needs a CUDA GPU (ring-flash-attn runs flash-attn kernels); "
            "use sp_backend=torch on CPU"
        )
    try:
        import ring_flash_attn
    except ImportError as exc:  # ring_flash_attn's __init__ imports flash_attn
        raise SPBackendUnavailable(
            f"sp_backend={backend!r} needs flash-attn and ring-flash-attn "
            f"(pip install flash-attn ring-flash-attn); import failed: {exc}. "
            "sp_backend=torch works without them"
        ) from exc
    return ring_flash_attn


def ring_flash_attn_reasons(name: str) -> Callable[[bool], list[str]]:
    """Why ring-flash-attn's backend `name` (llama3, zigzag) cannot run here: it needs CUDA, flash-attn and
    ring-flash-attn installed, and half precision (flash kernels have no fp32)."""

    def reasons(half_precision: bool) -> list[str]:
        try:
            _import_ring_flash_attn(name)
        except SPBackendUnavailable as exc:
            return [str(exc)]
        if not half_precision:
            return [f"sp_backend={name!r} runs flash-attn kernels, which need bf16/fp16: set bf16: true or use "
                    "sp_backend=torch"]
        return []

    return reasons


def ring_feature_problems(name: str) -> Callable[[AttentionFeatures], list[str]]:
    """ring-flash-attn's functions are called with flash-attn's causal arguments only: whether its varlen functions
    take `window_size` or `softcap` is not verified here, and sinks need a gradient through the log-sum-exp, which
    they do not return."""

    def problems(features: AttentionFeatures) -> list[str]:
        if not features.names():
            return []
        return [f"sp_backend={name!r} (ring-flash-attn) cannot express {', '.join(features.names())}: use "
                "sp_backend=torch, which all-gathers K/V and applies them exactly"]

    return problems


@dataclass
class SPContext:
    """Everything the sp attention needs about this rank's shard of the (padded) row.

    Token indices are positions in the padded row ("global index"); the gathered order is rank-major
    (rank 0's local tokens, then rank 1's, ...), which is what an all-gather of local tensors produces.
    """

    group: Any
    sp_rank: int
    sp_size: int
    layout: str
    padded_length: int  # tokens of the padded row
    cu_seqlens: torch.Tensor  # [S'+1] int32, padded row (the padding sequence included in contiguous layout)
    max_seqlen: int
    seq_ids: torch.Tensor  # [padded_length] int64 sequence of every padded-row token
    source_index: torch.Tensor  # [padded_length] int64 index in the unpadded row, -1 for padding
    local_index: torch.Tensor  # [L] int64 global index of this rank's tokens, in local order
    gathered_index: torch.Tensor  # [padded_length] int64 global index of every token in all-gather order
    local_range: tuple[int, int] | None  # contiguous layout: [start, end) of this rank in the padded row
    key_range: tuple[int, int]  # gathered keys any local query can see: [start of first local sequence, end)
    # llama3 backend (ring-flash-attn's llama3_flash_attn_prepare_cu_seqlens)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    local_k_slice: slice | None = None
    heads_k_stride: int | None = None  # None: all kv heads in one all-gather
    # torch backend, contiguous layout, no structure: the local queries against the key window, built once per
    # micro-batch (key offsets relative to key_range[0])
    bounds: Row | None = None
    # zigzag backend: cu_seqlens of the local tokens (every sequence contributes 2 chunks)
    local_cu_seqlens: torch.Tensor | None = None
    local_max_seqlen: int = 0
    # structure mode: block_ids / path_ids of every padded-row token (0 for padding) for the Parallel-R1 mask
    structure: dict[str, torch.Tensor] | None = None
    # Ulysses (train/attention/ulysses.py `ulysses_shard`): the UlyssesContext (groups and the local attention's context)
    ulysses: Any = None
    # torch backend masks by sliding window (None: full), built once per micro-batch
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def local_length(self) -> int:
        return int(self.local_index.numel())

    def to(self, device: torch.device | str) -> "SPContext":
        """A copy with every tensor on `device` (cu_seqlens for flash-attn must live on the GPU)."""
        moved = {
            name: value.to(device)
            for name, value in vars(self).items()
            if isinstance(value, torch.Tensor)
        }
        if self.structure is not None:
            moved["structure"] = {k: v.to(device) for k, v in self.structure.items()}
        if self.bounds is not None:
            moved["bounds"] = self.bounds.to(device)
        if self.ulysses is not None:
            moved["ulysses"] = self.ulysses.to(device)
        return replace(self, _masks={}, **moved)

    def attention_mask(self, device: torch.device, sliding_window: int | None = None) -> torch.Tensor:
        """[L, K] bool: local query i may attend gathered key j (K = key_range width). Cached per sliding window:
        the same in every layer of that kind."""
        key = (str(device), sliding_window)
        if key not in self._masks:
            self._masks[key] = self._build_mask(sliding_window).to(device)
        return self._masks[key]

    def _build_mask(self, sliding_window: int | None) -> torch.Tensor:
        q = self.local_index
        k = self.gathered_index[self.key_range[0] : self.key_range[1]]
        if self.structure is None:
            visible = (self.seq_ids[q][:, None] == self.seq_ids[k][None, :]) & (k[None, :] <= q[:, None])
            if sliding_window is not None:
                visible &= k[None, :] > q[:, None] - sliding_window
            return visible
        block, path = self.structure["block_ids"], self.structure["path_ids"]
        return build_mask(self.seq_ids[q], block[q], path[q], q, self.seq_ids[k], block[k], path[k], k)


def _row_length(batch: dict) -> int:
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"shard_batch: input_ids must be [1, T] (one packed micro-batch), got {tuple(ids.shape)}")
    return int(ids.shape[1])


def _token_fields(batch: dict, length: int) -> dict[str, torch.Tensor]:
    """Per-token tensors of the batch ([T] or [1, T]); an unknown per-token field is an error, not a silent drop."""
    fields = {}
    for name, value in batch.items():
        if name in ROW_FIELDS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() in (1, 2) and value.shape[-1] == length and (value.dim() == 1 or value.shape[0] == 1):
            if name not in TOKEN_PAD_VALUES and name not in COMPUTED_TOKEN_FIELDS:
                raise ValueError(
                    f"shard_batch: per-token field {name!r} has no padding rule; "
                    f"known: {sorted(TOKEN_PAD_VALUES) + list(COMPUTED_TOKEN_FIELDS)}"
                )
            fields[name] = value
    return fields


@dataclass
class _PadPlan:
    """Where every token of the padded row comes from (all tensors CPU int64 except cu_seqlens)."""

    cu_seqlens: torch.Tensor  # [S'+1] int32
    seq_ids: torch.Tensor  # [T'] sequence of each padded-row token
    source_index: torch.Tensor  # [T'] index in the unpadded row, -1 for padding
    offset_in_seq: torch.Tensor  # [T'] offset of each token in its padded sequence
    n_real: torch.Tensor  # [S'] real tokens of each padded sequence (0 for the contiguous padding sequence)
    real_starts: torch.Tensor  # [S'] index in the unpadded row of each sequence's first real token


def _pad_plan(cu_seqlens: torch.Tensor, sp_size: int, layout: str) -> _PadPlan:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    total = int(cu_seqlens[-1])
    if layout == "contiguous":
        padded_total = -(-total // sp_size) * sp_size
        pad = padded_total - total
        padded_lengths = torch.cat([lengths, torch.tensor([pad])]) if pad else lengths
        n_real = torch.cat([lengths, torch.tensor([0])]) if pad else lengths
    else:
        multiple = 2 * sp_size
        padded_lengths = -(-lengths // multiple) * multiple
        n_real = lengths
    padded_cu = torch.zeros(len(padded_lengths) + 1, dtype=torch.int32)
    padded_cu[1:] = torch.cumsum(padded_lengths, 0)
    seq_ids = torch.repeat_interleave(torch.arange(len(padded_lengths)), padded_lengths)
    offset_in_seq = torch.arange(int(padded_cu[-1])) - padded_cu[:-1].to(torch.int64)[seq_ids]
    real_starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(n_real, 0)[:-1]])
    source_index = torch.where(
        offset_in_seq < n_real[seq_ids], real_starts[seq_ids] + offset_in_seq, torch.full_like(seq_ids, -1)
    )
    return _PadPlan(padded_cu, seq_ids, source_index, offset_in_seq, n_real, real_starts)


def _take(plan: _PadPlan, name: str, value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Field `name` of the padded-row tokens `index` (padding gets TOKEN_PAD_VALUES; seq_ids and position_ids
    are derived: padding continues its sequence's positions, or counts from 0 in its own padding sequence)."""
    flat = value.reshape(-1).cpu()
    seq = plan.seq_ids[index]
    if name == "seq_ids":
        return seq.to(flat.dtype)
    src = plan.source_index[index]
    is_pad = src < 0
    out = flat[src.clamp(min=0)]
    if name == "position_ids":
        has_real = plan.n_real > 0
        last_real = (plan.real_starts + plan.n_real - 1).clamp(min=0)
        next_position = torch.where(has_real, flat[last_real] + 1, torch.zeros_like(last_real)).to(flat.dtype)
        pad_positions = next_position[seq] + (plan.offset_in_seq[index] - plan.n_real[seq]).to(flat.dtype)
        return torch.where(is_pad, pad_positions, out)
    return out.masked_fill(is_pad, TOKEN_PAD_VALUES[name])


def slice_varlen_offsets(padded_cu: list[int], start: int, end: int) -> tuple[list[int], list[int], int]:
    """(cu_q, cu_k, key_start) of the contiguous slice [start, end) of a row with sequence offsets `padded_cu`:
    per sequence overlapping the slice, its queries inside the slice and its keys from the sequence start to the
    slice end (or the sequence end), counted from key_start = start of the first such sequence. Bottom-right
    causal alignment of these spans is exactly "key index <= query index" within each sequence."""
    if not 0 <= start < end <= padded_cu[-1]:
        raise ValueError(f"slice [{start}, {end}) is not a non-empty part of a row of {padded_cu[-1]} tokens")
    first = bisect.bisect_right(padded_cu, start) - 1  # the sequence holding token `start`
    key_start = padded_cu[first]
    cu_q, cu_k = [0], [0]
    for seq_start, seq_end in zip(padded_cu[first:-1], padded_cu[first + 1:]):
        if seq_start >= end:
            break
        if seq_end == seq_start:
            continue
        cu_q.append(min(seq_end, end) - start)
        cu_k.append(min(seq_end, end) - key_start)
    return cu_q, cu_k, key_start


def _zigzag_indices(padded_cu: torch.Tensor, sp_size: int, rank: int) -> torch.Tensor:
    """Global indices of rank's tokens: chunks rank and 2*sp-1-rank of every sequence, in sequence order."""
    parts = []
    for start, end in zip(padded_cu[:-1].tolist(), padded_cu[1:].tolist()):
        chunk = (end - start) // (2 * sp_size)
        for c in (rank, 2 * sp_size - 1 - rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def shard_batch(
    batch: dict,
    sp_rank: int,
    sp_size: int,
    backend: str | None,
    *,
    group: Any = None,
    layout: str | None = None,
    heads_k_stride: int | None = None,
    structure: Structure = Structure.NONE,
) -> tuple[dict, SPContext]:
    """This rank's part of a full micro-batch's row (a MicroBatch of train/steps/batch.py, or its `row_fields()`: the
    per-token tensors and the row's bounds), and the SPContext for attention.

    Call once per micro-batch on the full batch (targets and weights already computed on the full row), on CPU
    tensors; move the local batch and `ctx.to(device)` to the GPU afterwards. `layout` defaults to the backend's
    (`zigzag` for zigzag, else contiguous); `backend="torch", layout="zigzag"` is the CPU reference of the zigzag
    layout. The local batch keeps every per-token field (sliced, [1, L] or [L] as given) and every non-token
    field; `cu_seqlens`/`max_seqlen` describe the full row and are dropped (the SPContext holds what attention
    needs). `structure` PARALLEL_THINKING (the data's; block / path ids in the row) needs the torch backend, or None. `backend=None`: the
    contiguous slices alone, with nothing a backend needs (what Ulysses shards: train/attention/ulysses.py `ulysses_shard`).
    """
    if hasattr(batch, "row_fields"):  # a MicroBatch (train/steps/batch.py): its row, its structure
        batch, structure = batch.row_fields(), batch.structure
    if backend is not None and backend not in SP_BACKENDS:
        raise ValueError(f"shard_batch: backend must be one of {RING_BACKENDS} or None (choose 'auto' first), got "
                         f"{backend!r}")
    native = "contiguous" if backend is None else SP_BACKENDS[backend].layout
    layout = layout or native
    if layout not in LAYOUTS:
        raise ValueError(f"shard_batch: layout must be one of {LAYOUTS}, got {layout!r}")
    if backend != TORCH and layout != native:
        raise ValueError(f"shard_batch: backend {backend!r} needs the {native} layout, got {layout!r}")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"shard_batch: sp_rank {sp_rank} out of range for sp_size {sp_size}")
    length = _row_length(batch)
    if length == 0:
        raise ValueError("shard_batch: the micro-batch has no token")
    cu_seqlens = batch["cu_seqlens"].to("cpu", torch.int64)
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != length:
        raise ValueError(
            f"shard_batch: cu_seqlens must run from 0 to the row length {length}, got {cu_seqlens.tolist()}"
        )
    if structure is Structure.TREE:
        raise ValueError("shard_batch: stepwise trees have no sequence-parallel layout")
    structured = structure is Structure.PARALLEL_THINKING
    if not structured and any(name in batch for name in STRUCTURE_FIELDS[1:]):
        raise ValueError(f"shard_batch: the row holds {list(STRUCTURE_FIELDS[1:])}: say its structure (structure=)")
    if structured and backend not in (TORCH, None):
        raise ValueError(
            f"structure mode (Parallel-R1 mask) needs sp_backend=torch or ulysses; {backend!r} runs causal flash "
            "kernels only"
        )

    fields = _token_fields(batch, length)
    plan = _pad_plan(cu_seqlens, sp_size, layout)
    padded_cu, seq_ids = plan.cu_seqlens, plan.seq_ids
    padded_length = int(padded_cu[-1])

    if layout == "contiguous":
        per_rank = padded_length // sp_size
        local_range = (sp_rank * per_rank, (sp_rank + 1) * per_rank)
        local_index = torch.arange(*local_range)
        gathered_index = torch.arange(padded_length)
        cu_q, cu_k, key_start = slice_varlen_offsets(padded_cu.tolist(), *local_range)
        key_range = (key_start, local_range[1])
    else:
        local_range = None
        local_index = _zigzag_indices(padded_cu, sp_size, sp_rank)
        gathered_index = torch.cat([_zigzag_indices(padded_cu, sp_size, r) for r in range(sp_size)])
        key_range = (0, padded_length)

    local_batch = {name: value for name, value in batch.items() if name not in ROW_FIELDS and name not in fields}
    for name, value in fields.items():
        local = _take(plan, name, value, local_index)
        local_batch[name] = (local.unsqueeze(0) if value.dim() == 2 else local).to(value.device)

    lengths = padded_cu[1:] - padded_cu[:-1]
    ctx = SPContext(
        group=group,
        sp_rank=sp_rank,
        sp_size=sp_size,
        layout=layout,
        padded_length=padded_length,
        cu_seqlens=padded_cu,
        max_seqlen=int(lengths.max()) if len(lengths) else 0,
        seq_ids=seq_ids,
        source_index=plan.source_index,
        local_index=local_index,
        gathered_index=gathered_index,
        local_range=local_range,
        key_range=key_range,
        heads_k_stride=heads_k_stride,
    )
    if backend == TORCH and layout == "contiguous" and not structured:
        ctx.bounds = Row.build(cu_q, cu_k)
    if structured:
        missing = [name for name in STRUCTURE_FIELDS if name not in fields]
        if missing:
            raise ValueError(f"shard_batch: structure mode needs per-token {list(STRUCTURE_FIELDS)}, missing {missing}")
        every = torch.arange(padded_length)
        ctx.structure = {
            name: _take(plan, name, fields[name], every).to(torch.int64) for name in ("block_ids", "path_ids")
        }
    if backend == LLAMA3:
        ring = _import_ring_flash_attn(backend)
        cu_q, cu_k, max_q, max_k, k_slice = ring.llama3_flash_attn_prepare_cu_seqlens(
            padded_cu, causal=True, rank=sp_rank, world_size=sp_size
        )
        ctx.cu_seqlens_q, ctx.cu_seqlens_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.local_k_slice = int(max_q), int(max_k), k_slice
    if layout == "zigzag":
        ctx.local_cu_seqlens = (padded_cu // sp_size).to(torch.int32)
        ctx.local_max_seqlen = ctx.max_seqlen // sp_size
    return local_batch, ctx


# ---------------------------------------------------------------------------------------------------- attention
class _GatherSequence(torch.autograd.Function):
    """All-gather equal shards along `dim` over `group`; backward sums every rank's gradient of each shard back to
    its owner (reduce-scatter on NCCL, all-reduce + slice elsewhere).

    torch.distributed.nn.functional.all_gather is not used: on gloo its backward (all-to-all emulated with
    scatter) passes group ranks where global ranks are expected and fails for any sp group that does not contain
    global rank 0..sp-1, i.e. every sp group but the first when dp > 1 (torch 2.13)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        if grad.is_cuda and "nccl" in str(dist.get_backend(ctx.group)):
            chunks = [c.contiguous() for c in grad.chunk(world, dim=ctx.dim)]
            mine = torch.empty_like(chunks[rank])
            dist.reduce_scatter(mine, chunks, group=ctx.group)
        else:
            total = grad.clone(memory_format=torch.contiguous_format)  # never reduce into autograd's buffer
            dist.all_reduce(total, group=ctx.group)
            mine = total.chunk(world, dim=ctx.dim)[rank].contiguous()
        return mine, None, None


def _gather_sequence(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather [B, H, L, D] along L over the sp group (rank order), differentiable."""
    return _GatherSequence.apply(tensor, group, 2)


def gather_attention(query, key, value, ctx: SPContext, scaling: float | None, features: AttentionFeatures,
                     sinks: torch.Tensor | None, kernel: VarlenKernel | None = None) -> torch.Tensor:
    """The `torch` backend: K/V all-gathered, then one call of the varlen `kernel` (the contiguous layout) or SDPA
    with the boolean mask (the zigzag layout, the Parallel-R1 mask)."""
    if ctx.bounds is not None:
        if kernel is None:
            raise ValueError("gather_attention: the varlen path (contiguous layout) needs its kernel")
        return _gather_varlen_attention(query, key, value, ctx, scaling, features, sinks, kernel)
    if ctx.sp_size > 1:  # one collective for K and V together
        n_kv_heads = key.shape[1]
        key, value = _gather_sequence(torch.cat([key, value], dim=1), ctx.group).split(n_kv_heads, dim=1)
    start, end = ctx.key_range
    key, value = key[:, :, start:end], value[:, :, start:end]
    mask = ctx.attention_mask(query.device, features.sliding_window)
    if features.needs_eager_softmax:
        n_rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
        out = eager_attention(query, key, value, mask, scaling, features, sinks)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=features.dropout, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )
    return out.transpose(1, 2).contiguous()


def _gather_varlen_attention(query, key, value, ctx: SPContext, scaling, features: AttentionFeatures,
                             sinks: torch.Tensor | None, kernel: VarlenKernel) -> torch.Tensor:
    """Contiguous layout: one varlen kernel call of the local queries against the gathered key window."""
    q = query[0].transpose(0, 1).contiguous()  # [L, H, D]
    kv = torch.stack([key[0], value[0]]).transpose(1, 2).contiguous()  # [2, L, Hkv, D]: one collective for both
    if ctx.sp_size > 1:
        kv = _GatherSequence.apply(kv, ctx.group, 1)
    start, end = ctx.key_range
    # a copy of the key window when it is shorter than the row: the kernel keeps its inputs for backward, and a
    # view would keep the whole gathered row alive in every layer
    window = kv[:, start:end].contiguous()
    return kernel.fn(q, window[0], window[1], ctx.bounds, scaling, features, sinks).unsqueeze(0)


def _flash_layout(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """[1, H, L, D] -> [L, H, D] (flash-attn's varlen layout)."""
    if tensor.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"sp_backend={backend!r} runs flash-attn kernels, which need bf16/fp16 tensors, got {tensor.dtype}; "
            "train with bf16: true or use sp_backend=torch"
        )
    return tensor[0].transpose(0, 1).contiguous()


def llama3_attention(query, key, value, ctx: SPContext, scaling, features: AttentionFeatures,
                     sinks: torch.Tensor | None, kernel: VarlenKernel | None = None) -> torch.Tensor:
    ring = _import_ring_flash_attn(LLAMA3)
    n_kv_heads = key.shape[1]
    stride = ctx.heads_k_stride or n_kv_heads
    if n_kv_heads % stride:
        raise ValueError(f"heads_k_stride={stride} must divide the number of kv heads {n_kv_heads}")
    out = ring.llama3_flash_attn_varlen_func(
        _flash_layout(query, LLAMA3), _flash_layout(key, LLAMA3), _flash_layout(value, LLAMA3),
        ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, stride, ctx.local_k_slice,
        dropout_p=features.dropout, softmax_scale=scaling, causal=True, group=ctx.group,
    )
    return out.unsqueeze(0)


def zigzag_attention(query, key, value, ctx: SPContext, scaling, features: AttentionFeatures,
                     sinks: torch.Tensor | None, kernel: VarlenKernel | None = None) -> torch.Tensor:
    ring = _import_ring_flash_attn(ZIGZAG)
    out = ring.zigzag_ring_flash_attn_varlen_func(
        _flash_layout(query, ZIGZAG), _flash_layout(key, ZIGZAG), _flash_layout(value, ZIGZAG),
        ctx.local_cu_seqlens, ctx.local_max_seqlen,
        dropout_p=features.dropout, softmax_scale=scaling, causal=True, group=ctx.group,
    )
    return out.unsqueeze(0)


# ---------------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class SPBackend:
    """A gather / ring backend: the layout its rows are sharded in, its attention (query [1, H, L, D] and key/value
    [1, Hkv, L, D] of this rank's L tokens, RoPE applied with the global positions -> [1, L, H, D]; `kernel`: the
    varlen kernel of the `torch` contiguous path), why it cannot run here and which layer features it cannot
    express."""

    name: str
    layout: str
    attention: Callable[..., torch.Tensor]
    reasons: Callable[[bool], list[str]]  # (half_precision) -> why it cannot run here
    feature_problems: Callable[[AttentionFeatures], list[str]]


SP_BACKENDS: dict[str, SPBackend] = {
    TORCH: SPBackend(TORCH, "contiguous", gather_attention, lambda half_precision: [], lambda features: []),
    LLAMA3: SPBackend(LLAMA3, "contiguous", llama3_attention, ring_flash_attn_reasons(LLAMA3),
                      ring_feature_problems(LLAMA3)),
    ZIGZAG: SPBackend(ZIGZAG, "zigzag", zigzag_attention, ring_flash_attn_reasons(ZIGZAG),
                      ring_feature_problems(ZIGZAG)),
}
if tuple(SP_BACKENDS) != RING_BACKENDS:
    raise ImportError(f"SP_BACKENDS {tuple(SP_BACKENDS)} must be train/config/backend_names.py's {RING_BACKENDS}")
