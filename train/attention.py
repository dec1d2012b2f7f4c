"""The packed-sequence attention function, registered with transformers as `attn_implementation="packsft"`.

The model is called with `use_cache=False` and `packsft=AttentionContext(...)`; transformers forwards unknown keyword
arguments of `model(...)` down to the attention function, which is how the varlen boundaries reach it without
touching transformers' internals. Packed samples never attend to each other:
- `flash_varlen`: flash-attn's varlen kernel with cu_seqlens (CUDA + flash-attn, fp16/bf16);
- `sdpa`: torch SDPA, causal, on each packed sequence in turn (= the block-diagonal causal mask; the CPU path
  and the GPU fallback);
- structure mode (the batch carries block/path ids): the Parallel-R1 mask of train/structured_attention.py
  (FlexAttention on CUDA, SDPA one sequence at a time otherwise);
- `ctx.sp` set: the sequence-parallel backends of train/sequence_parallel.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "packsft"


@dataclass
class AttentionContext:
    """Per-forward description of the packed micro-batch (shared by every layer)."""

    cu_seqlens: torch.Tensor  # int32 [S+1], boundaries of the packed sequences in this rank's tokens
    max_seqlen: int
    backend: str = "auto"  # auto | sdpa | flash_varlen
    sp: Any = None  # train.sequence_parallel.SPContext when sequence parallelism is on
    seq_ids: torch.Tensor | None = None  # structure mode: per-token ids for the Parallel-R1 mask
    block_ids: torch.Tensor | None = None
    path_ids: torch.Tensor | None = None

    # structure mode on CUDA: FlexAttention's BlockMask, built by the first layer and reused by the others
    _block_mask: Any = field(default=None, init=False, repr=False, compare=False)
    _block_mask_key: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def structured(self) -> bool:
        return self.block_ids is not None or self.path_ids is not None

    def structured_block_mask(self, device: torch.device, length: int):
        """The BlockMask of this micro-batch's structured mask over `length` tokens on `device`, built once."""
        key = (str(device), length)
        if self._block_mask_key != key:
            from train.structured_attention import structured_block_mask

            ids = (self.seq_ids, self.block_ids, self.path_ids, torch.arange(length, device=device))
            self._block_mask = structured_block_mask(*ids, *ids, length, length, device)
            self._block_mask_key = key
        return self._block_mask


@functools.lru_cache(maxsize=1)
def flash_attn_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(requested: str, query: torch.Tensor) -> str:
    """`auto` picks flash_varlen when usable for this tensor (CUDA, half precision, flash-attn installed)."""
    usable = flash_attn_available() and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if requested == "flash_varlen":
        if not usable:
            raise RuntimeError(
                "attn_backend=flash_varlen needs CUDA, flash-attn and bf16/fp16 tensors; use attn_backend=sdpa"
            )
        return "flash_varlen"
    if requested == "auto":
        return "flash_varlen" if usable else "sdpa"
    return "sdpa"


def _repeat_kv(query, key, value):
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    return key, value


def _sdpa_varlen(query, key, value, cu_seqlens: torch.Tensor, scaling, dropout) -> torch.Tensor:
    """Causal SDPA on each packed sequence separately: exact block-diagonal attention at the cost of sum(L_i^2)
    instead of T^2 for a masked T x T product (the boolean-mask form wastes most of its work on packed rows)."""
    key, value = _repeat_kv(query, key, value)
    bounds = cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], dropout_p=dropout, scale=scaling, is_causal=True
        )
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous()  # [B, T, H, D]


def _flash_varlen(query, key, value, ctx: AttentionContext, scaling, dropout) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    # [1, H, T, D] -> [T, H, D]; flash-attn handles GQA (fewer kv heads) natively
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu = ctx.cu_seqlens.to(device=query.device, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q, k, v, cu, cu, ctx.max_seqlen, ctx.max_seqlen, dropout_p=dropout, softmax_scale=scaling, causal=True
    )
    return out.unsqueeze(0)  # [1, T, H, D]


def packsft_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packsft: AttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    ctx = packsft
    if ctx is None:
        raise RuntimeError(
            "attn_implementation='packsft' needs model(..., use_cache=False, packsft=AttentionContext(...))"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch dimension 1, got {query.shape[0]}")
    dropout = dropout if module.training else 0.0
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # bf16 without DeepSpeed: the weights stay fp32 under autocast, so q/k arrive fp32 (RoPE in fp32) and v in
        # the autocast dtype; flash-attn and the ring backends need one half-precision dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if ctx.sp is not None:
        from train.sequence_parallel import sp_attention

        return sp_attention(module, query, key, value, ctx.sp, scaling), None
    total = query.shape[2]
    if ctx.structured:
        from train.structured_attention import flex_structured_attention, structured_sdpa_by_sequence

        index = torch.arange(total, device=query.device)
        ids = (ctx.seq_ids, ctx.block_ids, ctx.path_ids, index)
        if query.is_cuda:
            block_mask = ctx.structured_block_mask(query.device, total)
            return flex_structured_attention(query, key, value, *ids, *ids, scaling, block_mask=block_mask), None
        return structured_sdpa_by_sequence(query, key, value, *ids, *ids, scaling), None
    if resolve_backend(ctx.backend, query) == "flash_varlen":
        return _flash_varlen(query, key, value, ctx, scaling, dropout), None
    if int(ctx.cu_seqlens[-1]) != total:
        raise ValueError(f"cu_seqlens covers {int(ctx.cu_seqlens[-1])} tokens, the micro-batch has {total}")
    return _sdpa_varlen(query, key, value, ctx.cu_seqlens, scaling, dropout), None


AttentionInterface.register(ATTN_IMPLEMENTATION, packsft_attention)
