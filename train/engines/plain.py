"""The plain engine (deepspeed.stage null): torch AdamW on a full copy per rank, gradients summed with all_reduce;
its checkpoint is `model.pt` + the optimizer's state (train/checkpoint.py's safe files)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from train.checkpoint import CheckpointError, safe_load
from train.distributed import Mesh, all_reduce_sum_bucketed
from train.engines.engine import _TorchOptimizerEngine


class PlainEngine(_TorchOptimizerEngine):
    name = "plain"

    def __init__(self, cfg, model, param_groups, lr_factor, mesh: Mesh, ds_config: dict | None):
        model.to(mesh.device)
        super().__init__(cfg, model, param_groups, lr_factor)
        self.lora, self.autocasts = cfg.lora.lora_rank > 0, cfg.model.bf16
        if dist.is_initialized():  # every rank starts from rank 0's weights
            for p in model.parameters():
                dist.broadcast(p.data, src=0)

    def describe(self) -> str:
        return "no DeepSpeed (plain torch AdamW)"

    def _reduce(self, params):
        if dist.is_initialized():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_sum_bucketed([p.grad for p in params])

    def save(self, directory, is_main):
        if is_main:
            torch.save(self.module.state_dict(), directory / "model.pt")
            torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def load(self, path, resharded_from=None):  # optimizer.pt is whole: it loads as saved on any number of ranks
        self.check_saved_with(path)
        try:
            self.module.load_state_dict(safe_load(path / "model.pt"))
        except RuntimeError as exc:  # a checkpoint older than the model record of trainer_state.json
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise CheckpointError(
                f"resume from {path}: its weights do not fit this model (model_config / model_path / lora_rank "
                f"differ from the run that saved it): {lines[1] if len(lines) > 1 else lines[0]} ... Resume with "
                "that run's model settings, or start a new run (another output_dir)") from exc
        self.optimizer.load_state_dict(safe_load(path / "optimizer.pt"))  # moves the state to the params' device
        self.scheduler.load_state_dict(safe_load(path / "scheduler.pt"))

    def export_state(self, is_main):
        if self.lora:
            return None  # save_lora reads the live (full) parameters
        return self.module.state_dict() if is_main else None
