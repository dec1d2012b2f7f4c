"""The module DeepSpeed wraps (`PackedCausalLM`: the HF causal LM's body on packed rows plus the chunked weighted
loss) and the HF causal LM it wraps (`build_lm`: the packsft attention, Liger, activation checkpointing, LoRA,
compiled decoder layers)."""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from train.attention.function import ATTN_IMPLEMENTATION, AttentionContext
from train.model.composite import attn_implementation, attn_implementations, auto_model_class, freeze_towers, is_composite
from train.config.sections import TrainConfig
from train.families import MediaInputs
from train.model.media import MediaPath, RowMedia
from train.model.lm_head import decoder_of, lm_head_of
from train.model.loss import weighted_lm_loss
from train.model.self_check import check_complete_weights, check_finite_weights
from train.model.moe import RouterAux, records_router_logits
from train.model.patches.recurrent import install_sequence_restart
from train.model.patches.rope import install_per_sequence_rope


class PackedCausalLM(nn.Module):
    """The module DeepSpeed wraps: the HF causal LM's body plus the chunked weighted loss (no full logits).

    The lm-head weight is used here, outside lm_head.forward; under ZeRO-3 it is registered as an external
    parameter of this module so DeepSpeed gathers it around this forward (and reduces its gradient).
    With `router_aux` (MoE, train/model/moe.py) the forward also returns this rank's share of the router aux term.
    With `media` (a composite's `MediaInputs`, the data holds images, videos or audios: `media_kinds`) the forward
    takes each micro-batch's `RowMedia` (`row_media`) and runs the towers (train/model/media.py).
    """

    def __init__(self, lm: nn.Module, chunk_size: int, num_categories: int, zero3: bool = False,
                 router_aux: RouterAux | None = None, fused_loss: bool = False, media: MediaInputs | None = None,
                 media_kinds=None):
        super().__init__()
        self.lm = lm
        self.media = MediaPath(lm, media, media_kinds) if media is not None else None
        self.chunk_size = chunk_size
        self.fused_loss = fused_loss  # train.model.loss's compiled chunk softmax and gradient
        self.num_categories = num_categories
        self.head = lm_head_of(lm)  # what *ForCausalLM.forward does between the hidden states and the logits
        # recurrent mixers (linear attention, state spaces, short convolutions) restart at every packed sequence
        self.recurrent = install_sequence_restart(lm)
        # ropes whose frequencies depend on the sequence length (longrope, dynamic NTK): per packed sequence
        self.ropes = install_per_sequence_rope(lm)
        self.router_aux = router_aux
        # an MoE decoder records its router logits only when asked (the model config may ask for unused ones)
        self._router_kwargs = (
            {"output_router_logits": router_aux is not None} if records_router_logits(decoder_of(lm)) else {}
        )
        if zero3:
            import deepspeed

            head = lm.get_output_embeddings()
            for p in (head.weight, getattr(head, "bias", None)):
                if p is not None:
                    deepspeed.zero.register_external_parameter(self, p)

    def row_media(self, batch) -> RowMedia | None:
        """The media of a whole micro-batch of train/steps/batch.py (`batch.media`, None: none in its rows), prepared
        on its whole row before sequence-parallel sharding; None when the run has no media path (text data)."""
        if self.media is None:
            return None
        return self.media.prepare(self.lm, batch.input_ids, batch.cu_seqlens, batch.media)

    def forward(self, input_ids, position_ids, targets, weights, target_categories, attn: AttentionContext,
                router_tokens: torch.Tensor | None = None, media: RowMedia | None = None):
        """weighted_lm_loss's (weighted_sum, cat_loss_sum, cat_count); with `router_aux`, a fourth value: this
        rank's share of coef * the micro-batch's load-balancing loss over `router_tokens` ([L] 1.0 for a real
        token, 0.0 for sequence-parallel padding or a filler row; None: every token is real). `media`: the
        micro-batch's `row_media` (the towers run, their features replace the media tokens' embeddings, and the
        family's M-RoPE positions replace `position_ids`)."""
        if self.recurrent:  # left set after the forward: activation-checkpoint recomputation in backward reads it
            self.recurrent.set_row(attn.bounds)  # the micro-batch's Row (train/row.py), its index tensors cached
        if self.ropes:
            self.ropes.set_row(attn.bounds)
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        if media is not None:
            inputs = {"position_ids": position_ids, **self.media.decoder_inputs(self.lm, input_ids, media, attn.sp)}
        outputs = decoder_of(self.lm)(**inputs, use_cache=False, packsft=attn, **self._router_kwargs)
        head = self.lm.get_output_embeddings()
        lm_loss = weighted_lm_loss(
            outputs.last_hidden_state[0], head.weight, targets, weights, target_categories, self.num_categories,
            self.chunk_size, lm_head_bias=getattr(head, "bias", None), head=self.head, fused=self.fused_loss,
        )
        if self.router_aux is None:
            return lm_loss
        if router_tokens is None:
            router_tokens = torch.ones(input_ids.numel(), device=input_ids.device)
        sp_group = attn.sp.group if attn.sp is not None else None
        return (*lm_loss, self.router_aux.share(outputs.router_logits, router_tokens, sp_group))

    @contextmanager
    def unpacked(self):
        """The model as transformers runs it unpacked (its own eager attention): the reference of
        train.model.self_check."""
        previous = attn_implementations(self.lm)  # a composite's towers and text decoder each keep their own
        self.lm.set_attn_implementation("eager")
        self.recurrent.clear()
        self.ropes.clear()
        try:
            yield
        finally:
            self.lm.set_attn_implementation(previous)


def build_lm(cfg: TrainConfig, model_config, dtype: torch.dtype, memory=None) -> nn.Module:
    """The HF causal LM of `model_config` (train/preflight.py read it) with the packsft attention (a composite
    checkpoint: its own class, the packsft attention on its text decoder, towers frozen as configured:
    train/model/composite.py); optional Liger kernels, tiled MLPs, activation checkpointing, LoRA and compiled
    decoder layers (in that order: compile wraps the patched, checkpointed layers). `memory`: the run's MemoryPlan
    (train/plan/memory_plan.py: checkpointing of the first `checkpointed_layers` decoder layers, None: all; the MLP
    tile); None: no checkpointing, untiled."""
    model_config = copy.deepcopy(model_config)  # transformers sets the dtype and attention on the config it is given
    model_class = auto_model_class(model_config)
    attention = attn_implementation(model_config, ATTN_IMPLEMENTATION)
    if cfg.model.model_path is not None:
        lm, loading = model_class.from_pretrained(cfg.model.model_path, config=model_config,
                                                  attn_implementation=attention, dtype=dtype, output_loading_info=True)
        check_complete_weights(loading["missing_keys"], lm, cfg.model.model_path)  # never a random tower or layer
        check_finite_weights(lm, cfg.model.model_path)  # a NaN / inf there is named now, not blamed on packing later
    else:
        lm = model_class.from_config(model_config, attn_implementation=attention, dtype=dtype)
    lm.config.use_cache = False
    if is_composite(lm.config):
        lm.config.get_text_config().use_cache = False
        freeze_towers(lm, cfg.model.freeze_vision_tower, cfg.model.freeze_multi_modal_projector,
                      cfg.model.freeze_audio_tower)
    if cfg.model.liger:
        # fused RMSNorm / SwiGLU / RoPE (Triton); the loss stays PackSFT's chunked weighted loss, so Liger's cross
        # entropy kernels are not used
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=lm, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    if memory is not None and memory.tile is not None:
        from train.model.patches.tiled_mlp import install_tiled_mlp

        install_tiled_mlp(lm, memory.tile)
    if memory is not None and memory.checkpointing:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if memory.checkpointed_layers is not None:
            keep_checkpointing(lm, memory.checkpointed_layers)
        if cfg.model.activation_offload:
            from train.model.patches.offload import HostOffload

            HostOffload().install(lm)
    if cfg.lora.lora_rank > 0:
        from train.model.lora import apply_lora

        lm = apply_lora(lm, cfg.lora)
    if cfg.model.compile_layers:
        compile_decoder_layers(lm)
    return lm


def checkpointed_decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The text decoder's layers that activation checkpointing recomputes, in order (a composite's towers aside)."""
    return [m for m in decoder_of(lm).modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def keep_checkpointing(lm: nn.Module, layers: int) -> None:
    """Checkpoint only the first `layers` decoder layers (train/plan/memory.py says why the first): the others keep
    their activations and skip the recomputation. The flag is transformers' own per-layer switch."""
    for i, layer in enumerate(checkpointed_decoder_layers(lm)):
        layer.gradient_checkpointing = i < layers


def compile_decoder_layers(lm: nn.Module) -> None:
    """torch.compile every decoder layer in place. The attention function runs outside the compiled graphs
    (packsft_attention is marked `torch.compiler.disable`: its per-micro-batch host bounds would otherwise be
    guarded on and recompile every step); the projections, RoPE, norms and MLP around it are fused."""
    for layer in decoder_of(lm).layers:
        layer.compile()


def model_features(cfg: TrainConfig, lm: nn.Module, model: PackedCausalLM, memory) -> tuple[str, ...]:
    """What the start line says of the built model (`memory`: the run's MemoryPlan): compiled decoder layers, Liger,
    tiled MLPs, the towers, the activation offload, LoRA."""
    from train.model.patches.tiled_mlp import describe_tiling

    features = []
    if cfg.model.compile_layers:
        features.append("compiled decoder layers")
    if cfg.model.liger:
        features.append("Liger kernels")
    if cfg.model.tiled_mlp:
        features.append(describe_tiling(lm))
    if model.media is not None:
        features.append(model.media.describe(lm))
    if cfg.model.activation_offload and memory.checkpointing:
        features.append("checkpointed inputs offloaded to host memory")
    if cfg.lora.lora_rank > 0:
        from train.model.lora import describe_lora

        features.append(describe_lora(lm, cfg.lora))
    return tuple(features)
