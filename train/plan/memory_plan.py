"""The memory plan of a run, made once at start before any weight loads: `plan_memory` -> `MemoryPlan`.

What it decides, from the model shape (derived once here), the data's row length, the parallel layout (its SP
degree: train/plan/layout.py) and the device:
- activation checkpointing per layer (`gradient_checkpointing: auto`: on a GPU from the estimate of
  train/plan/memory.py, the fewest first decoder layers; on CPU by row length);
- tiled_mlp's tile;
- the host memory the activation offload needs (refused at start when it does not fit).
`choose_sp_degree_for` is the SP degree of `sequence_parallel_size: auto` from the same estimates (the layout asks it).
The model builder (train/model/packed.py `build_lm`) takes the plan; it decides none of it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from common.config import ConfigError
from train.config.sections import TrainConfig
from train.distributed import default_device, ranks_per_machine
from train.model.patches.tiled_mlp import intermediate_size
from train.plan.memory import (
    LongRowOptions,
    ModelShape,
    all_to_all_bytes,
    available_host_bytes,
    choose_checkpointing,
    choose_sp_degree,
    host_offload_problem,
    media_towers,
    mlp_tile,
    model_state_bytes,
)


@dataclass(frozen=True)
class MemoryPlan:
    """What a run keeps in memory: checkpointing per layer, the MLP tile."""

    checkpointing: bool = False
    checkpointed_layers: int | None = None  # the first decoder layers checkpointed; None: all of them
    checkpointing_reason: str = ""
    tile: int | None = None  # tiled_mlp's tile in tokens (train/model/patches/tiled_mlp.py); None: untiled

    def describe(self) -> str:
        return f"activation checkpointing {self.checkpointing_reason}"


def model_shape(cfg: TrainConfig, model_config, media_kinds=()) -> ModelShape:
    """The model's shape for the estimates, with the towers of the data's media kinds (their activations count:
    a trained tower's blocks, a frozen one's output)."""
    return replace(ModelShape.from_hf_config(model_config), towers=media_towers(
        model_config, media_kinds, not cfg.model.freeze_vision_tower, not cfg.model.freeze_audio_tower))


def plan_memory(cfg: TrainConfig, model_config, world: int, sp_size: int, row_length: int, offloads_optimizer: bool,
                device: torch.device | None = None, media_kinds=()) -> MemoryPlan:
    """The plan of a run of `world` processes, `sp_size` of them sharing a row, on `device` (default: this rank's)
    over rows of `row_length` tokens; `offloads_optimizer`: the engine keeps the optimizer state on the host
    (DeepSpeed's offload, FSDP2's cpu_offload); `media_kinds`: the image / video / audio kinds the data holds (their
    towers' activations counted). Raises ConfigError when no plan fits."""
    device = device or default_device()
    # derived once, when a decision needs it (on CPU none does)
    shape = functools.cache(lambda: model_shape(cfg, model_config, media_kinds))
    checkpointing, layers, why = _choose_checkpointing(cfg, shape, row_length, sp_size, world, device,
                                                       offloads_optimizer)
    _check_offload_host_memory(cfg, shape, row_length, sp_size, device)
    tile = mlp_tile(cfg.model, intermediate_size(model_config))  # the width a tile holds (MoE: the routed experts')
    return MemoryPlan(checkpointing, layers, why, tile)


def _choose_checkpointing(cfg: TrainConfig, shape, row_length: int, sp_size: int, world: int,
                          device: torch.device, offloads_optimizer: bool) -> tuple[bool, int | None, str]:
    """gradient_checkpointing auto: on a GPU from the memory estimate of train/plan/memory.py (the fewest
    decoder layers to checkpoint for a micro-batch's activations to fit the free memory less the model state);
    on CPU by row length. (enabled, layers checkpointed: None for all, why)."""
    per_rank_row = -(-row_length // sp_size)
    if cfg.model.activation_offload and cfg.model.gradient_checkpointing == "auto":
        return True, None, "on (auto: activation_offload keeps the checkpointed layer inputs on the host)"
    if cfg.model.gradient_checkpointing != "auto" or device.type != "cuda":
        enabled = cfg.model.checkpointing_enabled(per_rank_row)
        why = "set" if cfg.model.gradient_checkpointing != "auto" else (
            f"auto: {per_rank_row} tokens per rank {'>=' if enabled else '<'} checkpointing_min_length="
            f"{cfg.model.checkpointing_min_length}")
        return enabled, None, f"{'on' if enabled else 'off'} ({why})"
    tokens = -(-row_length * cfg.steps.micro_batch_rows // sp_size)
    free, _ = torch.cuda.mem_get_info(device)
    act_bytes = 2 if cfg.model.bf16 else 4
    state = (_model_state_bytes(cfg, shape(), world, offloads_optimizer)
             + all_to_all_bytes(shape(), tokens, act_bytes, cfg.parallel.expert_parallel_size))
    decision = choose_checkpointing(shape(), tokens, free, state, act_bytes=act_bytes,
                                    loss_chunk=cfg.steps.loss_chunk_size,
                                    tile=mlp_tile(cfg.model, shape().intermediate))
    return decision.enabled, decision.layers, decision.describe()


def _model_state_bytes(cfg: TrainConfig, shape: ModelShape, world: int, offloads_optimizer: bool) -> int:
    """Weights, gradients and optimizer state per GPU (train/plan/memory.py's estimate)."""
    n_trainable = shape.n_params if cfg.lora.lora_rank == 0 else 0  # LoRA adapters: negligible next to the model
    # expert parallelism: each rank's expert_params / N (train/plan/memory.py); dense: 0 experts, the same count
    experts = dict(expert_params=shape.expert_params, expert_parallel_size=cfg.parallel.expert_parallel_size)
    if cfg.uses_fsdp2:  # fp32 weights, gradients and moments sharded over every rank, as ZeRO-3 in fp32
        return model_state_bytes(shape.n_params, n_trainable, 3, world, offload_optimizer=offloads_optimizer,
                                 bf16=False, **experts)
    return model_state_bytes(shape.n_params, n_trainable, cfg.deepspeed.stage, world,
                             offload_optimizer=offloads_optimizer, bf16=cfg.model.bf16, **experts)


def choose_sp_degree_for(cfg: TrainConfig, model_config, world: int, row_length: int,
                         offloads_optimizer: bool, media_kinds=()) -> tuple[int, str]:
    """`sequence_parallel_size: auto`: the smallest degree whose share of a micro-batch of `row_length`-token rows
    fits the GPU with the configured long-row options (train/plan/memory.py), from the least free memory of all
    ranks; 1 on CPU. (degree, why)."""
    if not torch.cuda.is_available():
        return 1, "auto: no CUDA device to size the rows against"
    shape = model_shape(cfg, model_config, media_kinds)
    free = torch.cuda.mem_get_info(default_device())[0]
    host = available_host_bytes()
    if dist.is_initialized():  # every rank must choose the same degree: the least memory of all
        least = torch.tensor([free, -1 if host is None else host], dtype=torch.int64, device=default_device())
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        free, host = int(least[0]), (None if int(least[1]) < 0 else int(least[1]))
    options = LongRowOptions(checkpointing=cfg.model.gradient_checkpointing is not False,
                             tile=mlp_tile(cfg.model, shape.intermediate), offload=cfg.model.activation_offload)
    tokens = row_length * cfg.steps.micro_batch_rows
    # the all-to-all buffers of a whole micro-batch (sp 1): an upper bound over the degrees tried
    state = (_model_state_bytes(cfg, shape, world, offloads_optimizer)
             + all_to_all_bytes(shape, tokens, 2 if cfg.model.bf16 else 4, cfg.parallel.expert_parallel_size))
    try:
        choice = choose_sp_degree(shape, tokens, world, free, state, options,
                                  act_bytes=2 if cfg.model.bf16 else 4, loss_chunk=cfg.steps.loss_chunk_size,
                                  host_bytes=host, host_ranks=ranks_per_machine(cfg.launch.processes_per_machine))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return choice.degree, choice.describe()


def _check_offload_host_memory(cfg: TrainConfig, shape, row_length: int, sp_size: int,
                               device: torch.device) -> None:
    """activation_offload on a GPU: a micro-batch's pinned layer inputs must fit the host memory available to
    this rank (the machine's, shared by its ranks), checked before any weight loads; past it the kernel's OOM
    killer would end the run in the middle of a forward."""
    if not cfg.model.activation_offload or device.type != "cuda":
        return  # on a CPU device the offload keeps the tensors where they are
    tokens = -(-row_length * cfg.steps.micro_batch_rows // sp_size)
    problem = host_offload_problem(shape(), tokens, 2 if cfg.model.bf16 else 4, available_host_bytes(),
                                   ranks_per_machine(cfg.launch.processes_per_machine))
    if problem:
        raise ConfigError(f"{problem}; set a larger sequence_parallel_size (or auto), shorter rows (max_length) "
                          "or activation_offload: false")
