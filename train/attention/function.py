"""The packed-sequence attention function, registered with transformers as `attn_implementation="packsft"`.

The model is called with `use_cache=False` and `packsft=AttentionContext(...)`; transformers forwards unknown keyword
arguments of `model(...)` down to the attention function, which is how the varlen boundaries reach it without
touching transformers' internals. Packed samples never attend to each other.

Per-layer attention features: transformers passes them as keyword arguments (`sliding_window`, `softcap`, `s_aux`
= attention sinks, `scaling`, `dropout`); they become an `AttentionFeatures` per call, and any other keyword argument
not known to be harmless is an error naming it (a swallowed feature would train a different model silently).

What a layer runs is not decided here: the context carries the `LayerKernels` that train/plan/attention.py chose
once at start (per kind of layer: its features without dropout), and the function calls the one of its layer's
kind. This module holds what those kernels are built from: the packed backends (`BACKENDS`, keyed by
train/config/backend_names.py's names, each with the reasons it cannot run for given inputs and features; empty list =
usable) and the two Parallel-R1 mask kernels. Every kernel takes transformers' [1, H, T, D] query and
[1, Hkv, T, D] key/value and returns [1, T, H, D]:
- `flash_varlen`: flash-attn's varlen kernel (CUDA + flash-attn installed, fp16/bf16); window, softcap;
- `torch_varlen`: torch's built-in `torch.nn.attention.varlen.varlen_attn` (CUDA builds of torch >= 2.9, fp16/bf16);
  window;
- `flex`: FlexAttention with a document mask (CUDA; its backward does not run on CPU); window (mask), softcap
  (score_mod), sinks (its differentiable log-sum-exp);
- `sdpa`: causal SDPA on each packed sequence in turn: one kernel launch per sequence, the CPU path and last resort;
  every feature (softcap and sinks by the eager fp32 softmax of transformers' eager attention).
The order of `BACKENDS` is `auto`'s, fixed, not timed at start-up: see benchmarks/bench_train_gpu.py.

No host sync inside a layer: the context carries a `Row` (train/row.py) (device cu_seqlens plus host copies and max
lengths) built once per micro-batch, and everything derived from it (the flex BlockMask) is built by the first layer
and reused by the others (one flex BlockMask per sliding window).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AttentionInterface

from train.attention import varlen_kernels
from train.config.backend_names import ATTENTION_BACKENDS, FLASH_VARLEN, FLEX, SDPA, TORCH_VARLEN
from train.families import FAMILIES
from train.attention.structured import flex_structured_attention, structured_sdpa_by_sequence
from train.attention.varlen_kernels import KERNELS, NO_FEATURES, AttentionFeatures
from train.row import Row

ATTN_IMPLEMENTATION = "packsft"


# ---------------------------------------------------------------------------------------------- what a layer runs
@dataclass(frozen=True)
class Kernel:
    """One attention path: `fn(query, key, value, ctx, scaling, features, sinks) -> [1, T, H, D]`, `name` for the
    start line."""

    name: str
    fn: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class LayerKernels:
    """What each kind of layer runs, chosen once at start (train/plan/attention.py): `by_kind` maps a layer kind (its
    AttentionFeatures without dropout: the same layer in training and in eval) to its Kernel; `every`, when set, is
    what every layer runs (a backend named in the config, or one kernel for a test)."""

    by_kind: tuple[tuple[AttentionFeatures, Kernel], ...] = ()
    every: Kernel | None = None

    def for_layer(self, features: AttentionFeatures) -> Kernel:
        if self.every is not None:
            return self.every
        kind = features.layer_kind
        for planned, kernel in self.by_kind:
            if planned == kind:
                return kernel
        raise RuntimeError(
            f"no attention kernel was planned for a layer with {kind}: the attention plan, made at start from the "
            f"model's attention modules, knows {[planned for planned, _ in self.by_kind]}"
        )


@dataclass
class AttentionContext:
    """Per-forward description of the packed micro-batch (shared by every layer).

    Build it with `AttentionContext.for_micro_batch` (one host→device copy of the offsets); constructing it from a
    `cu_seqlens` tensor alone derives the bounds from that tensor once (a host read of it, once per context).
    train/plan/attention.py's `AttentionPlan.context` builds the trainer's, sharded under sequence parallelism.
    """

    cu_seqlens: torch.Tensor  # int32 [S+1], boundaries of the packed sequences in this rank's tokens
    max_seqlen: int
    kernels: LayerKernels = field(default_factory=LayerKernels)  # what each kind of layer runs (the plan's)
    sp: Any = None  # train.attention.sequence_parallel.SPContext when sequence parallelism is on
    seq_ids: torch.Tensor | None = None  # structure mode: per-token ids for the Parallel-R1 mask
    block_ids: torch.Tensor | None = None
    path_ids: torch.Tensor | None = None
    tree_spans: torch.Tensor | None = None  # stepwise trees: per-token subtree sizes (data/shards/prefix_tree.py)
    bounds: Row | None = None  # the micro-batch's Row (train/row.py); derived from cu_seqlens when not given (no sp)

    # built by the first layer that needs them, reused by the others (one micro-batch)
    _block_masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.bounds is None and self.sp is None:
            self.bounds = Row.of_device_offsets(self.cu_seqlens)

    @classmethod
    def for_micro_batch(cls, cu_seqlens: torch.Tensor, device: torch.device | str, kernels: LayerKernels,
                        **kwargs) -> "AttentionContext":
        """From the host `cu_seqlens` of `train.steps.batch.make_batch`: one host→device copy, host copies kept."""
        bounds = Row.build(cu_seqlens.tolist(), device=device)
        return cls(bounds.cu_q, bounds.max_q, kernels, bounds=bounds, **kwargs)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
               features: AttentionFeatures = NO_FEATURES, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """[1, H, T, D] query, [1, Hkv, T, D] key/value -> [1, T, H, D]: the kernel planned for this kind of layer."""
        return self.kernels.for_layer(features).fn(query, key, value, self, scaling, features, sinks)

    def structured_block_mask(self, device: torch.device, length: int):
        """The BlockMask of this micro-batch's structured mask over `length` tokens on `device`, built once."""
        key = ("structured", str(device), length)
        if key not in self._block_masks:
            from train.attention.structured import structured_block_mask

            ids = (self.seq_ids, self.block_ids, self.path_ids, torch.arange(length, device=device))
            self._block_masks[key] = structured_block_mask(*ids, *ids, length, length, device, self.tree_spans)
        return self._block_masks[key]

    def document_block_mask(self, device: torch.device, compile_mask: bool = True, sliding_window: int | None = None):
        """The flex document mask of this micro-batch (padded to its shape bucket), built once per sliding window
        (windowed and full layers need different masks)."""
        padded = flex_bucket_length(self.bounds.host_cu_q[-1])
        key = ("document", str(device), padded, sliding_window)
        if key not in self._block_masks:
            self._block_masks[key] = document_block_mask(self.bounds.cu_q.to(device), padded, device, compile_mask,
                                                         sliding_window)
        return self._block_masks[key]


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


def document_block_mask(cu_seqlens: torch.Tensor, length: int, device: torch.device, compile_mask: bool = True,
                        sliding_window: int | None = None):
    """FlexAttention BlockMask: query i sees key j iff both lie in the same packed sequence and j <= i (and, with a
    sliding window W, j > i - W)."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids(cu_seqlens.to(device), length)

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)

    def document_sliding_window(b, h, q_idx, kv_idx):
        return document_causal(b, h, q_idx, kv_idx) & (kv_idx > q_idx - sliding_window)

    mask_mod = document_causal if sliding_window is None else document_sliding_window
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device,
                             _compile=compile_mask)


@functools.lru_cache(maxsize=None)
def softcap_score_mod(softcap: float) -> Callable:
    """FlexAttention score_mod of logit softcapping; one function object per value, so compiled kernels are reused."""

    def softcapped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return softcapped


@functools.lru_cache(maxsize=1)
def compiled_flex_attention() -> Callable:
    """`flex_attention` compiled once per process (one compiled kernel per shape bucket, see flex_bucket_length)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(query, key, value, ctx: AttentionContext, scaling, flex_fn: Callable | None = None,
                            compile_mask: bool = True, features: AttentionFeatures = NO_FEATURES,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[1, H, T, D] -> [1, T, H, D] through FlexAttention with the document mask, padded to the shape bucket.

    Sinks: with Z the softmax denominator over the keys (lse = log Z), adding a sink logit s per head scales the
    output by Z / (Z + e^s) = sigmoid(lse - s); FlexAttention's lse is differentiable, so q, k and the sinks get
    their exact gradients."""
    total = query.shape[2]
    padded = flex_bucket_length(total)
    if padded != total:
        pad = (0, 0, 0, padded - total)
        query, key, value = (torch.nn.functional.pad(t, pad) for t in (query, key, value))
    block_mask = ctx.document_block_mask(query.device, compile_mask, features.sliding_window)
    flex_fn = flex_fn or compiled_flex_attention()
    kwargs = dict(block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    if features.softcap is not None:
        kwargs["score_mod"] = softcap_score_mod(features.softcap)
    if sinks is None:
        out = flex_fn(query, key, value, **kwargs)
    else:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex_fn(query, key, value, return_aux=AuxRequest(lse=True), **kwargs)
        kept = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1)).unsqueeze(-1)
        out = (out.float() * kept).to(out.dtype)
    return out[:, :, :total].transpose(1, 2).contiguous()


def _flex_reasons(query: torch.Tensor, features: AttentionFeatures) -> list[str]:
    reasons = []
    if not query.is_cuda:
        reasons.append("needs CUDA tensors (FlexAttention's backward does not run on CPU)")
    if features.dropout > 0:
        reasons.append("FlexAttention has no attention dropout (attention dropout must be 0)")
    try:
        import torch.nn.attention.flex_attention as flex
    except ImportError as exc:
        reasons.append(f"this torch ({torch.__version__}) has no FlexAttention ({exc})")
    else:
        if features.has_sinks and not hasattr(flex, "AuxRequest"):
            reasons.append(f"attention sinks need FlexAttention's return_aux log-sum-exp (torch {torch.__version__} "
                           "has none)")
    return reasons


# ---------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class AttentionBackend(Kernel):
    """A packed backend: a Kernel over the micro-batch's sequences, and why it cannot run for given inputs."""

    exact: bool  # the same maths as the per-sequence reference (auto only picks exact backends)
    reasons: Callable[[torch.Tensor, AttentionFeatures], list[str]]  # (query, features) -> why it cannot run


def _covers_row(ctx: AttentionContext, query: torch.Tensor) -> None:
    if ctx.bounds.host_cu_q[-1] != query.shape[2]:
        raise ValueError(f"cu_seqlens covers {ctx.bounds.host_cu_q[-1]} tokens, the micro-batch has {query.shape[2]}")


def _varlen_backend(kernel: str) -> Callable[..., torch.Tensor]:
    """A `train.attention.varlen_kernels` kernel on transformers' layout: [1, H, T, D] -> [T, H, D] -> kernel -> [1, T, H, D]."""

    def run(query, key, value, ctx: AttentionContext, scaling, features, sinks):
        _covers_row(ctx, query)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return KERNELS[kernel].fn(q, k, v, ctx.bounds, scaling, features, sinks).unsqueeze(0)

    return run


def _kernel_reasons(kernel: str) -> Callable[[torch.Tensor, AttentionFeatures], list[str]]:
    return lambda query, features: varlen_kernels.KERNELS[kernel].reasons(query, features)  # patchable in tests


def _flex_backend(query, key, value, ctx: AttentionContext, scaling, features, sinks):
    _covers_row(ctx, query)
    # q/k/v already share one dtype (packsft_attention casts them under autocast): the compiled kernel runs as is
    with torch.autocast(query.device.type, enabled=False):
        return flex_document_attention(query, key, value, ctx, scaling, features=features, sinks=sinks)


BACKENDS: dict[str, AttentionBackend] = {
    FLASH_VARLEN: AttentionBackend(FLASH_VARLEN, _varlen_backend("flash_attn"), True, _kernel_reasons("flash_attn")),
    TORCH_VARLEN: AttentionBackend(TORCH_VARLEN, _varlen_backend("torch_varlen"), True,
                                   _kernel_reasons("torch_varlen")),
    FLEX: AttentionBackend(FLEX, _flex_backend, True, _flex_reasons),
    SDPA: AttentionBackend(SDPA, _varlen_backend("sdpa_loop"), True, lambda query, features: []),
}
if tuple(BACKENDS) != ATTENTION_BACKENDS:
    raise ImportError(f"BACKENDS {tuple(BACKENDS)} must be train/config/backend_names.py's {ATTENTION_BACKENDS}, in order")


# ---------------------------------------------------------------------------------------------- Parallel-R1 mask
def backend_problem(name: str, query: torch.Tensor, features: AttentionFeatures) -> str | None:
    """Why the packed backend `name` of BACKENDS cannot run a kind of layer with `features` on `query`'s device and
    dtype (an empty tensor of them will do), as one sentence naming it and the alternatives; None when it can."""
    reasons = BACKENDS[name].reasons(query, features)
    if not reasons:
        return None
    asked = ", ".join([f"dropout {features.dropout}", *features.names()])
    return (f"attn_backend={name} cannot run on {query.device.type} {query.dtype} ({asked}): " + "; ".join(reasons)
            + ". Use attn_backend=auto (or attn_backend=sdpa, which runs anywhere)")


def _structured_ids(query: torch.Tensor, ctx: AttentionContext) -> tuple:
    return ctx.seq_ids, ctx.block_ids, ctx.path_ids, torch.arange(query.shape[2], device=query.device)


def _structured_flex(query, key, value, ctx: AttentionContext, scaling, features, sinks):
    ids = _structured_ids(query, ctx)
    block_mask = ctx.structured_block_mask(query.device, query.shape[2])
    return flex_structured_attention(query, key, value, *ids, *ids, scaling, block_mask=block_mask,
                                     k_span=ctx.tree_spans)


def _structured_sdpa(query, key, value, ctx: AttentionContext, scaling, features, sinks):
    ids = _structured_ids(query, ctx)
    return structured_sdpa_by_sequence(query, key, value, *ids, *ids, scaling, k_span=ctx.tree_spans)


# the structure ids of the micro-batch (train/attention/structured.py): FlexAttention on CUDA, else SDPA per sequence
STRUCTURED_FLEX = Kernel("Parallel-R1 mask (FlexAttention)", _structured_flex)
STRUCTURED_SDPA = Kernel("Parallel-R1 mask (SDPA per sequence)", _structured_sdpa)


# Keyword arguments transformers (5.x: its TransformersKwargs) passes to an attention function that PackSFT may
# ignore, each with the values for which ignoring it is right. Anything else is an error: a feature swallowed here
# would train another model.
IGNORABLE_KWARGS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "position_ids": (lambda value: True, "any (positions are already applied by the rotary embedding)"),
    "use_cache": (lambda value: not value, "False or None (packed training keeps no cache)"),
    "output_router_logits": (lambda value: True, "any (MoE router logits are collected from the routers)"),
    "output_hidden_states": (lambda value: True, "any (hidden states are collected from the decoder layers)"),
    "num_items_in_batch": (lambda value: True, "any (it normalises transformers' loss, not attention)"),
    "is_causal": (lambda value: value is None or value is True,
                  "True or None: bidirectional attention cannot be packed causally"),
    "output_attentions": (lambda value: not value, "False or None (no attention weights are materialised)"),
    "head_mask": (lambda value: value is None, "None"),
    **{name: (lambda value: value is None, "None (packed boundaries come from the AttentionContext)")
       for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")},
}


def check_attention_kwargs(module: torch.nn.Module, kwargs: dict) -> None:
    """Raise, naming them, on keyword arguments PackSFT does not honour (see IGNORABLE_KWARGS)."""
    unknown = [name for name in kwargs if name not in IGNORABLE_KWARGS]
    if unknown:
        raise TypeError(
            f"attn_implementation='packsft' got keyword argument(s) {unknown} from {type(module).__name__} that "
            "PackSFT does not implement; ignoring them would silently train a different model "
            f"(honoured: scaling, dropout, sliding_window, softcap, s_aux; ignorable: {sorted(IGNORABLE_KWARGS)})"
        )
    for name, value in kwargs.items():
        allowed, values = IGNORABLE_KWARGS[name]
        if not allowed(value):
            raise ValueError(f"attn_implementation='packsft' got {name}={value!r} from {type(module).__name__}; "
                             f"it supports only {values}")


def attention_features(query: torch.Tensor, dropout: float, sliding_window, softcap, s_aux) -> AttentionFeatures:
    """The features of one attention call, from transformers' keyword arguments."""
    if s_aux is not None and (s_aux.dim() != 1 or s_aux.shape[0] != query.shape[1]):
        raise ValueError(f"s_aux (attention sinks) must be one logit per query head [{query.shape[1]}], "
                         f"got {tuple(s_aux.shape)}")
    return AttentionFeatures(float(dropout), sliding_window, None if softcap is None else float(softcap),
                             s_aux is not None)


def layer_features(lm: torch.nn.Module) -> list[AttentionFeatures]:
    """The attention features of every attention module of `lm`, in module order, read before any forward (the
    attention plan's layer kinds): sliding windows, logit softcapping, attention sinks, attention dropout.

    Attention modules are those `is_attention_module` finds; a module's own `sliding_window` attribute wins (gemma2,
    qwen2, gpt-oss set it per layer, None on full layers), else its config's (mistral, phi3, starcoder2 read
    `config.sliding_window` in forward)."""
    found = []
    for module in lm.modules():
        if not is_attention_module(module):
            continue
        if not passes_window(type(module)):  # the window its forward leaves to the mask, as packsft_attention reads it
            window = mask_only_window(module)
        elif hasattr(module, "sliding_window"):
            window = module.sliding_window if getattr(module, "is_sliding", True) else None
        else:
            window = getattr(getattr(module, "config", None), "sliding_window", None)
        softcap = getattr(module, "attn_logit_softcapping", getattr(module, "softcap", None))
        if softcap is not None and not passes_softcap(type(module)):
            softcap = None  # held but never passed (Gemma 3 / 3n / 4 keep Gemma 2's attribute; their forward drops it)
        sinks = isinstance(getattr(module, "sinks", None), torch.nn.Parameter)
        dropout = getattr(module, "attention_dropout", 0.0) or 0.0
        dropout = float(dropout.p if isinstance(dropout, torch.nn.Dropout) else dropout)  # Persimmon holds the module
        found.append(AttentionFeatures(dropout, window, softcap, sinks))
    return found


HEAD_DIM_ATTRIBUTES = ("head_dim", "qk_head_dim", "head_size")  # per-head size: most / latent attention / GPT-NeoX


def is_attention_module(module: torch.nn.Module) -> bool:
    """A transformers attention module: its `scaling` and a per-head size (`head_dim`; multi-head latent attention
    (DeepSeek-V2/V3, GLM-4.7-Flash, MiniCPM3, Kimi Linear...) holds `qk_head_dim` and `v_head_dim` instead, GPT-NeoX
    `head_size`), or its `scaling` and a forward that calls transformers' attention functions. A module missed here
    would find no kernel in the attention plan at its first forward."""
    if not hasattr(module, "scaling"):
        return False
    return any(hasattr(module, name) for name in HEAD_DIM_ATTRIBUTES) or calls_attention_functions(type(module))


@functools.lru_cache(maxsize=None)
def calls_attention_functions(module_class: type) -> bool:
    """Whether the module class's forward dispatches through transformers' ALL_ATTENTION_FUNCTIONS."""
    import inspect

    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def passes_window(attention_class: type) -> bool:
    """Whether the attention module's forward hands a `sliding_window` to the attention function; one that does not
    (Qwen2-MoE, PhiMoE) has its window applied by transformers' mask function alone (`mask_only_window`)."""
    import inspect

    try:
        source = inspect.getsource(attention_class.forward)
    except (OSError, TypeError):  # no source to read: trust the attributes
        return True
    return "sliding_window=" in source


@functools.lru_cache(maxsize=None)
def passes_softcap(attention_class: type) -> bool:
    """Whether the attention module's forward hands a `softcap` to the attention function (what it holds alone does
    nothing: Gemma 3 stores `attn_logit_softcapping` from its config and never passes it)."""
    import inspect

    try:
        source = inspect.getsource(attention_class.forward)
    except (OSError, TypeError):  # no source to read: trust the attribute
        return True
    return "softcap=" in source


WINDOW_FROM_MASK = object()  # the layer passed no `sliding_window` at all (None would mean "no window")


def mask_only_window(module: torch.nn.Module) -> int | None:
    """The window of a layer that passes no `sliding_window` to the attention function. Such families apply it
    through transformers' mask function alone: Qwen2-MoE on the layers it marks sliding (their attention module
    holds `sliding_window`), a family with `mask_only_window` (train/families.py: PhiMoE) on every layer whenever
    `config.sliding_window` is set. 0 means none."""
    config = getattr(module, "config", None)
    spec = FAMILIES.get(getattr(config, "model_type", None))
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    elif spec is not None and spec.mask_only_window:
        window = config.sliding_window
    else:
        window = None
    return window or None


def packsft_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packsft: AttentionContext | None = None,
    sliding_window: int | None | object = WINDOW_FROM_MASK,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None).

    `sliding_window`, `softcap` and `s_aux` (attention sinks, [H], trained) are the layer's features as transformers
    passes them; every other keyword argument must be one of IGNORABLE_KWARGS with a value that may be ignored."""
    ctx = packsft
    if ctx is None:
        raise RuntimeError(
            "attn_implementation='packsft' needs model(..., use_cache=False, packsft=AttentionContext(...))"
        )
    check_attention_kwargs(module, kwargs)
    if attention_mask is not None:  # packsft registers no mask function: a mask here is the layer's own
        raise TypeError(
            f"attn_implementation='packsft' got an attention_mask from {type(module).__name__}: the layer builds its "
            "own mask (e.g. a learned dynamic mask), which packed attention would ignore and so train a different "
            "model"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch dimension 1, got {query.shape[0]}")
    if sliding_window is WINDOW_FROM_MASK:
        sliding_window = mask_only_window(module)
    features = attention_features(query, dropout if module.training else 0.0, sliding_window, softcap, s_aux)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # bf16 without DeepSpeed: the weights stay fp32 under autocast, so q/k arrive fp32 (RoPE in fp32) and v in
        # the autocast dtype; the fused kernels need one half-precision dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if value.shape[-1] != query.shape[-1]:  # multi-head latent attention: v heads of another size than q/k's
        return _attend_other_value_size(ctx, query, key, value, scaling, features, s_aux), None
    return ctx.attend(query, key, value, scaling, features, s_aux), None


def _attend_other_value_size(ctx: AttentionContext, query, key, value, scaling, features, sinks) -> torch.Tensor:
    """Attention whose value heads differ in size from the query / key heads (DeepSeek-V2/V3's MLA: q/k 192, v 128):
    the smaller side zero-padded to the larger, as transformers does for flash attention, and the output cut to the
    value size. Exact: zero columns of q and k add nothing to a score (the scale stays the q/k size's), and zero
    columns of v give output columns that are dropped. The flash kernels need one head size; the plan's kernel runs
    unchanged."""
    qk_size, v_size = query.shape[-1], value.shape[-1]
    if scaling is None:
        scaling = qk_size ** -0.5
    size = max(qk_size, v_size)
    if qk_size < size:
        query, key = (torch.nn.functional.pad(t, (0, size - qk_size)) for t in (query, key))
    else:
        value = torch.nn.functional.pad(value, (0, size - v_size))
    return ctx.attend(query, key, value, scaling, features, sinks)[..., :v_size]


# never traced: compiled decoder layers (compile_layers) break their graph here instead of guarding on the host
# bounds of every micro-batch
AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(packsft_attention))
