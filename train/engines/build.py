"""The engine of a run, chosen once from the config: `EngineSetup` (what it decides before the model exists) and
`EngineSetup.build` / `build_engine` (`ENGINES`: plain, DeepSpeed, FSDP2, one module each), which the trainer
drives without asking which it is. Under expert parallelism (train/model/experts.py; plain and FSDP2) an expert's
gradient is summed over the ranks holding the same experts (the mesh's edp group; FSDP2: each experts module a unit
sharded over it), each part of the experts is saved apart, and the export gathers the parts."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from train.distributed import Mesh
from train.engines.deepspeed_engine import DeepSpeedEngine
from train.engines.engine import Engine
from train.engines.fsdp2 import FSDP2Engine
from train.engines.plain import PlainEngine


ENGINES: dict[str, type[Engine]] = {"plain": PlainEngine, "deepspeed": DeepSpeedEngine, "fsdp2": FSDP2Engine}


def engine_name(cfg) -> str:
    """The engine of a TrainConfig (config validation refuses fsdp2 with a DeepSpeed stage)."""
    return "fsdp2" if cfg.uses_fsdp2 else "deepspeed" if cfg.uses_deepspeed else "plain"


def build_engine(cfg, model, param_groups, lr_factor, mesh: Mesh, ds_config: dict | None) -> Engine:
    return ENGINES[engine_name(cfg)](cfg, model, param_groups, lr_factor, mesh, ds_config)


# ---------------------------------------------------------------------------------------------- before the model
class EngineSetup:
    """What the engine of a config decides before the model exists, decided once at start (after
    `start_process_group`): DeepSpeed's config dict (built once: the
    memory plan reads its offload, the engine initializes from it), ZeRO-3's partitioned loading, the dtype the
    weights are built in, whether a forward outside the engine autocasts to bf16 and whether the optimizer state
    lives on the host. The trainer reads these facts and never asks which engine it runs."""

    def __init__(self, cfg):
        self.name = engine_name(cfg)
        self.zero3 = cfg.deepspeed.stage == 3
        self.ds_config = self._hf_ds_config = None
        if self.name == "deepspeed":
            from train.engines.deepspeed_config import build_deepspeed_config, skip_unused_cpu_comm_op

            skip_unused_cpu_comm_op()  # before DeepSpeed's communication backend starts (zero.Init or initialize)
            self.ds_config = build_deepspeed_config(cfg)
        # DeepSpeed runs bf16 weights itself; the others keep fp32 weights and autocast their forwards
        self.dtype = torch.bfloat16 if (cfg.model.bf16 and self.name == "deepspeed") else torch.float32
        self.autocast_bf16 = cfg.model.bf16 and self.name != "deepspeed"
        # ZeRO-3 with from_pretrained loads the weights partitioned: no full copy to compare an unpacked forward with
        self.partitioned_load = self.zero3 and cfg.model.model_path is not None
        if self.name == "fsdp2":
            self.offloads_optimizer = bool(cfg.fsdp2.cpu_offload)
        elif self.name == "deepspeed":
            from train.engines.deepspeed_config import offloads_optimizer

            self.offloads_optimizer = offloads_optimizer(self.ds_config)
        else:
            self.offloads_optimizer = False

    def before_weights_load(self) -> None:
        """Right before the model's weights load: under ZeRO-3 with a checkpoint, from_pretrained then loads straight
        into partitions (zero.Init) instead of a full copy per rank. Not earlier: every model transformers builds
        while it is registered (the start-up's meta-device models, e.g. the SP layout's) would be built by zero.Init."""
        if self.partitioned_load and self._hf_ds_config is None:
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)

    def build(self, cfg, model, param_groups, lr_factor, mesh: Mesh) -> Engine:
        return ENGINES[self.name](cfg, model, param_groups, lr_factor, mesh, self.ds_config)


def start_process_group(cfg) -> None:
    """DeepSpeed and FSDP2 need a process group, also for one process (no launcher environment): then a world of one
    is started here."""
    if engine_name(cfg) != "plain" and not dist.is_initialized():
        _init_single_process_group()


def _init_single_process_group() -> None:
    """A world of one (no launcher environment). Its rendezvous is an in-process store: a free port found by binding
    and releasing it could be taken by another process before the group's store binds it again (EADDRINUSE, seen
    under load)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(),
                            world_size=1, rank=0)
