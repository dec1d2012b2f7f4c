"""The packed-sequence attention function, registered with transformers as `attn_implementation="packsft"`.

The model is called with `use_cache=False` and `packsft=AttentionContext(...)`; transformers forwards unknown keyword
arguments of `model(...)` down to the attention function, which is how the varlen boundaries reach it without
touching transformers' internals. Packed samples never attend to each other.

Behind the one registration sits a PackSFT-owned table of backends (`BACKENDS`), each a record with the reasons it
cannot run for given inputs (empty list = usable). Every backend takes transformers' [1, H, T, D] query and
[1, Hkv, T, D] key/value and returns [1, T, H, D]:
- `flash_varlen`: flash-attn's varlen kernel (CUDA + flash-attn installed, fp16/bf16);
- `torch_varlen`: torch's built-in `torch.nn.attention.varlen.varlen_attn` (CUDA builds of torch >= 2.9, fp16/bf16);
- `flex`: FlexAttention with a document mask (CUDA; its backward does not run on CPU);
- `sdpa`: causal SDPA on each packed sequence in turn: one kernel launch per sequence, the CPU path and last resort.
`attn_backend: auto` takes the first exact backend with no reasons in that (static) order; a named backend that
cannot run raises its reasons. The order is fixed, not timed at start-up: see benchmarks/bench_train_gpu.py.

No host sync inside a layer: the context carries a `VarlenBounds` (device cu_seqlens plus host copies and max
lengths) built once per micro-batch, and everything derived from it (the flex BlockMask) is built by the first layer
and reused by the others. Structure mode (Parallel-R1 mask) and sequence parallelism (`ctx.sp`) dispatch first.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AttentionInterface

from train import varlen_kernels
from train.varlen_kernels import VarlenBounds, varlen_attention

ATTN_IMPLEMENTATION = "packsft"
AUTO_ORDER = ("flash_varlen", "torch_varlen", "flex", "sdpa")
BACKEND_CHOICES = ("auto", *AUTO_ORDER)


@dataclass
class AttentionContext:
    """Per-forward description of the packed micro-batch (shared by every layer).

    Build it with `AttentionContext.for_micro_batch` (one host→device copy of the offsets); constructing it from a
    `cu_seqlens` tensor alone derives the bounds from that tensor once (a host read of it, once per context).
    """

    cu_seqlens: torch.Tensor  # int32 [S+1], boundaries of the packed sequences in this rank's tokens
    max_seqlen: int
    backend: str = "auto"  # one of BACKEND_CHOICES
    sp: Any = None  # train.sequence_parallel.SPContext when sequence parallelism is on
    seq_ids: torch.Tensor | None = None  # structure mode: per-token ids for the Parallel-R1 mask
    block_ids: torch.Tensor | None = None
    path_ids: torch.Tensor | None = None
    bounds: VarlenBounds | None = None  # device + host offsets; derived from cu_seqlens when not given (no sp)

    # built by the first layer that needs them, reused by the others (one micro-batch)
    _block_mask: Any = field(default=None, init=False, repr=False, compare=False)
    _block_mask_key: Any = field(default=None, init=False, repr=False, compare=False)
    _resolved: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.bounds is None and self.sp is None:
            host = tuple(int(x) for x in self.cu_seqlens.tolist())
            cu = self.cu_seqlens.to(torch.int32)
            lengths = [hi - lo for lo, hi in zip(host[:-1], host[1:])]
            self.bounds = VarlenBounds(cu, cu, max(lengths), max(lengths), host, host)

    @classmethod
    def for_micro_batch(cls, cu_seqlens: torch.Tensor, device: torch.device | str, backend: str = "auto",
                        **kwargs) -> "AttentionContext":
        """From the host `cu_seqlens` of `train.batch.make_batch`: one host→device copy, host copies kept."""
        bounds = VarlenBounds.build(cu_seqlens.tolist(), device=device)
        return cls(bounds.cu_q, bounds.max_q, backend, bounds=bounds, **kwargs)

    @property
    def structured(self) -> bool:
        return self.block_ids is not None or self.path_ids is not None

    def structured_block_mask(self, device: torch.device, length: int):
        """The BlockMask of this micro-batch's structured mask over `length` tokens on `device`, built once."""
        key = ("structured", str(device), length)
        if self._block_mask_key != key:
            from train.structured_attention import structured_block_mask

            ids = (self.seq_ids, self.block_ids, self.path_ids, torch.arange(length, device=device))
            self._block_mask = structured_block_mask(*ids, *ids, length, length, device)
            self._block_mask_key = key
        return self._block_mask

    def document_block_mask(self, device: torch.device, compile_mask: bool = True):
        """The flex document mask of this micro-batch (padded to its shape bucket), built once."""
        padded = flex_bucket_length(self.bounds.host_cu_q[-1])
        key = ("document", str(device), padded)
        if self._block_mask_key != key:
            self._block_mask = document_block_mask(self.bounds.cu_q.to(device), padded, device, compile_mask)
            self._block_mask_key = key
        return self._block_mask


# ---------------------------------------------------------------------------------------------- FlexAttention
FLEX_BLOCK = 128  # FlexAttention's default block size; the padded length is a multiple of it


def flex_bucket_length(total: int) -> int:
    """The length FlexAttention runs at for `total` tokens: rounded up to a multiple of
    max(128, next_power_of_two(total) / 16), i.e. at most 16 shapes per octave and at most ~6% padding.

    Why buckets: the compiled kernel is specialised to its sequence length (compiled with dynamic=False, once per
    bucket). Packed rows are nearly full, so a run sees one or two buckets and compiles once per bucket, not per
    step; padding positions form their own causal "document" and are sliced off, and the block mask skips the
    empty blocks, so the padding costs almost nothing.
    """
    if total <= 0:
        raise ValueError(f"flex_bucket_length: need a positive number of tokens, got {total}")
    granule = max(FLEX_BLOCK, (1 << (total - 1).bit_length()) // 16)
    return -(-total // granule) * granule


def document_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Sequence index of each of `length` positions (positions past cu_seqlens[-1], the padding, get S), computed
    on the device of `cu_seqlens` without a host sync."""
    positions = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def document_block_mask(cu_seqlens: torch.Tensor, length: int, device: torch.device, compile_mask: bool = True):
    """FlexAttention BlockMask: query i sees key j iff both lie in the same packed sequence and j <= i."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids(cu_seqlens.to(device), length)

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(document_causal, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device,
                             _compile=compile_mask)


@functools.lru_cache(maxsize=1)
def compiled_flex_attention() -> Callable:
    """`flex_attention` compiled once per process (one compiled kernel per shape bucket, see flex_bucket_length)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(query, key, value, ctx: AttentionContext, scaling, flex_fn: Callable | None = None,
                            compile_mask: bool = True) -> torch.Tensor:
    """[1, H, T, D] -> [1, T, H, D] through FlexAttention with the document mask, padded to the shape bucket."""
    total = query.shape[2]
    padded = flex_bucket_length(total)
    if padded != total:
        pad = (0, 0, 0, padded - total)
        query, key, value = (torch.nn.functional.pad(t, pad) for t in (query, key, value))
    block_mask = ctx.document_block_mask(query.device, compile_mask)
    flex_fn = flex_fn or compiled_flex_attention()
    out = flex_fn(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out[:, :, :total].transpose(1, 2).contiguous()


def _flex_reasons(query: torch.Tensor, dropout: float) -> list[str]:
    reasons = []
    if not query.is_cuda:
        reasons.append("needs CUDA tensors (FlexAttention's backward does not run on CPU)")
    if dropout > 0:
        reasons.append("FlexAttention has no attention dropout (attention dropout must be 0)")
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as exc:
        reasons.append(f"this torch ({torch.__version__}) has no FlexAttention ({exc})")
    return reasons


# ---------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class AttentionBackend:
    name: str
    exact: bool  # the same maths as the per-sequence reference (auto only picks exact backends)
    reasons: Callable[[torch.Tensor, float], list[str]]  # (query, dropout) -> why it cannot run ([] = usable)
    fn: Callable[..., torch.Tensor]  # (query, key, value, ctx, scaling, dropout) -> [1, T, H, D]


def _varlen_backend(kernel: str) -> Callable[..., torch.Tensor]:
    """A `train.varlen_kernels` kernel on transformers' layout: [1, H, T, D] -> [T, H, D] -> kernel -> [1, T, H, D]."""

    def run(query, key, value, ctx: AttentionContext, scaling, dropout):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return varlen_attention(kernel, q, k, v, ctx.bounds, scaling, dropout).unsqueeze(0)

    return run


def _kernel_reasons(kernel: str) -> Callable[[torch.Tensor, float], list[str]]:
    return lambda query, dropout: varlen_kernels.KERNELS[kernel].reasons(query, dropout)  # patchable in tests


def _flex_backend(query, key, value, ctx: AttentionContext, scaling, dropout):
    # q/k/v already share one dtype (packsft_attention casts them under autocast): the compiled kernel runs as is
    with torch.autocast(query.device.type, enabled=False):
        return flex_document_attention(query, key, value, ctx, scaling)


BACKENDS: dict[str, AttentionBackend] = {
    "flash_varlen": AttentionBackend("flash_varlen", True, _kernel_reasons("flash_attn"), _varlen_backend("flash_attn")),
    "torch_varlen": AttentionBackend("torch_varlen", True, _kernel_reasons("torch_varlen"),
                                     _varlen_backend("torch_varlen")),
    "flex": AttentionBackend("flex", True, _flex_reasons, _flex_backend),
    "sdpa": AttentionBackend("sdpa", True, lambda query, dropout: [], _varlen_backend("sdpa_loop")),
}


def resolve_backend(requested: str, query: torch.Tensor, dropout: float = 0.0) -> AttentionBackend:
    """`auto`: the first exact backend of AUTO_ORDER with no reasons; a named backend: itself, or its reasons raised.

    Only the device, dtype and dropout matter, so a trainer resolves once at start with an empty `query` of the
    training device and dtype (and logs the result)."""
    if requested == "auto":
        for name in AUTO_ORDER:
            backend = BACKENDS[name]
            if backend.exact and not backend.reasons(query, dropout):
                return backend
        raise RuntimeError("no attention backend can run here: " + _all_reasons(query, dropout))
    if requested not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {list(BACKEND_CHOICES)}, got {requested!r}")
    reasons = BACKENDS[requested].reasons(query, dropout)
    if reasons:
        raise RuntimeError(
            f"attn_backend={requested} cannot run on {query.device.type} {query.dtype} (dropout {dropout}): "
            + "; ".join(reasons) + ". Use attn_backend=auto (or attn_backend=sdpa, which runs anywhere)"
        )
    return BACKENDS[requested]


def _all_reasons(query: torch.Tensor, dropout: float) -> str:
    return "; ".join(f"{name}: {', '.join(BACKENDS[name].reasons(query, dropout))}" for name in AUTO_ORDER)


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
        # the autocast dtype; the fused kernels need one half-precision dtype
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
    if ctx.bounds.host_cu_q[-1] != total:
        raise ValueError(f"cu_seqlens covers {ctx.bounds.host_cu_q[-1]} tokens, the micro-batch has {total}")
    resolve_key = (ctx.backend, device_type, query.dtype, dropout)
    backend = ctx._resolved.get(resolve_key)
    if backend is None:  # first layer of the micro-batch
        backend = ctx._resolved[resolve_key] = resolve_backend(ctx.backend, query, dropout)
    return backend.fn(query, key, value, ctx, scaling, dropout), None


# never traced: compiled decoder layers (compile_layers) break their graph here instead of guarding on the host
# bounds of every micro-batch
AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(packsft_attention))
