"""Composite (multimodal) checkpoints trained on packed text: Qwen3.5, Gemma 3/4, Mistral 3, Qwen2.5-VL, ...

A composite checkpoint is a `*ForConditionalGeneration`: `model.<towers>` (vision / audio encoders, projectors)
beside `model.language_model` (the text decoder, `get_decoder()`) and `lm_head`. On text rows its forward only
embeds the tokens and runs the text decoder and the head, so PackSFT loads the composite with its own class (the
image-text-to-text mapping's), trains the text decoder and the head through the packed path, and keeps the towers
loaded (by default frozen: `freeze_vision_tower`, `freeze_audio_tower`, `freeze_multi_modal_projector`), so `final/` is the same composite
again, every key of the checkpoint under its own name. Which composites train exactly is their `FamilySpec` in
train/families.py (`text_family`: the text decoder's model type); the conformance suite checks each exact one
against the composite's own forward on each sequence alone.

Multimodal rotary positions (M-RoPE: Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4V) need nothing here: their text
decoders expand 1-D `position_ids` to the three (t, h, w) components, which is what their composites compute for
text-only rows, so the packed per-sequence positions restart every component at each sequence.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from torch import nn

from train.families import FAMILIES
from train.model.support import UnsupportedModelError

# files of the checkpoint directory that belong to its processor (the tokenizer is exported on its own)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja", "additional_chat_templates")
# a tower module whose name says it maps a tower's output into the text embedding space (freeze_multi_modal_projector)
PROJECTOR = re.compile(r"projector|projection|connector|merger|aligner|adapter|resampler|embed_vision|embed_audio")
# a tower module whose name says it encodes audio (freeze_audio_tower; every other tower is freeze_vision_tower's)
AUDIO_TOWER = re.compile(r"audio")


def is_composite(config) -> bool:
    """A composite checkpoint the family table knows (its spec names a `text_family`)."""
    spec = FAMILIES.get(getattr(config, "model_type", None))
    return spec is not None and spec.text_family is not None


def auto_model_class(config):
    """The transformers auto class that loads this checkpoint: for a composite the multimodal-LM mapping's (the
    image-text-to-text composites and the audio ones, Qwen2-Audio's: the composite's own class), else the causal
    LM."""
    from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM

    return AutoModelForMultimodalLM if is_composite(config) else AutoModelForCausalLM


def attn_implementation(config, implementation: str):
    """The `attn_implementation` to load a model of `config` with: `implementation` everywhere for a causal LM; for
    a composite, on its text decoder alone (its towers keep their own: some, SAM's, have no AttentionInterface
    path, and part of them runs on images, never on packed text)."""
    if not is_composite(config):
        return implementation
    text = config.get_text_config()
    return {key: implementation for key in config.sub_configs if getattr(config, key, None) is text}


def attn_implementations(model: nn.Module) -> dict:
    """The attention implementation of the model and of each of its sub-configs, in the form
    `set_attn_implementation` restores them from (one string would overwrite the towers' and the decoder's alike)."""
    config = model.config
    subs = {key: getattr(config, key) for key in getattr(config, "sub_configs", {})}
    return {"": config._attn_implementation,
            **{key: sub._attn_implementation for key, sub in subs.items() if sub is not None}}


def _body(composite: nn.Module) -> nn.Module:
    return getattr(composite, composite.base_model_prefix)


def text_decoder_of(composite: nn.Module) -> nn.Module:
    """The text decoder (embeddings + layers + final norm) of a composite: what runs on text rows."""
    return composite.get_decoder()


def towers_of(composite: nn.Module) -> dict[str, nn.Module]:
    """The modules of the composite's body beside its text decoder, by qualified name: the vision / audio towers and
    their projectors, which text rows never run."""
    body, decoder = _body(composite), text_decoder_of(composite)
    prefix = composite.base_model_prefix
    return {f"{prefix}.{name}": child for name, child in body.named_children()
            if child is not decoder and next(child.parameters(), None) is not None}


def check_composite_structure(composite: nn.Module) -> None:
    """Raise UnsupportedModelError unless text rows run exactly the text decoder and `lm_head`: the decoder is a
    child of the composite's body and the output embedding a child of the composite, beside no other module with
    parameters (which the loss would skip)."""
    family = composite.config.model_type
    body, decoder, head = _body(composite), text_decoder_of(composite), composite.get_output_embeddings()
    if head is None or not any(child is decoder for child in body.children()):
        raise UnsupportedModelError(
            f"model family {family!r}: a composite checkpoint whose text decoder or output embedding is not where "
            "PackSFT trains it (`model.language_model` and `lm_head`)")
    extra = [name for name, child in composite.named_children()
             if child is not head and child is not body and next(child.parameters(), None) is not None]
    if extra:
        raise UnsupportedModelError(
            f"model family {family!r}: module(s) {extra} with parameters sit beside the composite's body and its "
            "output embedding; the loss would skip them")


def freeze_towers(composite: nn.Module, vision_tower: bool, projector: bool, audio_tower: bool = True) -> list[str]:
    """Freeze the towers (`vision_tower`; `audio_tower` for the audio ones, names matching AUDIO_TOWER) and the
    projectors (`projector`, names matching PROJECTOR) of a composite; the names of the frozen modules. Text rows give
    them no gradient either way; frozen, they hold no optimizer state and export bitwise unchanged."""
    frozen = []
    for name, module in towers_of(composite).items():
        child = name.rpartition(".")[2]
        if PROJECTOR.search(child):
            freeze = projector
        else:
            freeze = audio_tower if AUDIO_TOWER.search(child) else vision_tower
        if freeze:
            module.requires_grad_(False)
            frozen.append(name)
    return frozen


def text_decoder_targets(composite: nn.Module, targets: str | list[str], linear_names: list[str]) -> list[str]:
    """LoRA targets of a composite restricted to its text decoder: the qualified names of `linear_names` (every
    nn.Linear of the model) inside the decoder that `targets` ('all-linear', or suffixes as peft matches them)
    selects. peft would otherwise adapt the towers' layers of the same names (q_proj, mlp.gate_proj)."""
    decoder = text_decoder_of(composite)
    prefix = next(name for name, module in composite.named_modules() if module is decoder) + "."
    inside = [name for name in linear_names if name.startswith(prefix)]
    if isinstance(targets, str):
        return inside
    return [name for name in inside if any(name == t or name.endswith("." + t) for t in targets)]


def processor_dir(config, model_path: str | None, tokenizer_path: str | None) -> Path | None:
    """The directory whose processor files (image processor, chat template) a composite's export carries: the
    checkpoint's, else the exported tokenizer's when it is a processor directory (a random-init composite with
    `tokenizer_path` at a processor, as configs/train/example_vision.yaml); None for a causal LM."""
    if not is_composite(config):
        return None
    from common.config import pretrained_dir

    checkpoint = pretrained_dir(model_path, "model_path") if model_path is not None else None
    for directory in (checkpoint, Path(tokenizer_path) if tokenizer_path else None):
        if directory is not None and (directory / "preprocessor_config.json").is_file():
            return directory
    return checkpoint


def copy_processor_files(source: Path, destination: Path) -> list[str]:
    """Copy the processor's files of a checkpoint directory (PROCESSOR_FILES) that `destination` does not hold yet;
    their names."""
    copied = []
    for name in PROCESSOR_FILES:
        src, dst = source / name, destination / name
        if dst.exists() or not src.exists():
            continue
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
        copied.append(name)
    return copied
