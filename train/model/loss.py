"""Weighted LM loss from final hidden states, chunked over tokens so full-vocabulary logits never exist.

A 128K-token row with a 152K vocabulary has 128K x 152K logits (40 GB in bf16). `weighted_lm_loss` runs the
lm-head matmul and the cross-entropy `chunk_size` tokens at a time inside one custom autograd function:

- Forward computes, per chunk, the logits (fp32 log-sum-exp), the per-token losses AND, when a gradient is
  needed, the chunk's gradients: d loss / d logits = w * (softmax - onehot), then grad_hidden for the chunk
  and an fp32 accumulation of grad_weight (and grad_bias), each only for an input that requires grad (a frozen
  LoRA head gets no [V, H] buffer). Only those gradients are saved; the logits of a
  chunk are freed before the next chunk. Backward only scales the saved gradients by the incoming scalar.
  This costs 3 matmuls per chunk instead of the 4 of recomputing the logits in backward, and the saved
  tensors (grad_hidden [T,H], grad_weight [V,H] fp32) have the size of the gradients themselves, so peak
  memory is bounded by the chunk's logits plus the gradients, whatever the row length.
- Only positions with a target (!= -100) enter the matmuls.
- Matmuls run in the autocast dtype when autocast is on at call time (like `F.linear` would), else in the
  inputs' dtype; log-sum-exp, losses and the weight-gradient accumulation are fp32.
- Tied embeddings: the function returns an ordinary gradient for the weight; autograd adds it to the
  embedding's gradient because it is the same Parameter.

The head may transform the logits (`LMHead`: Gemma's softcap, Cohere's logit scale, Granite's logits scaling,
see train/model/lm_head.py for the families): logits = softcap(scale * (h W^T + b)), then only the first `vocab_size`
columns. The chunked path applies it per chunk in fp32 and chains its derivative into d loss / d logits
(scale * (1 - tanh^2) for the softcap, which keeps a second [chunk, V] fp32 buffer); an identity head adds no
operation at all.

`fused=True` computes a chunk's softmax, losses and d loss / d logits in one function compiled by torch.compile
(`chunk_ce_grad`): it reads the chunk's logits in the matmul dtype and writes only the gradient in that dtype, where
the eager loop makes ~8 fp32 passes over [chunk, V] (upcast, log-sum-exp, exp, one-hot, scale, downcast); the same
maths, equal within fp32 rounding of the log-sum-exp.

`chunk_size` None or 0 is the plain reference path (full logits, autograd), used by the tests and the memory
benchmark's "unchunked" baseline.

ZeRO-3: the caller must run this inside the forward of a module that owns the lm-head weight or declared it
with `deepspeed.zero.register_external_parameter` (train/model/packed.py's PackedCausalLM does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LMHead:
    """What a causal LM does to `h W^T + b` before its softmax: logits = softcap(scale * (h W^T + b)), where
    softcap(z) = softcap * tanh(z / softcap) (None: no cap), keeping only the first `vocab_size` logits (None:
    all; a padded vocabulary). The default is the plain linear head."""

    scale: float = 1.0
    softcap: float | None = None
    vocab_size: int | None = None

    def __post_init__(self):
        if not self.scale > 0:
            raise ValueError(f"LMHead.scale must be > 0, got {self.scale}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"LMHead.softcap must be > 0 or None, got {self.softcap}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"LMHead.vocab_size must be >= 1 or None, got {self.vocab_size}")

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's transform of `h W^T + b` (through autograd, fp32): the reference path and the checks."""
        logits = logits.float()
        if self.vocab_size is not None:
            logits = logits[..., : self.vocab_size]
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


IDENTITY_HEAD = LMHead()


def chunk_ce_grad(logits: torch.Tensor, targets: torch.Tensor, row_scale: torch.Tensor,
                  bias: torch.Tensor | None, scale: float, softcap: float | None, need_grad: bool, need_bias_grad: bool):
    """One chunk's (ce [c] fp32, d loss / d (h W^T + b) [c, V] in the logits' dtype or None, its fp32 column sum
    or None unless `need_bias_grad`): the head's transform, log-sum-exp and gradient in fp32, as
    `eager_chunk_ce_grad` computes them in place, written as one functional expression for torch.compile to fuse."""
    z = logits.float()
    if bias is not None:
        z = z + bias.float()
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        tanh_z = torch.tanh(z / softcap)
        z = tanh_z * softcap
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(1, targets.unsqueeze(1)).squeeze(1)
    if not need_grad:
        return ce, None, None
    onehot = torch.arange(z.shape[1], device=z.device).unsqueeze(0) == targets.unsqueeze(1)
    d = (torch.exp(z - lse.unsqueeze(1)) - onehot.float()) * row_scale.unsqueeze(1)
    if softcap is not None:
        d = d * (1.0 - tanh_z * tanh_z)
    return ce, d.to(logits.dtype), (d.sum(0) if need_bias_grad else None)


def eager_chunk_ce_grad(logits: torch.Tensor, targets: torch.Tensor, row_scale: torch.Tensor,
                        bias: torch.Tensor | None, scale: float, softcap: float | None, need_grad: bool,
                        need_bias_grad: bool):
    """`chunk_ce_grad` in place over one fp32 [c, V] buffer (the logits become the softmax, then the gradient):
    the lowest memory without a compiler."""
    grad_dtype = logits.dtype
    logits = logits.float()
    if bias is not None:
        logits += bias.float()
    if scale != 1.0:
        logits.mul_(scale)
    if softcap is not None:
        tanh_z = logits.div_(softcap).tanh_()  # in place of the scaled logits
        logits = tanh_z * softcap
    lse = torch.logsumexp(logits, dim=-1)
    rows = torch.arange(logits.shape[0], device=logits.device)
    ce = lse - logits[rows, targets]
    if not need_grad:
        return ce, None, None
    probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
    probs[rows, targets] -= 1.0
    probs.mul_(row_scale.unsqueeze(1))
    if softcap is not None:
        probs.mul_(tanh_z.square_().neg_().add_(1.0))  # d/dz softcap * tanh(z / softcap)
        del tanh_z
    g_b = probs.sum(0) if need_bias_grad else None
    return ce, probs.to(grad_dtype), g_b


_compiled_chunk_ce_grad = None


def compiled_chunk_ce_grad():
    """`chunk_ce_grad` under torch.compile, built on first use; shapes dynamic (every step's last chunk differs)."""
    global _compiled_chunk_ce_grad
    if _compiled_chunk_ce_grad is None:
        _compiled_chunk_ce_grad = torch.compile(chunk_ce_grad, dynamic=True)
    return _compiled_chunk_ce_grad


def _check_inputs(hidden, weight, targets, weights, target_categories, num_categories):
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    n_tok, dim = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != dim:
        raise ValueError(f"lm_head weight must be [V, {dim}], got {tuple(weight.shape)}")
    for name, t in (("targets", targets), ("weights", weights), ("target_categories", target_categories)):
        if t.shape != (n_tok,):
            raise ValueError(f"{name} must be [{n_tok}], got {tuple(t.shape)}")
    if num_categories < 1:
        raise ValueError(f"num_categories must be >= 1, got {num_categories}")


def _category_sums(ce: torch.Tensor, categories: torch.Tensor, num_categories: int):
    """(sum of ce per category, token count per category) over the given tokens, float32 / int64, no grad."""
    if categories.numel() and (categories.min() < 0 or categories.max() >= num_categories):
        raise ValueError(
            f"target category ids must lie in [0, {num_categories}), got [{int(categories.min())}, "
            f"{int(categories.max())}]"
        )
    loss_sum = torch.zeros(num_categories, dtype=torch.float32, device=ce.device)
    loss_sum.index_add_(0, categories, ce.detach().float())
    count = torch.bincount(categories, minlength=num_categories).to(torch.int64)
    return loss_sum, count


class _ChunkedWeightedCE(torch.autograd.Function):
    """sum_t weights[t] * CE(hidden[t] @ W^T + b, targets[t]), gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, target_categories, num_categories, chunk_size, needs,
                compute_dtype, head, fused):
        # autocast is off inside: matmuls run in `compute_dtype` (the autocast dtype at call time, if any)
        with torch.autocast(hidden.device.type, enabled=False):
            return _ChunkedWeightedCE._forward(ctx, hidden, weight, bias, targets, weights, target_categories,
                                               num_categories, chunk_size, needs, compute_dtype, head, fused)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, targets, weights, target_categories, num_categories, chunk_size, needs,
                 compute_dtype, head, fused):
        """`needs`: which of (hidden, weight, bias) want a gradient; only those are computed and saved (a frozen
        lm head, e.g. LoRA, gets no [V, H] fp32 buffer)."""
        need_h, need_w, need_b = needs
        need_grad = need_h or need_w or need_b
        valid = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        n_valid = valid.numel()
        h_sel = hidden.index_select(0, valid)
        t_sel = targets.index_select(0, valid)
        w_sel = weights.index_select(0, valid).float()
        vocab = weight.shape[0]
        if n_valid and (t_sel.min() < 0 or t_sel.max() >= vocab):
            raise ValueError(f"targets must lie in [0, {vocab}) or be -100")

        ce = torch.empty(n_valid, dtype=torch.float32, device=hidden.device)
        grad_h_sel = torch.empty_like(h_sel) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_b else None
        w_comp = weight.to(compute_dtype)
        # d loss / d (h W^T + b) = scale * d loss / d (scaled logits): the scale rides on the token weights
        row_scale = w_sel if head.scale == 1.0 else w_sel * head.scale
        chunk_fn = compiled_chunk_ce_grad() if fused else eager_chunk_ce_grad
        for lo in range(0, n_valid, chunk_size):
            hi = min(lo + chunk_size, n_valid)
            h_c = h_sel[lo:hi].to(compute_dtype)
            ce[lo:hi], g, g_b = chunk_fn(h_c @ w_comp.t(), t_sel[lo:hi], row_scale[lo:hi], bias, head.scale,
                                         head.softcap, need_grad, need_b)
            if need_grad:
                _ChunkedWeightedCE._accumulate(g, g_b, h_c, w_comp, lo, hi, grad_h_sel, grad_w, grad_b, compute_dtype)
            del g

        weighted_sum = (ce * w_sel).sum()
        cat_loss_sum, cat_count = _category_sums(ce, target_categories.index_select(0, valid), num_categories)
        ctx.mark_non_differentiable(cat_loss_sum, cat_count)
        if need_grad:
            grad_hidden = None
            if need_h:
                grad_hidden = torch.zeros_like(hidden)
                grad_hidden.index_copy_(0, valid, grad_h_sel)
            ctx.save_for_backward(grad_hidden, grad_w, grad_b)
        ctx.has_bias = bias is not None
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return weighted_sum, cat_loss_sum, cat_count

    @staticmethod
    def _accumulate(g, g_b, h_c, w_comp, lo, hi, grad_h_sel, grad_w, grad_b, compute_dtype):
        """Chain one chunk's d loss / d logits `g` (and its column sum `g_b`) into the wanted gradients."""
        if grad_b is not None:
            grad_b += g_b
        if grad_h_sel is not None:
            if grad_h_sel.dtype == compute_dtype:
                torch.mm(g, w_comp, out=grad_h_sel[lo:hi])
            else:
                grad_h_sel[lo:hi] = g @ w_comp
        if grad_w is not None:
            if compute_dtype == torch.float32:
                grad_w.addmm_(g.t(), h_c)  # in place: no [V, H] temporary per chunk
            else:
                grad_w += (g.t() @ h_c).float()

    @staticmethod
    def backward(ctx, grad_out, _grad_cat_sum, _grad_cat_count):
        # Scaled in place: no second [V, H] buffer. A second backward through the same graph then fails loudly
        # (autograd's saved-tensor version check) instead of reusing scaled gradients.
        grad_hidden, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = grad_out.float()
        gh = None
        if grad_hidden is not None and ctx.needs_input_grad[0]:
            gh = grad_hidden.mul_(scale.to(grad_hidden.dtype))
        gw = grad_w.mul_(scale).to(w_dtype) if grad_w is not None and ctx.needs_input_grad[1] else None
        gb = grad_b.mul_(scale).to(b_dtype) if grad_b is not None and ctx.needs_input_grad[2] else None
        return gh, gw, gb, None, None, None, None, None, None, None, None, None


def _reference_loss(hidden, weight, bias, targets, weights, target_categories, num_categories, head):
    """Unchunked path: full [T, V] logits through autograd (the baseline most trainers use)."""
    logits = head.transform(F.linear(hidden, weight, bias))
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    valid = targets != IGNORE_INDEX
    weighted_sum = (ce * weights.float() * valid).sum()
    cat_loss_sum, cat_count = _category_sums(ce[valid], target_categories[valid], num_categories)
    return weighted_sum, cat_loss_sum, cat_count


def weighted_lm_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    target_categories: torch.Tensor,
    num_categories: int,
    chunk_size: int | None,
    lm_head_bias: torch.Tensor | None = None,
    head: LMHead = IDENTITY_HEAD,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted_sum, cat_loss_sum [C], cat_count [C]) of one micro-batch (or one sp shard of it).

    hidden [T, H] (final hidden states, any float dtype), lm_head_weight [V, H], targets [T] (-100 ignored),
    weights [T] (the step weights of `train.steps.batch.make_batch`), target_categories [T] in [0, num_categories).
    weighted_sum = sum_t weights[t] * ce[t] (fp32 scalar, differentiable wrt hidden, weight and bias);
    cat_loss_sum[c] = sum of ce over the targets of category c (fp32), cat_count[c] their number (int64);
    both without gradient. A shard with no target gives exact zeros (and zero gradients), never NaN.
    chunk_size None/0: unchunked reference path. head: the model's logit transform (train.model.lm_head.lm_head_of).
    fused: each chunk's softmax and gradient in one compiled function (`chunk_ce_grad`); chunked path only.
    """
    _check_inputs(hidden, lm_head_weight, targets, weights, target_categories, num_categories)
    if head.vocab_size is not None:  # padded vocabulary: the rows past vocab_size never reach the softmax
        lm_head_weight = lm_head_weight[: head.vocab_size]
        lm_head_bias = None if lm_head_bias is None else lm_head_bias[: head.vocab_size]
    targets = targets.to(torch.long)
    target_categories = target_categories.to(torch.long)
    if not chunk_size:
        return _reference_loss(hidden, lm_head_weight, lm_head_bias, targets, weights, target_categories, num_categories,
                               head)
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be positive (or 0/None for unchunked), got {chunk_size}")
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and lm_head_weight.requires_grad,
        grad_on and lm_head_bias is not None and lm_head_bias.requires_grad,
    )
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, lm_head_weight.dtype)
    return _ChunkedWeightedCE.apply(
        hidden, lm_head_weight, lm_head_bias, targets, weights, target_categories, num_categories, int(chunk_size),
        needs, compute_dtype, head, fused,
    )
