"""Varlen causal attention kernels: one call covers every packed sequence of a micro-batch.

Layout: q [Tq, H, D], k/v [Tk, Hkv, D] (Hkv divides H: grouped-query attention). The boundaries of the packed
sequences come as a `Row` (train/row.py), built once per micro-batch: device `cu_seqlens` for the kernels and host
copies (bounds, max lengths) so that no layer ever syncs the host with the device.

Causality is bottom-right aligned per sequence: query i of a sequence with Lq queries and Lk >= Lq keys sees keys
j <= i + (Lk - Lq). That is flash-attn's convention and what sequence parallelism needs: a rank's queries are the
tail of the keys it has gathered (`train/attention/sequence_parallel.py`). With cu_q == cu_k it is plain causal attention.

Per-layer attention features (`AttentionFeatures`: dropout, sliding window, logit softcapping, attention sinks)
travel with every call; a kernel that cannot express one says so in its reasons. The sliding window counts keys as
transformers' masks do (a query sees itself and the `sliding_window - 1` keys before it) and, like causality, is
bottom-right aligned: query i of a sequence with offset o = Lk - Lq sees keys j with i + o - W < j <= i + o.

Kernels (`KERNELS`, fastest first: the gather backend of train/attention/sequence_parallel.py runs the first that can), each
with the reasons it cannot run for given inputs (empty list = usable):
- `flash_attn`: flash-attn's `flash_attn_varlen_func` (CUDA, fp16/bf16, flash-attn installed); window and
  softcap, no sinks (they need a gradient through the log-sum-exp, which its varlen API does not return);
- `torch_varlen`: torch's built-in `torch.nn.attention.varlen.varlen_attn` (CUDA builds of torch >= 2.9). Its
  signature changed between releases (2.11: no `enable_gqa`; causal only as `window_size=(-1, 0)`), so it is
  probed once with `inspect.signature` and a mismatch becomes a reason, not a crash; window, no softcap or sinks;
- `sdpa_loop`: causal SDPA on each sequence in turn (a boolean mask for a window; softcap and sinks by the eager
  fp32-softmax computation of transformers' eager attention); runs anywhere (the CPU path and the reference the
  others are tested against), at the cost of one kernel launch per sequence.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from train.row import Row

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionFeatures:
    """What one attention call (one layer) asks for beyond causal attention. Hashable: the attention plan chooses a
    kernel per kind of layer (gemma2 alternates windowed and full layers)."""

    dropout: float = 0.0
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 keys before it
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), after scaling, before masking
    has_sinks: bool = False  # a learnt logit per head in every softmax's denominator (gpt-oss); its value travels
    # beside the features (`sinks`, a [H] tensor that gets a gradient)

    def __post_init__(self):
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"attention dropout must be in [0, 1), got {self.dropout}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be a positive number or None, got {self.softcap!r}")

    @property
    def needs_eager_softmax(self) -> bool:
        """Softcap and sinks change the softmax itself: no mask expresses them."""
        return self.softcap is not None or self.has_sinks

    def names(self) -> list[str]:
        """The features in use beyond plain causal attention, as reasons name them (dropout excluded)."""
        names = []
        if self.sliding_window is not None:
            names.append(f"sliding_window={self.sliding_window}")
        if self.softcap is not None:
            names.append(f"softcap={self.softcap}")
        if self.has_sinks:
            names.append("attention sinks")
        return names

    @property
    def layer_kind(self) -> "AttentionFeatures":
        """What decides a layer's kernel: these features without dropout (the same layer in training and in eval)."""
        return replace(self, dropout=0.0)


NO_FEATURES = AttentionFeatures()


@dataclass(frozen=True)
class VarlenKernel:
    name: str
    reasons: Callable[[torch.Tensor, AttentionFeatures], list[str]]  # (query, features) -> why it cannot run
    fn: Callable[..., torch.Tensor]  # (q, k, v, bounds, scale, features, sinks) -> out [Tq, H, D]


def _repeat_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return k, v


# --- flash-attn ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen_params() -> frozenset[str] | str:
    """The keyword parameters of this flash-attn's `flash_attn_varlen_func`, or why it cannot be imported."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        return f"flash-attn is not installed ({exc})"
    return frozenset(inspect.signature(flash_attn_varlen_func).parameters)


def _flash_attn_reasons(q: torch.Tensor, features: AttentionFeatures) -> list[str]:
    reasons = []
    if not q.is_cuda:
        reasons.append("needs CUDA tensors")
    if q.dtype not in HALF_DTYPES:
        reasons.append(f"needs fp16/bf16, got {q.dtype}")
    if features.has_sinks:
        reasons.append("cannot express attention sinks (flash-attn's varlen API returns no log-sum-exp to "
                       "differentiate, so the sinks would get no gradient)")
    if q.is_cuda:
        params = _flash_attn_varlen_params()
        if isinstance(params, str):
            reasons.append(params)
        else:
            for feature, param in (("sliding_window", "window_size"), ("softcap", "softcap")):
                if getattr(features, feature) is not None and param not in params:
                    reasons.append(f"this flash-attn's flash_attn_varlen_func has no {param} ({feature})")
    return reasons


def _flash_attn(q, k, v, bounds: Row, scale, features: AttentionFeatures, sinks=None):
    from flash_attn import flash_attn_varlen_func

    extra = {}
    if features.sliding_window is not None:
        extra["window_size"] = (features.sliding_window - 1, 0)  # bottom-right aligned, like its causal mask
    if features.softcap is not None:
        extra["softcap"] = features.softcap
    return flash_attn_varlen_func(
        q, k, v, bounds.cu_q, bounds.cu_k, bounds.max_q, bounds.max_k,
        dropout_p=features.dropout, softmax_scale=scale, causal=True, **extra,
    )


# --- torch.nn.attention.varlen.varlen_attn ------------------------------------------------------------------------


class _TorchVarlenAPI(NamedTuple):
    fn: Callable | None
    causal_kwargs: dict
    native_gqa: bool
    problem: str | None

    @property
    def has_window(self) -> bool:
        return "window_size" in self.causal_kwargs


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


def _torch_varlen_reasons(q: torch.Tensor, features: AttentionFeatures) -> list[str]:
    reasons = []
    if not q.is_cuda:
        reasons.append("needs CUDA tensors (varlen_attn is CUDA-only)")
    if q.dtype not in HALF_DTYPES:
        reasons.append(f"needs fp16/bf16, got {q.dtype}")
    if features.dropout > 0:
        reasons.append("varlen_attn has no dropout (attention dropout must be 0)")
    if features.softcap is not None:
        reasons.append("varlen_attn has no logit softcapping (softcap)")
    if features.has_sinks:
        reasons.append("varlen_attn has no attention sinks")
    api = torch_varlen_api()
    if api.problem is not None:
        reasons.append(api.problem)
    elif features.sliding_window is not None and not api.has_window:
        reasons.append(f"varlen_attn of torch {torch.__version__} has no window_size (sliding_window)")
    return reasons


def _torch_varlen(q, k, v, bounds: Row, scale, features: AttentionFeatures, sinks=None):
    api = torch_varlen_api()
    kwargs = dict(api.causal_kwargs, scale=scale)
    if features.sliding_window is not None:
        kwargs["window_size"] = (features.sliding_window - 1, 0)  # (left, right) keys around the aligned diagonal
    if api.native_gqa:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    else:
        k, v = _repeat_kv_heads(q, k, v)
    return api.fn(q, k, v, bounds.cu_q, bounds.cu_k, bounds.max_q, bounds.max_k, **kwargs)


# --- SDPA, one sequence at a time ---------------------------------------------------------------------------------


def visible_keys(n_queries: int, n_keys: int, sliding_window: int | None, device) -> torch.Tensor:
    """[Lq, Lk] bool of one sequence: query i sees key j iff i + o - W < j <= i + o, o = Lk - Lq (bottom-right)."""
    diagonal = torch.arange(n_queries, device=device)[:, None] + (n_keys - n_queries)
    keys = torch.arange(n_keys, device=device)[None, :]
    visible = keys <= diagonal
    if sliding_window is not None:
        visible &= keys > diagonal - sliding_window
    return visible


def eager_attention(q, k, v, visible: torch.Tensor, scale: float | None, features: AttentionFeatures,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """q [..., H, Lq, D], k/v [..., H, Lk, D] (kv heads repeated), visible [Lq, Lk] -> [..., H, Lq, D], the way
    transformers' eager attention computes softcap and sinks: fp32 scores and softmax (autocast off, so they stay
    fp32); the sink is one more logit per head in the softmax, whose probability is dropped."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if features.softcap is not None:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink_logits = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink_logits], dim=-1).softmax(dim=-1)[..., :-1]
    if features.dropout > 0:
        probs = F.dropout(probs, features.dropout)
    return torch.matmul(probs.to(v.dtype), v)


def masked_attention(q, k, v, visible: torch.Tensor, scale: float | None, features: AttentionFeatures,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., H, Lq, D], k/v [..., H, Lk, D], visible [Lq, Lk] bool: SDPA with the mask, or the eager computation
    when softcap or sinks change the softmax."""
    if features.needs_eager_softmax:
        return eager_attention(q, k, v, visible, scale, features, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=features.dropout, scale=scale)


def _sdpa_loop(q, k, v, bounds: Row, scale, features: AttentionFeatures = NO_FEATURES, sinks=None):
    """Reference: SDPA per sequence ([H, L, D] each), bottom-right aligned when a sequence has extra keys."""
    k, v = _repeat_kv_heads(q, k, v)
    outs = []
    for qlo, qhi, klo, khi in zip(bounds.host_cu_q[:-1], bounds.host_cu_q[1:], bounds.host_cu_k[:-1], bounds.host_cu_k[1:]):
        if qhi == qlo:
            continue
        qs, ks, vs = (t.transpose(0, 1) for t in (q[qlo:qhi], k[klo:khi], v[klo:khi]))
        window = features.sliding_window
        if window is not None and window >= khi - klo:
            window = None  # the window holds the whole sequence: plain causal
        if qhi - qlo == khi - klo and window is None and not features.needs_eager_softmax:
            out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=features.dropout, scale=scale, is_causal=True)
        else:
            out = masked_attention(qs, ks, vs, visible_keys(qhi - qlo, khi - klo, window, q.device), scale, features,
                                   sinks)
        outs.append(out.transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


KERNELS: dict[str, VarlenKernel] = {
    "flash_attn": VarlenKernel("flash_attn", _flash_attn_reasons, _flash_attn),
    "torch_varlen": VarlenKernel("torch_varlen", _torch_varlen_reasons, _torch_varlen),
    "sdpa_loop": VarlenKernel("sdpa_loop", lambda q, features: [], _sdpa_loop),
}
