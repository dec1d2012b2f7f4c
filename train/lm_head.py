"""The causal LM's output head as the loss sees it: which transform of `h W^T + b` a family applies, and a check
that it is reproduced.

The trainer computes the loss from the decoder body's final hidden states and the output-embedding weight
(train/loss.py), so it skips what `*ForCausalLM.forward` does between the two: Gemma-2's logit softcap, Cohere's
logit scale, Granite's logits scaling, MiniCPM3's division of the hidden states... Without them a model trains on
other logits than the ones it is evaluated and sampled with. `lm_head_of` reads the transform from the config
through the family's `logits` in train/families.py (config attributes and how each applies);
`check_lm_head` runs the model's own forward and compares its logits with the reproduced ones, which catches a
family whose forward does something the table does not know (a new family, remote code, a patched forward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.composite import attn_implementations, check_composite_structure, is_composite, text_decoder_of
from train.families import FAMILIES, LogitOp
from train.loss import LMHead
from train.model_support import UnsupportedModelError

def _unsupported_head(family: str, what: str) -> UnsupportedModelError:
    """The error for a head the loss cannot reproduce: its loss would not be the model's loss."""
    return UnsupportedModelError(
        f"model family {family!r}: {what}. PackSFT computes the loss from the decoder's final hidden states and "
        f"the output-embedding weight with the family's logit transform (train/families.py), so it would train "
        f"this model on other logits than its own forward produces. To train it, describe its head in "
        f"train/families.py (the family's `logits`, or a new LMHead field in train/loss.py) and confirm with "
        f"check_lm_head(lm) that the difference is at rounding level."
    )


def causal_lm_of(lm: nn.Module) -> nn.Module:
    """The `*ForCausalLM` module, also through a PEFT wrapper."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def decoder_of(lm: nn.Module) -> nn.Module:
    """The transformer body (embeddings + layers + final norm) of a causal LM, also through a PEFT wrapper; of a
    composite checkpoint, its text decoder (train/composite.py)."""
    causal_lm = causal_lm_of(lm)
    if is_composite(causal_lm.config):
        return text_decoder_of(causal_lm)
    return getattr(causal_lm, causal_lm.base_model_prefix)


def _check_head_structure(causal_lm: nn.Module, family: str) -> None:
    """The output embedding must be a direct child of the causal LM, beside the decoder and no other module with
    parameters: else layers run between the two (BERT's and RoBERTa's prediction transform, ELECTRA's generator
    predictions, ModernBERT-decoder's head) that the loss would skip."""
    if is_composite(causal_lm.config):
        return check_composite_structure(causal_lm)
    head = causal_lm.get_output_embeddings()
    if head is None:
        raise _unsupported_head(family, "it has no output embedding (get_output_embeddings() is None)")
    decoder = decoder_of(causal_lm)
    if not any(child is head for child in causal_lm.children()):
        holder = next((f"{name} ({type(child).__name__})" for name, child in causal_lm.named_children()
                       if any(module is head for module in child.modules())), type(head).__name__)
        raise _unsupported_head(family, f"its output embedding is nested in the head module {holder}, whose forward "
                                         f"the loss does not run")
    extra = [name for name, child in causal_lm.named_children()
             if child is not head and child is not decoder and next(child.parameters(), None) is not None]
    if extra:
        raise _unsupported_head(family, f"module(s) {extra} with parameters sit beside the decoder and the output "
                                         f"embedding; the loss would skip them")


def lm_head_of(lm: nn.Module) -> LMHead:
    """The logit transform of `lm` (a `*ForCausalLM`, possibly PEFT-wrapped), from its config and its family's
    `logits` (train/families.py; a family not in the table applies nothing).

    Raises UnsupportedModelError for a family whose head no LMHead expresses (its `unreproducible_head`, or layers
    between the decoder and the output embedding). A transform the table does not know is only found by
    `check_lm_head`.
    """
    causal_lm = causal_lm_of(lm)
    family = causal_lm.config.model_type
    spec = FAMILIES.get(family)
    if spec is not None and spec.unreproducible_head:
        raise _unsupported_head(family, spec.unreproducible_head)
    _check_head_structure(causal_lm, family)
    text_config = causal_lm.config.get_text_config()
    scale, softcap, vocab_size = 1.0, None, None
    for attribute, op in spec.logits if spec is not None else ():
        value = getattr(text_config, attribute, None)
        if value is None:
            continue
        if op is LogitOp.MULTIPLY:
            scale *= float(value)
        elif op is LogitOp.DIVIDE:
            scale /= float(value)
        elif op is LogitOp.DIVIDE_HIDDEN:
            if getattr(causal_lm.get_output_embeddings(), "bias", None) is not None:
                raise _unsupported_head(family, f"it divides the hidden states by {attribute}={value} before an "
                                                 f"output embedding with a bias")
            scale /= float(value)
        elif op is LogitOp.SOFTCAP:
            softcap = float(value)
        else:
            vocab_size = int(value)  # LogitOp.VOCAB_SIZE
    return LMHead(scale=scale, softcap=softcap, vocab_size=vocab_size)


def head_logits(hidden: torch.Tensor, causal_lm: nn.Module, head: LMHead) -> torch.Tensor:
    """fp32 logits of final hidden states through the output embedding and `head` (what the loss computes)."""
    out = causal_lm.get_output_embeddings()
    return head.transform(F.linear(hidden.to(out.weight.dtype), out.weight, getattr(out, "bias", None)))


@torch.no_grad()
def check_lm_head(lm: nn.Module, head: LMHead | None = None, num_tokens: int = 16, seed: int = 0) -> float:
    """Max |model logits - reproduced logits| / max |model logits| on `num_tokens` random tokens (one sequence).

    Runs the model's own forward (eager attention, no cache, eval mode; all three restored after) and, on the
    final hidden states its decoder returned in that same forward, the output embedding and `head` (default
    `lm_head_of(lm)`). At rounding level of the model's dtype when the head is reproduced. Under ZeRO-3 it must
    run with the parameters gathered.
    """
    causal_lm = causal_lm_of(lm)
    head = lm_head_of(lm) if head is None else head
    weight = causal_lm.get_output_embeddings().weight
    vocab = causal_lm.config.get_text_config().vocab_size
    input_ids = torch.randint(head.vocab_size or vocab, (1, num_tokens),
                              generator=torch.Generator().manual_seed(seed)).to(weight.device)
    decoder_outputs = []
    hook = decoder_of(causal_lm).register_forward_hook(lambda module, args, output: decoder_outputs.append(output))
    attn_implementation, training = attn_implementations(causal_lm), causal_lm.training
    try:
        causal_lm.set_attn_implementation("eager")
        causal_lm.eval()
        model_logits = causal_lm(input_ids=input_ids, use_cache=False).logits[0].float()
    finally:
        hook.remove()
        causal_lm.set_attn_implementation(attn_implementation)
        causal_lm.train(training)
    reproduced = head_logits(decoder_outputs[-1][0][0], causal_lm, head)
    if reproduced.shape != model_logits.shape:
        return float("inf")
    return float((model_logits - reproduced).abs().max() / model_logits.abs().max().clamp_min(1e-30))


def verify_lm_head(lm: nn.Module, head: LMHead | None = None, tolerance: float | None = None) -> float:
    """`check_lm_head`, raising UnsupportedModelError above `tolerance` (default: 1e-4 for fp32 weights, 3e-2 for
    16-bit ones, whose logits the model rounds). The trainer's start-up self-check. Returns the difference."""
    head = lm_head_of(lm) if head is None else head
    difference = check_lm_head(lm, head)
    if tolerance is None:
        tolerance = 1e-4 if causal_lm_of(lm).get_output_embeddings().weight.dtype == torch.float32 else 3e-2
    if not difference <= tolerance:
        raise _unsupported_head(
            causal_lm_of(lm).config.model_type, f"its forward's logits differ from the reproduced head {head} by {difference:.3g} "
                           f"(relative, tolerance {tolerance:.1g}): its forward transforms the logits in a way the "
                           f"table does not know"
        )
    return difference
