"""The FSDP2 engine (distributed_backend: fsdp2): torch's `fully_shard` over all ranks, its reduce-scatter summing;
its checkpoints are torch Distributed Checkpoint directories (train/engines/dcp.py) that load on another number
of ranks and, under expert parallelism, another expert_parallel_size (each expert parameter saved as the whole tensor
of every expert, each rank writing and reading its own part of it)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.checkpoint import safe_load
from train.distributed import Mesh
from train.engines.engine import _TorchOptimizerEngine
from train.nonfinite import gradient_norm


class FSDP2Engine(_TorchOptimizerEngine):
    name = "fsdp2"

    def __init__(self, cfg, model, param_groups, lr_factor, mesh: Mesh, ds_config: dict | None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from train.model.patches.tiled_mlp import decoder_layers

        from train.model.experts import is_expert_parameter

        device, cpu_offload, bf16 = mesh.device, cfg.fsdp2.cpu_offload, cfg.model.bf16  # offload: GPUs (preflight)
        self.device = device  # the collectives' (host-offloaded gradients included)
        model.to(device)
        self.mesh, self.ep = mesh, mesh.ep_size > 1
        # expert parallelism (train/model/experts.py): each experts module is sharded over its edp group (the ranks
        # holding the same experts), every other weight over all ranks
        self.expert_names = {name for name, p in model.named_parameters() if is_expert_parameter(p)}
        expert_units = [m for m in model.modules()
                        if any(is_expert_parameter(p) for p in m.parameters(recurse=False))]
        if dist.get_world_size() > 1:  # every rank shards rank 0's weights (an expert part: its edp group's first)
            edp_first = dist.get_process_group_ranks(mesh.edp_group)[0] if self.ep else 0
            for name, p in model.named_parameters():
                if name in self.expert_names:
                    dist.broadcast(p.data, src=edp_first, group=mesh.edp_group)
                else:
                    dist.broadcast(p.data, src=0)
        self.world = init_device_mesh(device.type, (mesh.world_size,), mesh_dim_names=("fsdp",))
        options = dict(
            mesh=self.world, reshard_after_forward=cfg.fsdp2.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
            else MixedPrecisionPolicy(),
            offload_policy=CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy(),
        )
        if expert_units:
            from torch.distributed.device_mesh import DeviceMesh

            edp_mesh = DeviceMesh.from_group(mesh.edp_group, device.type, mesh_dim_names=("edp",))
            for unit in expert_units:
                fully_shard(unit, **{**options, "mesh": edp_mesh})
        units = [*expert_units, *decoder_layers(model.lm), model]
        for unit in units[len(expert_units):]:
            fully_shard(unit, **options)
        for unit in units:  # reduce-scatter sums (exactly, with SUM collectives on every backend): see the docstring
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        # a parameter without a gradient on some rank (an MoE expert no token of this rank chose) reduces as zeros
        # there, so every rank's reduce-scatter has the same inputs (else they would not match, and hang)
        for unit in (model, *expert_units):
            unit.set_reduce_scatter_unused_params(True)
        super().__init__(cfg, model, param_groups, lr_factor)  # the optimizer over the sharded parameters
        self.cpu_offload = cpu_offload
        self.n_units, self.size = len(units), mesh.world_size
        self._experts_2d = None  # _expert_mesh, built at the first save or load

    def describe(self) -> str:
        return (f"FSDP2 ({self.n_units} units sharded over {self.size} ranks"
                + (", the experts over their edp group" if self.ep else "")
                + (", offloaded to host memory" if self.cpu_offload else "") + ")")

    def backward(self, loss, last):
        self.module.set_is_last_backward(last)
        loss.backward()

    def _clip(self, params, max_norm):
        # the sharded gradients (DTensors, every parameter sharded: no element on two ranks): each rank's squares
        # summed in float64 as the plain engine does, then over the ranks
        local = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None]
        square = torch.tensor(gradient_norm(local) ** 2, dtype=torch.float64, device=self.device)
        dist.all_reduce(square)
        norm = math.sqrt(float(square))  # expert parts: disjoint shards too (each part over its own edp group)
        if math.isfinite(norm) and math.isfinite(max_norm):
            for same_mesh in self._by_mesh(params):
                torch.nn.utils.clip_grads_with_norm_(same_mesh, max_norm, torch.tensor(norm))
        return norm

    def _by_mesh(self, params) -> list[list[torch.Tensor]]:
        """The parameters of the experts (sharded over the edp group) apart from the others (over all ranks)."""
        if not self.ep:
            return [params]
        experts = {id(p) for name, p in self.module.named_parameters() if name in self.expert_names}
        return [[p for p in params if (id(p) in experts) == part] for part in (False, True)]

    def _expert_mesh(self):
        """The 2-D mesh (ep, edp) of the expert parameters: row e the edp group holding part e, column j an ep group
        (train/distributed.py's layout), so Shard(0) on both dimensions is where each rank's shard of an expert
        parameter lies in the whole one [E, ...]: part ep_rank, then its edp shard (FSDP2's chunking of the part)."""
        if self._experts_2d is None:
            from torch.distributed.device_mesh import DeviceMesh

            from train.distributed import expert_group_ranks

            _, edp_groups = expert_group_ranks(self.mesh.world_size, self.mesh.sp_size, self.mesh.ep_size)
            self._experts_2d = DeviceMesh.from_group([self.mesh.ep_group, self.mesh.edp_group], self.device.type,
                                                     mesh=edp_groups, mesh_dim_names=("ep", "edp"))
        return self._experts_2d

    def _whole(self, t: DTensor) -> DTensor:
        """This rank's shard of an expert parameter's part (or its Adam moment) as a shard of the whole tensor, every
        expert: the checkpoint key and shape are then those of a run without expert parallelism."""
        from torch.distributed.tensor import Shard

        shape = torch.Size((t.shape[0] * self.mesh.ep_size, *t.shape[1:]))
        return DTensor.from_local(t.to_local().detach(), self._expert_mesh(), [Shard(0), Shard(0)], run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())

    def _states(self) -> dict:
        """What the checkpoint holds: the model's and the optimizer's sharded state dicts (DTensors), every expert
        parameter under its own name with the shape of the whole tensor (all experts), whatever the degree that saved
        it, so DCP reads each rank's experts on any expert_parallel_size and number of processes."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer)
        if self.ep:
            model = {k: self._whole(v) if k in self.expert_names else v for k, v in model.items()}
            optimizer = {**optimizer, "state": {
                k: ({key: self._whole(v) if isinstance(v, DTensor) else v for key, v in moments.items()}
                    if k in self.expert_names else moments) for k, moments in optimizer["state"].items()}}
        return {"model": model, "optimizer": optimizer}

    def _local_again(self, states: dict, like: dict) -> dict:
        """The loaded state dicts with each expert tensor back on its edp mesh (`like`: get_state_dict's), as
        set_state_dict expects this run's parameters."""
        def back(loaded, original):
            if isinstance(original, DTensor) and loaded is not original:
                local = loaded.to_local() if isinstance(loaded, DTensor) else loaded
                return DTensor.from_local(local, original.device_mesh, original.placements, run_check=False,
                                          shape=original.shape, stride=original.stride())
            return loaded

        model = {k: back(states["model"][k], v) for k, v in like["model"].items()}
        optimizer = {**states["optimizer"], "state": {
            k: {key: back(states["optimizer"]["state"][k][key], v) for key, v in moments.items()}
            for k, moments in like["optimizer"]["state"].items()}}
        return {"model": model, "optimizer": optimizer}

    def save(self, directory, is_main):
        from train.engines import dcp as dcp_checkpoint

        dcp_checkpoint.save(self._states(), directory / "dcp")
        if is_main:
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def load(self, path, resharded_from=None, experts_from=None):
        """DCP reads each rank's shards from whichever files hold them: a checkpoint of another number of processes
        or another expert_parallel_size (its experts saved whole, `_states`) loads alike."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from train.engines import dcp as dcp_checkpoint

        self.check_saved_with(path)
        like = get_state_dict(self.module, self.optimizer) if self.ep else None
        states = self._states()
        dcp_checkpoint.load(states, path / "dcp", manifest_dir=path)  # only files its manifest lists
        if like is not None:
            states = self._local_again(states, {"model": like[0], "optimizer": like[1]})
        set_state_dict(self.module, self.optimizer, model_state_dict=states["model"],
                       optim_state_dict=states["optimizer"])
        self.scheduler.load_state_dict(safe_load(path / "scheduler.pt"))

    def export_state(self, is_main):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # collective: the full tensors, on the main rank's host only
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.ep:  # every expert: each part gathered over its edp group, the parts over the ep group
            for name, p in self.module.named_parameters():
                if name in self.expert_names:
                    part = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                    parts = [torch.empty_like(part) for _ in range(self.mesh.ep_size)]
                    dist.all_gather(parts, part.contiguous(), group=self.mesh.ep_group)
                    if is_main:
                        state[name] = torch.cat(parts).cpu()
        if not is_main:
            return None
        first: dict[int, str] = {}  # a tied weight (embeddings and head) as one tensor, as module.state_dict() has it,
        for name, p in self.module.named_parameters(remove_duplicate=False):  # so the export writes it once
            if (owner := first.setdefault(id(p), name)) != name and name in state:
                state[name] = state[owner]
        return state
