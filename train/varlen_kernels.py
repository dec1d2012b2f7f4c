"""Varlen causal attention kernels: one call covers every packed sequence of a micro-batch.

Layout: q [Tq, H, D], k/v [Tk, Hkv, D] (Hkv divides H: grouped-query attention). The boundaries of the packed
sequences come as a `VarlenBounds`, built once per micro-batch: device `cu_seqlens` for the kernels and host
copies (bounds, max lengths) so that no layer ever syncs the host with the device.

Causality is bottom-right aligned per sequence: query i of a sequence with Lq queries and Lk >= Lq keys sees keys
j <= i + (Lk - Lq). That is flash-attn's convention and what sequence parallelism needs: a rank's queries are the
tail of the keys it has gathered (`train/sequence_parallel.py`). With cu_q == cu_k it is plain causal attention.

Kernels (`KERNELS`), each with the reasons it cannot run for given inputs (empty list = usable):
- `flash_attn`: flash-attn's `flash_attn_varlen_func` (CUDA, fp16/bf16, flash-attn installed);
- `torch_varlen`: torch's built-in `torch.nn.attention.varlen.varlen_attn` (CUDA builds of torch >= 2.9). Its
  signature changed between releases (2.11: no `enable_gqa`; causal only as `window_size=(-1, 0)`), so it is
  probed once with `inspect.signature` and a mismatch becomes a reason, not a crash;
- `sdpa_loop`: causal SDPA on each sequence in turn; runs anywhere (the CPU path and the reference the others are
  tested against), at the cost of one kernel launch per sequence.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)


class VarlenBounds(NamedTuple):
    """Boundaries of the packed sequences of one micro-batch, on the device and on the host."""

    cu_q: torch.Tensor  # int32 [S+1], on the tensors' device
    cu_k: torch.Tensor  # int32 [S+1]
    max_q: int
    max_k: int
    host_cu_q: tuple[int, ...]
    host_cu_k: tuple[int, ...]

    @classmethod
    def build(cls, cu_q: list[int] | tuple[int, ...], cu_k=None, device: torch.device | str = "cpu") -> "VarlenBounds":
        """From host offsets (one host→device copy per tensor; call once per micro-batch, not per layer)."""
        host_q = tuple(int(x) for x in cu_q)
        host_k = host_q if cu_k is None else tuple(int(x) for x in cu_k)
        if len(host_q) != len(host_k) or len(host_q) < 2:
            raise ValueError(f"cu_seqlens_q/k need the same number (>= 2) of offsets, got {len(host_q)}, {len(host_k)}")
        lens_q = [hi - lo for lo, hi in zip(host_q[:-1], host_q[1:])]
        lens_k = [hi - lo for lo, hi in zip(host_k[:-1], host_k[1:])]
        if min(lens_q) < 0 or any(lk < lq for lq, lk in zip(lens_q, lens_k)):
            raise ValueError("every sequence needs at least as many keys as queries (bottom-right causal alignment)")
        cu_q_dev = queued_copy(torch.tensor(host_q, dtype=torch.int32), device)
        cu_k_dev = cu_q_dev if cu_k is None else queued_copy(torch.tensor(host_k, dtype=torch.int32), device)
        return cls(cu_q_dev, cu_k_dev, max(lens_q), max(lens_k), host_q, host_k)


def queued_copy(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device` without stalling the host: a blocking host→GPU copy synchronizes the stream (waits for
    the previous micro-batch's backward); from pinned memory it is queued and the host builds the next batch."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class VarlenKernel:
    name: str
    reasons: Callable[[torch.Tensor, float], list[str]]  # (query, dropout) -> why it cannot run ([] = usable)
    fn: Callable[..., torch.Tensor]  # (q, k, v, bounds, scale, dropout) -> out [Tq, H, D]


def _repeat_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return k, v


# --- flash-attn ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _flash_attn_import_error() -> str | None:
    try:
        import flash_attn  # noqa: F401
    except ImportError as exc:
        return f"flash-attn is not installed ({exc})"
    return None


def _flash_attn_reasons(q: torch.Tensor, dropout: float) -> list[str]:
    reasons = []
    if not q.is_cuda:
        reasons.append("needs CUDA tensors")
    if q.dtype not in HALF_DTYPES:
        reasons.append(f"needs fp16/bf16, got {q.dtype}")
    if q.is_cuda and (error := _flash_attn_import_error()):
        reasons.append(error)
    return reasons


def _flash_attn(q, k, v, bounds: VarlenBounds, scale, dropout):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, bounds.cu_q, bounds.cu_k, bounds.max_q, bounds.max_k,
        dropout_p=dropout, softmax_scale=scale, causal=True,
    )


# --- torch.nn.attention.varlen.varlen_attn ------------------------------------------------------------------------


class _TorchVarlenAPI(NamedTuple):
    fn: Callable | None
    causal_kwargs: dict
    native_gqa: bool
    problem: str | None


@functools.lru_cache(maxsize=1)
def torch_varlen_api() -> _TorchVarlenAPI:
    """Probe `varlen_attn` once: how this torch expresses causality and whether it takes `enable_gqa`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return _TorchVarlenAPI(None, {}, False, f"this torch ({torch.__version__}) has no varlen_attn ({exc})")
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return _TorchVarlenAPI(None, {}, False, f"varlen_attn{inspect.signature(varlen_attn)} has no causal option")
    missing = [p for p in ("scale",) if p not in params]
    if missing:
        return _TorchVarlenAPI(None, {}, False, f"varlen_attn of torch {torch.__version__} lacks {missing}")
    return _TorchVarlenAPI(varlen_attn, causal, "enable_gqa" in params, None)


def _torch_varlen_reasons(q: torch.Tensor, dropout: float) -> list[str]:
    reasons = []
    if not q.is_cuda:
        reasons.append("needs CUDA tensors (varlen_attn is CUDA-only)")
    if q.dtype not in HALF_DTYPES:
        reasons.append(f"needs fp16/bf16, got {q.dtype}")
    if dropout > 0:
        reasons.append("varlen_attn has no dropout (attention dropout must be 0)")
    if (problem := torch_varlen_api().problem) is not None:
        reasons.append(problem)
    return reasons


def _torch_varlen(q, k, v, bounds: VarlenBounds, scale, dropout):
    api = torch_varlen_api()
    kwargs = dict(api.causal_kwargs, scale=scale)
    if api.native_gqa:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    else:
        k, v = _repeat_kv_heads(q, k, v)
    return api.fn(q, k, v, bounds.cu_q, bounds.cu_k, bounds.max_q, bounds.max_k, **kwargs)


# --- SDPA, one sequence at a time ---------------------------------------------------------------------------------


def _sdpa_loop(q, k, v, bounds: VarlenBounds, scale, dropout):
    """Reference: causal SDPA per sequence ([H, L, D] each), bottom-right aligned when a sequence has extra keys."""
    k, v = _repeat_kv_heads(q, k, v)
    outs = []
    for qlo, qhi, klo, khi in zip(bounds.host_cu_q[:-1], bounds.host_cu_q[1:], bounds.host_cu_k[:-1], bounds.host_cu_k[1:]):
        if qhi == qlo:
            continue
        qs, ks, vs = (t.transpose(0, 1) for t in (q[qlo:qhi], k[klo:khi], v[klo:khi]))
        offset = (khi - klo) - (qhi - qlo)
        if offset == 0:
            out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, scale=scale, is_causal=True)
        else:
            rows = torch.arange(qhi - qlo, device=q.device)[:, None]
            cols = torch.arange(khi - klo, device=q.device)[None, :]
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=cols <= rows + offset, dropout_p=dropout, scale=scale)
        outs.append(out.transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


KERNELS: dict[str, VarlenKernel] = {
    "flash_attn": VarlenKernel("flash_attn", _flash_attn_reasons, _flash_attn),
    "torch_varlen": VarlenKernel("torch_varlen", _torch_varlen_reasons, _torch_varlen),
    "sdpa_loop": VarlenKernel("sdpa_loop", lambda q, dropout: [], _sdpa_loop),
}


def varlen_attention(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: VarlenBounds, scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Run kernel `name` on q [Tq, H, D], k/v [Tk, Hkv, D] -> [Tq, H, D]; raises with its reasons if it cannot run."""
    kernel = KERNELS[name]
    reasons = kernel.reasons(q, dropout)
    if reasons:
        raise RuntimeError(f"attention kernel {name!r} cannot run here: " + "; ".join(reasons))
    return kernel.fn(q, k, v, bounds, scale, dropout)
