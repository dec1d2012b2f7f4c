"""The causal LM's output head as the loss sees it: which transform of `h W^T + b` a family applies, and a check
that it is reproduced.

The trainer computes the loss from the decoder body's final hidden states and the output-embedding weight
(train/loss.py), so it skips what `*ForCausalLM.forward` does between the two: Gemma-2's logit softcap, Cohere's
logit scale, Granite's logits scaling, MiniCPM3's division of the hidden states... Without them a model trains on
other logits than the ones it is evaluated and sampled with. `lm_head_of` reads the transform from the config
through a table (family -> config attributes -> how each applies, written from the transformers 5.23 sources);
`check_lm_head` runs the model's own forward and compares its logits with the reproduced ones, which catches a
family whose forward does something the table does not know (a new family, remote code, a patched forward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.loss import LMHead

# How a config attribute applies to the logits (None: the family applies nothing).
SOFTCAP = "softcap"  # logits = value * tanh(logits / value)
MULTIPLY = "multiply"  # logits *= value
DIVIDE = "divide"  # logits /= value
DIVIDE_HIDDEN = "divide_hidden"  # hidden /= value before the head; the same as DIVIDE for a head without bias
VOCAB_SIZE = "vocab_size"  # logits = logits[..., :value] (a padded output embedding)

_SOFTCAPPED = (("final_logit_softcapping", SOFTCAP),)
_GRANITE = (("logits_scaling", DIVIDE),)

# family (config.model_type) -> ((attribute of config.get_text_config(), how it applies), ...), in the order the
# family's forward applies them. A family not listed applies nothing.
LOGIT_TRANSFORMS: dict[str, tuple[tuple[str, str], ...]] = {
    **dict.fromkeys(
        ("gemma2", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified",
         "gemma4_unified_text", "vaultgemma", "nanochat", "beam", "paligemma", "mistral_large4"),
        _SOFTCAPPED,
    ),
    "recurrent_gemma": (("logits_soft_cap", SOFTCAP),),
    "xlstm": (("output_logit_soft_cap", SOFTCAP),),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), (("logit_scale", MULTIPLY),)),
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid",
         "granite4_vision", "granite_docling"),
        _GRANITE,
    ),
    **dict.fromkeys(("hyperclovax", "hyperclovax_vision_v2"), (("logits_scaling", MULTIPLY),)),
    "falcon_h1": (("lm_head_multiplier", MULTIPLY),),
    **dict.fromkeys(("muse_spark", "muse_glimmer"), (("output_multiplier", MULTIPLY), *_SOFTCAPPED)),
    "minicpm3": (("logits_scaling", DIVIDE_HIDDEN),),
    "inkling_text": (("logits_mup_width_multiplier", DIVIDE_HIDDEN), ("unpadded_vocab_size", VOCAB_SIZE)),
    **dict.fromkeys(("inkling2", "inkling2_text"), (*_SOFTCAPPED, ("unpadded_vocab_size", VOCAB_SIZE))),
}

# families whose head no LMHead expresses, with what their forward does
UNREPRODUCIBLE: dict[str, str] = {
    "chameleon": "its forward sets the logits of the image tokens to the dtype's minimum (out of the softmax)",
    "prophetnet": "its forward predicts n-gram streams from a second hidden-state output",
    **dict.fromkeys(
        ("gemma4_assistant", "gemma4_unified_assistant"),
        "its forward projects the hidden states and may compute the logits from a masked embedding",
    ),
}


class UnsupportedLMHead(ValueError):
    """The trainer cannot reproduce this model's output head, so its loss would not be the model's loss."""

    def __init__(self, family: str, what: str):
        super().__init__(
            f"model family {family!r}: {what}. PackSFT computes the loss from the decoder's final hidden states and "
            f"the output-embedding weight with the logit transform of train/lm_head.py, so it would train this "
            f"model on other logits than its own forward produces. To train it, describe its head in "
            f"train/lm_head.py (LOGIT_TRANSFORMS, or a new LMHead field in train/loss.py) and confirm with "
            f"check_lm_head(lm) that the difference is at rounding level."
        )
        self.family = family


def causal_lm_of(lm: nn.Module) -> nn.Module:
    """The `*ForCausalLM` module, also through a PEFT wrapper."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def decoder_of(lm: nn.Module) -> nn.Module:
    """The transformer body (embeddings + layers + final norm) of a causal LM, also through a PEFT wrapper."""
    causal_lm = causal_lm_of(lm)
    return getattr(causal_lm, causal_lm.base_model_prefix)


def _check_head_structure(causal_lm: nn.Module, family: str) -> None:
    """The output embedding must be a direct child of the causal LM, beside the decoder and no other module with
    parameters: else layers run between the two (BERT's and RoBERTa's prediction transform, ELECTRA's generator
    predictions, ModernBERT-decoder's head) that the loss would skip."""
    head = causal_lm.get_output_embeddings()
    if head is None:
        raise UnsupportedLMHead(family, "it has no output embedding (get_output_embeddings() is None)")
    decoder = decoder_of(causal_lm)
    if not any(child is head for child in causal_lm.children()):
        holder = next((f"{name} ({type(child).__name__})" for name, child in causal_lm.named_children()
                       if any(module is head for module in child.modules())), type(head).__name__)
        raise UnsupportedLMHead(family, f"its output embedding is nested in the head module {holder}, whose forward "
                                        f"the loss does not run")
    extra = [name for name, child in causal_lm.named_children()
             if child is not head and child is not decoder and next(child.parameters(), None) is not None]
    if extra:
        raise UnsupportedLMHead(family, f"module(s) {extra} with parameters sit beside the decoder and the output "
                                        f"embedding; the loss would skip them")


def lm_head_of(lm: nn.Module) -> LMHead:
    """The logit transform of `lm` (a `*ForCausalLM`, possibly PEFT-wrapped), from its config and the table.

    Raises UnsupportedLMHead for a family whose head no LMHead expresses (listed, or with layers between the
    decoder and the output embedding). A transform the table does not know is only found by `check_lm_head`.
    """
    causal_lm = causal_lm_of(lm)
    family = causal_lm.config.model_type
    if family in UNREPRODUCIBLE:
        raise UnsupportedLMHead(family, UNREPRODUCIBLE[family])
    _check_head_structure(causal_lm, family)
    text_config = causal_lm.config.get_text_config()
    scale, softcap, vocab_size = 1.0, None, None
    for attribute, how in LOGIT_TRANSFORMS.get(family, ()):
        value = getattr(text_config, attribute, None)
        if value is None:
            continue
        if how == MULTIPLY:
            scale *= float(value)
        elif how == DIVIDE:
            scale /= float(value)
        elif how == DIVIDE_HIDDEN:
            if getattr(causal_lm.get_output_embeddings(), "bias", None) is not None:
                raise UnsupportedLMHead(family, f"it divides the hidden states by {attribute}={value} before an "
                                                f"output embedding with a bias")
            scale /= float(value)
        elif how == SOFTCAP:
            softcap = float(value)
        elif how == VOCAB_SIZE:
            vocab_size = int(value)
        else:
            raise AssertionError(f"LOGIT_TRANSFORMS[{family!r}]: unknown kind {how!r}")
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
    attn_implementation, training = causal_lm.config._attn_implementation, causal_lm.training
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
    """`check_lm_head`, raising UnsupportedLMHead above `tolerance` (default: 1e-4 for fp32 weights, 3e-2 for
    16-bit ones, whose logits the model rounds). The trainer's start-up self-check. Returns the difference."""
    head = lm_head_of(lm) if head is None else head
    difference = check_lm_head(lm, head)
    if tolerance is None:
        tolerance = 1e-4 if causal_lm_of(lm).get_output_embeddings().weight.dtype == torch.float32 else 3e-2
    if not difference <= tolerance:
        raise UnsupportedLMHead(
            causal_lm_of(lm).config.model_type, f"its forward's logits differ from the reproduced head {head} by {difference:.3g} "
                           f"(relative, tolerance {tolerance:.1g}): its forward transforms the logits in a way the "
                           f"table does not know"
        )
    return difference
