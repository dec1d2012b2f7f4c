"""The causal LM's output head as the loss sees it: which transform of `h W^T + b` a family applies.

The trainer computes the loss from the decoder body's final hidden states and the output-embedding weight
(train/model/loss.py), so it skips what `*ForCausalLM.forward` does between the two: Gemma-2's logit softcap, Cohere's
logit scale, Granite's logits scaling, MiniCPM3's division of the hidden states... Without them a model trains on
other logits than the ones it is evaluated and sampled with. `lm_head_of` reads the transform from the config
through the family's `logits` in train/families.py (config attributes and how each applies). A family whose forward
does something the table does not know (a new family, remote code, a patched forward) is caught by comparing the
packed loss with the model's own forward (train/model/self_check.py: the trainer's start-up self-check and the
conformance suite).
"""
from __future__ import annotations

from torch import nn

from train.model.composite import check_composite_structure, is_composite, text_decoder_of
from train.families import FAMILIES, LogitOp
from train.model.loss import LMHead
from train.model.support import UnsupportedModelError


def _unsupported_head(family: str, what: str) -> UnsupportedModelError:
    """The error for a head the loss cannot reproduce: its loss would not be the model's loss."""
    return UnsupportedModelError(
        f"model family {family!r}: {what}. PackSFT computes the loss from the decoder's final hidden states and "
        f"the output-embedding weight with the family's logit transform (train/families.py), so it would train "
        f"this model on other logits than its own forward produces. To train it, describe its head in "
        f"train/families.py (the family's `logits`, or a new LMHead field in train/model/loss.py) and confirm with the "
        f"conformance suite (tests/train/test_families.py) that its packed loss is the model's own."
    )


def causal_lm_of(lm: nn.Module) -> nn.Module:
    """The `*ForCausalLM` module, also through a PEFT wrapper."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def decoder_of(lm: nn.Module) -> nn.Module:
    """The transformer body (embeddings + layers + final norm) of a causal LM, also through a PEFT wrapper; of a
    composite checkpoint, its text decoder (train/model/composite.py)."""
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
    between the decoder and the output embedding). A transform the table does not know is only found by running
    the model's own forward (train/model/self_check.py).
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
