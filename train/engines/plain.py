"""The plain engine (deepspeed.stage null): torch AdamW on a full copy per rank, gradients summed with all_reduce;
its checkpoint is `model.pt` + the optimizer's state (train/checkpoint.py's safe files)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from train.checkpoint import CheckpointError, safe_load
from train.distributed import Mesh, all_reduce_sum_bucketed
from train.nonfinite import gradient_norm
from train.engines.engine import _TorchOptimizerEngine


class PlainEngine(_TorchOptimizerEngine):
    """With expert parallelism (train/model/experts.py) each rank holds its part of the experts: an expert gradient
    is summed over the edp group (the ranks holding the same part), the norm counts every part once, checkpoints hold
    one file per part, and the export gathers the parts."""

    name = "plain"
    saves_expert_parts = True

    def __init__(self, cfg, model, param_groups, lr_factor, mesh: Mesh, ds_config: dict | None):
        from train.model.experts import is_expert_parameter

        model.to(mesh.device)
        super().__init__(cfg, model, param_groups, lr_factor)
        self.lora, self.autocasts = cfg.lora.lora_rank > 0, cfg.model.bf16
        self.mesh, self.ep = mesh, mesh.ep_size > 1
        self.expert_ids = {id(p) for p in model.parameters() if is_expert_parameter(p)}
        if dist.is_initialized():  # every rank starts from rank 0's weights (an expert part: its edp group's first)
            edp_first = dist.get_process_group_ranks(mesh.edp_group)[0] if self.ep else 0
            for p in model.parameters():
                if id(p) in self.expert_ids:
                    dist.broadcast(p.data, src=edp_first, group=mesh.edp_group)
                else:
                    dist.broadcast(p.data, src=0)

    def describe(self) -> str:
        return "no DeepSpeed (plain torch AdamW)"

    def _reduce(self, params):
        if dist.is_initialized():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_sum_bucketed([p.grad for p in params if id(p) not in self.expert_ids])
            if self.expert_ids:
                all_reduce_sum_bucketed([p.grad for p in params if id(p) in self.expert_ids],
                                        group=self.mesh.edp_group)

    def _clip(self, params, max_norm):
        if not self.ep:
            return super()._clip(params, max_norm)
        # replicated gradients once, every part of the experts once (summed over the ep group)
        squares = [gradient_norm([p.grad for p in params if p.grad is not None and (id(p) in self.expert_ids) == part])
                   ** 2 for part in (False, True)]
        experts = torch.tensor(squares[1], dtype=torch.float64)
        dist.all_reduce(experts, group=self.mesh.ep_group)
        norm = math.sqrt(squares[0] + float(experts))
        if math.isfinite(norm) and math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm))
        return norm

    def _part_files(self) -> tuple[str, str] | None:
        """Under expert parallelism, on the first rank of its edp group other than part 0: its part's files."""
        if not self.ep or self.mesh.ep_rank == 0:
            return None
        if dist.get_rank() != dist.get_process_group_ranks(self.mesh.edp_group)[0]:
            return None
        return f"model.ep{self.mesh.ep_rank}.pt", f"optimizer.ep{self.mesh.ep_rank}.pt"

    def save(self, directory, is_main):
        if is_main:
            torch.save(self.module.state_dict(), directory / "model.pt")
            torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
        elif part := self._part_files():  # the experts' part ep_rank: its weights and optimizer state
            torch.save(self.module.state_dict(), directory / part[0])
            torch.save(self.optimizer.state_dict(), directory / part[1])

    def load(self, path, resharded_from=None, experts_from=None):
        """optimizer.pt is whole: it loads as saved on any number of ranks. `experts_from`: (the expert_parallel_size
        that saved the checkpoint, its expert parameters' names) when this run has another degree: the saved parts
        are put together and this rank's part cut from them (weights and Adam moments)."""
        self.check_saved_with(path)
        model_file, optimizer_file = "model.pt", "optimizer.pt"
        if self.ep and self.mesh.ep_rank > 0:  # every rank holding part ep_rank reads its part's files
            model_file, optimizer_file = f"model.ep{self.mesh.ep_rank}.pt", f"optimizer.ep{self.mesh.ep_rank}.pt"
        if experts_from is not None:
            model_state, optimizer_state = self._cut_parts(path, *experts_from)
        else:
            model_state, optimizer_state = safe_load(path / model_file), safe_load(path / optimizer_file)
        try:
            self.module.load_state_dict(model_state)
        except RuntimeError as exc:  # a checkpoint older than the model record of trainer_state.json
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise CheckpointError(
                f"resume from {path}: its weights do not fit this model (model_config / model_path / lora_rank "
                f"differ from the run that saved it): {lines[1] if len(lines) > 1 else lines[0]} ... Resume with "
                "that run's model settings, or start a new run (another output_dir)") from exc
        self.optimizer.load_state_dict(optimizer_state)  # moves the state to the params' device
        self.scheduler.load_state_dict(safe_load(path / "scheduler.pt"))

    def _cut_parts(self, path: Path, saved_ep: int, names: list[str]) -> tuple[dict, dict]:
        """The model and optimizer state of this rank's part of the experts, from the `saved_ep` parts of `path`."""
        files = [("model.pt", "optimizer.pt")] + [(f"model.ep{r}.pt", f"optimizer.ep{r}.pt") for r in range(1, saved_ep)]
        models = [safe_load(path / model_file) for model_file, _ in files]
        optimizers = [safe_load(path / optimizer_file) for _, optimizer_file in files]
        size, rank = self.mesh.ep_size, self.mesh.ep_rank

        def part(tensors: list[torch.Tensor]) -> torch.Tensor:
            whole = torch.cat(tensors)
            local = whole.shape[0] // size
            return whole[rank * local:(rank + 1) * local].clone()

        model, optimizer = models[0], optimizers[0]
        for name in names:
            model[name] = part([m[name] for m in models])
        named = {id(p): name for name, p in self.module.named_parameters()}
        order = [named[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        for index, name in enumerate(order):  # the optimizer state is keyed by position in the parameter groups
            if name in names and index in optimizer["state"]:
                state = dict(optimizer["state"][index])
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:  # exp_avg, exp_avg_sq (not the step count)
                        state[key] = part([o["state"][index][key] for o in optimizers])
                optimizer["state"][index] = state
        return model, optimizer

    def expert_parameter_names(self) -> list[str]:
        """The names of this rank's expert parameters (what a resume on another degree cuts anew)."""
        return sorted(name for name, p in self.module.named_parameters() if id(p) in self.expert_ids)

    def export_state(self, is_main):
        if self.lora and not self.ep:
            return None  # save_lora reads the live (full) parameters; under EP the experts' parts are gathered
        state = self.module.state_dict() if is_main else None
        if self.ep:  # collective: every expert, the parts of the main rank's ep group put together
            from train.model.experts import gather_expert_state

            state = gather_expert_state(self.module, state, self.mesh.ep_group, is_main)
        return state
