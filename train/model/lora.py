"""LoRA through peft: wrap a causal LM, export the adapter (and optionally the merged model).

`apply_lora` freezes the base model and injects LoRA layers (never into the output head, which the chunked
loss reads as a plain weight). The wrapped model is called exactly like the base one: peft forwards every
extra keyword (position_ids, `packsft=AttentionContext`, use_cache) to the transformers model, and the
trainer reaches the transformers model (its decoder and lm head, for the chunked loss) with `base_causal_lm`. Apply LoRA before `deepspeed.initialize`: ZeRO-2 then only builds optimizer state for the
adapter, ZeRO-3 partitions the new adapter parameters like any other.

`save_lora` takes a PeftModel or a DeepSpeed engine holding one. Under ZeRO-3 it either gathers the partitioned
parameters module by module (call it on EVERY rank then; only the main rank writes) or, given `state_dict=`
(e.g. the engine's consolidated 16-bit state dict on the main rank), reads them from there. The merged
export is computed out of place (W + scale * B A per adapted layer, into a CPU state dict), so the training
weights are never touched and merging/unmerging rounding cannot creep into the run.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from train.checkpoint import export_directory
from train.config.sections import DEFAULT_TARGET_MODULES
from train.model.composite import copy_processor_files, is_composite, text_decoder_targets

__all__ = ["apply_lora", "save_lora", "merged_state_dict", "adapter_state_dict", "base_causal_lm", "is_peft_model"]

ALL_LINEAR = "all-linear"


def is_peft_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(_unwrap(model), PeftModel)


def _unwrap(model: nn.Module) -> nn.Module:
    """Strip DeepSpeed/DDP/accelerate wrappers (`.module`) down to the model itself."""
    from peft import PeftModel

    while not isinstance(model, PeftModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def base_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers CausalLM inside (LoRA layers included): where `.model`, `.lm_head`, `.config` live."""
    model = _unwrap(model)
    if is_peft_model(model):
        return model.get_base_model()
    return model


def _output_head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    for name, module in model.named_modules():
        if module is head:
            return name
    return None


def apply_lora(
    model: nn.Module,
    lora_rank,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    target_modules: str | Sequence[str] = ALL_LINEAR,
    target_parameters: Sequence[str] = (),
):
    """Freeze `model` and wrap it with LoRA adapters; returns the peft `PeftModelForCausalLM`.

    `target_modules`: "all-linear" (every nn.Linear of the decoder) or a list of module names matched as
    peft matches them (suffixes such as "q_proj"). The output head is never adapted.
    `target_parameters`: peft's parameter targets, `module.parameter` suffixes of parameters that are no linear
    layer's (an MoE's fused routed experts: "experts.gate_up_proj", "experts.down_proj"; each a 3-D [experts, ...]
    tensor gets one adapter per expert); () by default.
    `apply_lora(model, cfg)` takes all five settings from a config with those attribute names (TrainConfig).
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if hasattr(lora_rank, "lora_rank"):
        cfg = lora_rank
        lora_rank, lora_alpha, lora_dropout = cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout
        target_modules = cfg.target_modules
        target_parameters = getattr(cfg, "target_parameters", ())

    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank <= 0:
        raise ValueError(f"lora_rank must be a positive integer, got {lora_rank!r}")
    if not lora_alpha > 0:
        raise ValueError(f"lora_alpha must be positive, got {lora_alpha!r}")
    if not 0.0 <= lora_dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}")
    if is_peft_model(model):
        raise ValueError("apply_lora: the model already carries peft adapters")
    targets, target_parameters = check_targets(model, target_modules, target_parameters, lora_dropout)
    head = _output_head_name(model)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=targets,
        exclude_modules=[head] if head else None,
        bias="none",
        target_parameters=target_parameters or None,
    )
    with warnings.catch_warnings():
        # peft reads the deprecated `is_gradient_checkpointing` (and, when it is on, makes the embedding
        # output require grad so checkpointed segments of a frozen model still pass gradients back).
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    return peft_model


def check_targets(model: nn.Module, target_modules, target_parameters, lora_dropout: float):
    """What LoRA of these targets would adapt in `model` (peft's `target_modules`, `target_parameters`), or a
    ConfigError naming the key: the output head named, a target matching nothing, the routed experts named as a
    module, a composite's targets outside its text decoder. Needs the model's modules only, not its weights: the
    start-up runs it on a meta-device copy before any weight loads (train/preflight.py), apply_lora again."""
    from common.config import ConfigError

    if isinstance(target_modules, (list, tuple)) and list(target_modules) == [ALL_LINEAR]:
        target_modules = ALL_LINEAR  # a YAML list holding the keyword
    head = _output_head_name(model)
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            raise ConfigError(f"target_modules must be {ALL_LINEAR!r} or a list of module names, got {target_modules!r}")
        targets: str | list[str] = ALL_LINEAR
    else:
        targets = [str(t) for t in target_modules]
        if not targets:
            raise ConfigError("target_modules is an empty list")
        if head is not None and any(head == t or head.endswith("." + t) for t in targets):
            raise ConfigError(f"target_modules {targets}: the output head {head!r} is never adapted (the loss reads "
                              "its weight)")
        names = {n for n, _ in model.named_modules()}
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing and targets == list(DEFAULT_TARGET_MODULES):
            raise ConfigError(_default_targets_missing(model, missing, head))
        if missing:
            raise ConfigError(f"target_modules {missing} match no module of {type(model).__name__}")
        _refuse_routed_experts(model, targets)
    target_parameters = [str(t) for t in target_parameters or ()]
    if target_parameters:
        _check_target_parameters(model, target_parameters, lora_dropout)
    if is_composite(model.config):  # the text decoder only, never the towers' layers of the same names
        linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name != head]
        targets = text_decoder_targets(model, targets, linear)
        if not targets:
            raise ConfigError(f"target_modules {target_modules} match no layer of the text decoder of "
                              f"{type(model).__name__}: a composite checkpoint adapts its text decoder only")
    return targets, target_parameters


def _default_targets_missing(model: nn.Module, missing: list[str], head: str | None) -> str:
    """Why LoRA's default target_modules do not fit `model` (an MoE whose feed-forward is routed experts has no
    gate_proj / up_proj / down_proj module), and the settings that do: its own linear layers, and its experts'
    fused parameters."""
    from train.model.patches.tiled_mlp import is_experts_module

    linear = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                                if isinstance(module, nn.Linear) and name != head))
    fused = list(dict.fromkeys(f"{name.rsplit('.', 1)[-1]}.{n}" for name, module in model.named_modules()
                               if is_experts_module(module)
                               for n, p in module.named_parameters(recurse=False) if p.dim() == 3))
    quoted = lambda names: "[" + ",".join(f'"{n}"' for n in names) + "]"  # noqa: E731 (as typed on a command line)
    why = (" (its feed-forward layers are routed experts, whose weights are fused 3-D parameters, not linear layers)"
           if fused else "")
    return (f"target_modules is not set, and LoRA's default {list(DEFAULT_TARGET_MODULES)} names modules "
            f"{type(model).__name__} does not have: {', '.join(missing)}{why}. Set target_modules to its linear "
            f"layers, target_modules={quoted(linear)} (or target_modules=all-linear)"
            + (f", and target_parameters={quoted(fused)} to adapt the routed experts too (one adapter per expert)"
               if fused else ""))


def _refuse_routed_experts(model: nn.Module, targets: list[str]) -> None:
    """LoRA adapts linear layers; a target naming a routed-experts module (transformers' fused experts: 3-D weight
    tensors, with or without expert parallelism) is refused with what works."""
    from common.config import ConfigError
    from train.model.patches.tiled_mlp import is_experts_module

    for name, module in model.named_modules():
        hit = [t for t in targets if name == t or name.endswith("." + t)]
        if hit and is_experts_module(module):
            fused = [f"{name.rsplit('.', 1)[-1]}.{n}" for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
            raise ConfigError(
                f"target_modules {hit} names the routed experts ({type(module).__name__} at {name}): their weights are "
                "fused 3-D tensors, not linear layers; adapt them with target_parameters="
                + "[" + ",".join(f'"{n}"' for n in fused) + "] (one adapter per expert), and keep target_modules for "
                "linear layers (e.g. [\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\"])")


def _check_target_parameters(model: nn.Module, targets: list[str], lora_dropout: float) -> None:
    """Each `module.parameter` suffix must name a parameter of the model (peft matches them so)."""
    from common.config import ConfigError

    if lora_dropout:
        raise ConfigError(f"target_parameters={targets} needs lora_dropout=0, got {lora_dropout}")
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]  # a tied head's weight too
    missing = [t for t in targets if "." not in t or not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ConfigError(f"target_parameters {missing} match no parameter of {type(model).__name__} (give "
                          "`module.parameter` suffixes, e.g. \"experts.gate_up_proj\")")
    head = _output_head_name(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding_name = next((name for name, module in model.named_modules() if module is embedding), None)
    tied = embedding is not None and head is not None and \
        getattr(embedding, "weight", None) is getattr(model.get_submodule(head), "weight", False)
    for role, module_name in (("the output head", head), ("the input embedding", embedding_name)):
        if module_name is None:
            continue
        hit = [t for t in targets if any((n == t or n.endswith("." + t)) and n.startswith(module_name + ".")
                                         for n in names)]
        if hit:
            raise ConfigError(
                f"target_parameters {hit} names {role} ({module_name}"
                + (", tied to " + ("the input embedding" if role == "the output head" else "the output head")
                   if tied else "")
                + "), which LoRA never adapts: the chunked loss reads the head's weight as a plain matrix and the "
                "embedding is read by index, so an adapter there would not train (or not merge exactly). "
                "target_parameters are for weights no linear layer holds, e.g. an MoE's routed experts "
                "[\"experts.gate_up_proj\",\"experts.down_proj\"]; drop it")


# ---------------------------------------------------------------------------------------------- export
def _is_main(is_main: bool | None) -> bool:
    if is_main is not None:
        return is_main
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _gathered(params: Iterable[nn.Parameter]):
    """Gather ZeRO-3 partitioned parameters for reading (every rank must enter); a no-op otherwise."""
    params = [p for p in params if hasattr(p, "ds_id")]
    if not params or "deepspeed" not in sys.modules:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _live_state_dict(peft_model: nn.Module, main: bool, only_adapter: bool) -> dict[str, torch.Tensor] | None:
    """The PeftModel's state dict on CPU (ZeRO-3 partitions gathered module by module; every rank must call).

    Keys as in `peft_model.state_dict()`; None on non-main ranks. `only_adapter`: just the `lora_` tensors.
    """
    out: dict[str, torch.Tensor] = {}
    for name, module in peft_model.named_modules():
        prefix = f"{name}." if name else ""
        own = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
        if only_adapter:
            own = [(n, p) for n, p in own if "lora_" in n]
        if not own and only_adapter:
            continue
        with _gathered(p for _, p in own):
            if main:
                for key, p in own:
                    out[key] = p.detach().to("cpu", copy=True)
        if main and not only_adapter:
            for bname, b in module.named_buffers(recurse=False):
                if b is not None and bname not in module._non_persistent_buffers_set:
                    out[prefix + bname] = b.detach().to("cpu", copy=True)
    return out if main else None


def adapter_state_dict(
    model: nn.Module, is_main: bool | None = None, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """The adapter tensors (names as in the PeftModel's state dict) on CPU; None on non-main ranks.

    `state_dict`: take them from this full PeftModel state dict (e.g. ZeRO-3 consolidated) instead of the
    live parameters.
    """
    peft_model = _unwrap(model)
    if not is_peft_model(peft_model):
        raise ValueError("adapter_state_dict: the model has no peft adapters (use apply_lora)")
    if state_dict is not None:
        return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items() if "lora_" in k}
    return _live_state_dict(peft_model, _is_main(is_main), only_adapter=True)


def merged_state_dict(
    model: nn.Module, is_main: bool | None = None, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """State dict of the base transformers model with every active adapter folded in: W + scale * B A.

    Keys are the base model's own (no peft prefixes), tensors on CPU in the base weights' dtype (the sum is
    formed in float32); None on non-main ranks. `state_dict`: a full PeftModel state dict to merge instead of
    the live parameters (then nothing is gathered).
    """
    from peft.tuners.lora import LoraLayer, ParamWrapper

    peft_model = _unwrap(model)
    if not is_peft_model(peft_model):
        raise ValueError("merged_state_dict: the model has no peft adapters (use apply_lora)")
    if state_dict is None:
        state_dict = _live_state_dict(peft_model, _is_main(is_main), only_adapter=False)
        if state_dict is None:
            return None
    outer = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the transformers model
    src = {(k[len(outer):] if k.startswith(outer) else k): v for k, v in state_dict.items()}
    out = dict(src)
    wrapped = []  # the outermost ParamWrapper of each adapted module: its keys lose their `.base_layer`s
    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, ParamWrapper):
            _fold_parameter(module, name, src, out)
            if not any(name.startswith(w + ".") for w in wrapped):
                wrapped.append(name)
            continue
        if not isinstance(module, LoraLayer):
            continue
        w_key = f"{name}.base_layer.weight"
        if w_key not in src:
            raise KeyError(f"merged_state_dict: {w_key} missing from the state dict")
        weight = src[w_key]
        merged = weight.to(torch.float32)
        for adapter, a, b in _adapter_factors(module, name, src):
            delta = (b @ a) * module.scaling[adapter]
            merged = merged + (delta.T if getattr(module, "fan_in_fan_out", False) else delta)
        out[f"{name}.weight"] = merged.to(weight.dtype)
        del out[w_key]
        if f"{name}.base_layer.bias" in out:
            out[f"{name}.bias"] = out.pop(f"{name}.base_layer.bias")
        for key in [k for k in out if k.startswith(f"{name}.lora_")]:
            del out[key]
    for prefix in wrapped:
        for key in [k for k in out if k.startswith(prefix + ".base_layer.")]:
            out[prefix + "." + key[len(prefix) + 1:].replace("base_layer.", "")] = out.pop(key)
    leftover = [k for k in out if "lora_" in k or ".base_layer." in k]
    if leftover:
        raise ValueError(f"merged_state_dict: cannot fold adapter tensors {leftover[:3]} (only LoRA on linear layers)")
    return out


def _adapter_factors(module, name: str, src: dict):
    """(adapter, A, B) in float32 from the state dict `src`, for each active adapter the peft layer `module` (at
    `name`) holds."""
    for adapter in module.active_adapters:
        if adapter in module.lora_A:
            yield (adapter, src[f"{name}.lora_A.{adapter}.weight"].to(torch.float32),
                   src[f"{name}.lora_B.{adapter}.weight"].to(torch.float32))


def _fold_parameter(module, name: str, src: dict, out: dict) -> None:
    """A ParamWrapper's targeted parameter (peft's `target_parameters`) with its adapters folded in, as peft's own
    merge computes it (`ParamWrapper.get_delta_weight`: one B·A per expert of a 3-D parameter), summed in float32;
    its lora_ tensors removed from `out`. The parameter lives in the innermost wrapped module."""
    base, path = module, name
    while hasattr(base, "base_layer") and hasattr(base, "parameter_name"):
        base, path = base.base_layer, f"{path}.base_layer"
    key = f"{path}.{module.parameter_name}"
    if key not in src:
        raise KeyError(f"merged_state_dict: {key} missing from the state dict")
    weight = src[key]
    merged = weight.to(torch.float32)
    for adapter, a, b in _adapter_factors(module, name, src):
        experts = module.num_experts
        if weight.dim() == 2:
            delta = b @ a
        else:
            a, b = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
            layout = "e o i" if module._did_swap_in_out_features else "e i o"
            delta = torch.einsum(f"o r e, e r i -> {layout}", b, a)
        merged = merged + delta * module.scaling[adapter]
    out[key] = merged.to(weight.dtype)
    for lora_key in [k for k in out if k.startswith(f"{name}.lora_")]:
        del out[lora_key]


def save_lora(
    model: nn.Module,
    out_dir: str | os.PathLike,
    merge=False,
    tokenizer=None,
    is_main: bool | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    processor_dir: Path | None = None,
) -> Path | None:
    """Export the adapter to `out_dir` (adapter_config.json + adapter_model.safetensors, loadable with
    `PeftModel.from_pretrained(base, out_dir)`) and, with `merge`, the merged full model in HF format to
    `out_dir/merged` (loadable with `AutoModelForCausalLM.from_pretrained`). The tokenizer, when given, is
    saved next to both. Written to a temp dir and renamed into place.

    `merge` may also be a config with `lora_merge_on_save`. `state_dict`: a full PeftModel state dict (e.g.
    ZeRO-3 consolidated on the main rank) used instead of the live parameters; then nothing is gathered and
    calling on the main rank alone is fine. Without it, under ZeRO-3 call on EVERY rank (collective gathers).
    `processor_dir`: where a composite's processor files come from (train/model/composite.py); they go next to both.
    The main rank (torch.distributed rank 0 unless `is_main` says otherwise) writes and gets `out_dir`; the
    others get None.
    """
    merge = bool(getattr(merge, "lora_merge_on_save", merge))
    peft_model = _unwrap(model)
    if not is_peft_model(peft_model):
        raise ValueError("save_lora: the model has no peft adapters (use apply_lora)")
    main = _is_main(is_main)
    adapter_sd = adapter_state_dict(peft_model, is_main=main, state_dict=state_dict)
    merged_sd = merged_state_dict(peft_model, is_main=main, state_dict=state_dict) if merge else None
    if merged_sd is not None:  # a tied weight (the head of tied embeddings) is saved once, as the checkpoint has it
        for tied in getattr(peft_model.get_base_model(), "all_tied_weights_keys", {}):
            merged_sd.pop(tied, None)
    if not main:
        return None
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = peft_model.get_base_model()
    use_cache = getattr(base.config, "use_cache", None)
    try:
        with export_directory(out) as tmp:
            peft_model.save_pretrained(
                str(tmp), state_dict=adapter_sd, save_embedding_layers=False, safe_serialization=True
            )
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            if processor_dir is not None:
                copy_processor_files(processor_dir, tmp)
            if merge:
                if use_cache is not None:
                    base.config.use_cache = True  # the trainer turns the cache off; generation wants it on
                base.save_pretrained(str(tmp / "merged"), state_dict=merged_sd, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp / "merged"))
                if processor_dir is not None:
                    copy_processor_files(processor_dir, tmp / "merged")
    finally:
        if use_cache is not None:
            base.config.use_cache = use_cache
    return out


def describe_lora(model: nn.Module, lora) -> str:
    """The start line's words for LoRA (`lora`: the config's section): rank, alpha, targets and the trainable
    parameters of the wrapped `model` (ZeRO-3 partitions counted whole)."""
    def numel(p) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(numel(p) for p in model.parameters())
    targets = ALL_LINEAR if list(lora.target_modules) == [ALL_LINEAR] else ", ".join(lora.target_modules)
    parameters = f" and the parameters {', '.join(lora.target_parameters)}" if lora.target_parameters else ""
    return (f"LoRA rank {lora.lora_rank} (alpha {lora.lora_alpha:g}) on {targets}{parameters}: {trainable:,} "
            f"trainable parameters of {total:,} ({100 * trainable / max(total, 1):.2f}%)")
