"""How a step's gradients are reduced and applied, and how the model and optimizer state are saved, resumed and
exported: one engine, chosen once from the config by `build_engine` (`ENGINES`), which the trainer drives without
asking which it is.

Every engine applies the SUM of the local gradients (train/steps/batch.py: each token already carries the weight of the
whole step, so the step loss is the sum of the local weighted sums over micro-batches, dp and sp ranks):
- `PlainEngine` (deepspeed.stage null): torch AdamW on a full copy per rank, gradients summed with all_reduce.
- `DeepSpeedEngine` (deepspeed.stage 0-3): DeepSpeed averages over its data-parallel world (every dp x sp rank, no
  mpu is given) and would divide by the accumulation steps: the backward loss is the local sum times the world size
  with `scale_wrt_gas=False`, and `engine.step()` runs after every micro-batch (DeepSpeed counts them and updates at
  its accumulation boundary, the last one taken in `step` once the loss is known to be finite).
- `FSDP2Engine` (distributed_backend: fsdp2): torch's `fully_shard` on every decoder layer and on the whole model
  over all ranks (dp x sp: the sp ranks of a row hold parts of the same gradient, so they shard and sum like dp
  ranks); its reduce-scatter sums (divide factor 1, plain SUM collectives) instead of averaging. Checkpoints are
  torch Distributed Checkpoint directories (train/engines/dcp.py) that load on another number of ranks.
Under expert parallelism (train/model/experts.py; plain and FSDP2) an expert's gradient is summed over the ranks
holding the same experts (the mesh's edp group; FSDP2: each experts module a unit sharded over it), each part of the
experts is saved apart, and the export gathers the parts.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.checkpoint import (CheckpointError, install_zero_state, load_deepspeed_files_safely, read_zero_state,
                              safe_load)
from train.distributed import Mesh, all_reduce_sum_bucketed
from train.nonfinite import gradient_norm, nonfinite_problem

# how each engine's checkpoint is recognised (a file or directory only it writes) and named in errors
SAVED_AS = {"deepspeed": ("ds", "DeepSpeed (deepspeed.stage set)"),
            "fsdp2": ("dcp", "FSDP2 (distributed_backend: fsdp2)"),
            "plain": ("model.pt", "plain torch (deepspeed.stage null, distributed_backend: deepspeed)")}


def saved_with(path: Path) -> str | None:
    """The engine that wrote checkpoint `path` (None: none PackSFT knows)."""
    return next((name for name, (marker, _) in SAVED_AS.items() if (path / marker).exists()), None)


class Engine:
    """What the trainer asks of every engine, built as `Engine(cfg, model, param_groups, lr_factor, mesh,
    ds_config)`: `model` is the PackedCausalLM, `param_groups()` the optimizer's parameter groups (called once the
    engine has placed or sharded the parameters). `module`: what the forward calls; `backward_scale`: the factor of
    the local loss given to `backward`; `autocasts`: whether the trainer wraps the forward in bf16 autocast."""

    name: str
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    backward_scale = 1.0
    autocasts = False

    def describe(self) -> str:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate the gradient of one micro-batch's `loss` (`last`: the step's last micro-batch)."""
        raise NotImplementedError

    def step(self, loss: float, skip_nonfinite: bool, grad_hook: Callable[[], None] | None) -> tuple[float, str | None]:
        """Apply the step's update unless its `loss` (all-reduced) or gradient norm is not finite: returns
        (gradient norm, problem). A problem without `skip_nonfinite` leaves the model untouched (the trainer stops);
        with it, the gradients are dropped and the lr schedule still advances."""
        raise NotImplementedError

    def save(self, directory: Path, is_main: bool) -> None:
        raise NotImplementedError

    def load(self, path: Path, resharded_from: int | None = None, experts_from=None) -> None:
        """Restore model, optimizer and scheduler from the checkpoint `path`; `resharded_from`: the number of
        processes that saved it when this run has another (the global batch is the same, train/checkpoint.py);
        `experts_from`: (expert_parallel_size, expert parameter names) of the run that saved it when this run has
        another degree (the plain engine only)."""
        raise NotImplementedError

    def export_state(self, is_main: bool) -> dict | None:
        """Collective. The full state dict to export on the main rank (None elsewhere), or None everywhere when
        the export reads the live parameters (LoRA on full copies)."""
        raise NotImplementedError

    def check_saved_with(self, path: Path) -> None:
        saved = saved_with(path)
        if saved != self.name:
            was = SAVED_AS[saved][1] if saved else "no engine PackSFT knows"
            raise CheckpointError(f"{path} was saved with {was}, this run uses {SAVED_AS[self.name][1]}: resume with "
                                  "the settings that saved it")


def _adam(cfg) -> dict:
    optim = cfg.optim
    return dict(lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)


class _TorchOptimizerEngine(Engine):
    """The engines whose update is a torch optimizer step taken here (plain, FSDP2)."""

    def __init__(self, cfg, model, param_groups, lr_factor):
        self.module = model
        self.max_grad_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
        self.optimizer = torch.optim.AdamW(param_groups(), **_adam(cfg))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)

    def _reduce(self, params: list[torch.Tensor]) -> None:
        """Make every parameter's .grad the step's summed gradient (FSDP2's reduce-scatter already did)."""

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> float:
        norm = gradient_norm(p.grad for p in params if p.grad is not None)  # float64 sums: the same on every rank
        if math.isfinite(norm) and math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm))
        return norm

    def step(self, loss, skip_nonfinite, grad_hook):
        params = [p for p in self.module.parameters() if p.requires_grad]
        self._reduce(params)
        if grad_hook is not None:
            grad_hook()
        norm = self._clip(params, self.max_grad_norm)
        problem = nonfinite_problem(loss, norm)
        if problem and not skip_nonfinite:
            return norm, problem
        if not problem:
            self.optimizer.step()
        self.scheduler.step()  # a skipped step still counts: the lr stays a function of the step
        self.optimizer.zero_grad(set_to_none=True)
        return norm, problem

    def backward(self, loss, last):
        loss.backward()


class PlainEngine(_TorchOptimizerEngine):
    """With expert parallelism (train/model/experts.py) each rank holds its part of the experts: an expert gradient
    is summed over the edp group (the ranks holding the same part), the norm counts every part once, checkpoints hold
    one file per part, and the export gathers the parts."""

    name = "plain"

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
        if self.lora:
            return None  # save_lora reads the live (full) parameters
        state = self.module.state_dict() if is_main else None
        if self.ep:  # collective: every expert, the parts of the main rank's ep group put together
            from train.model.experts import gather_expert_state

            state = gather_expert_state(self.module, state, self.mesh.ep_group, is_main)
        return state


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, cfg, model, param_groups, lr_factor, mesh: Mesh, ds_config: dict | None):
        import deepspeed

        from train.engines.deepspeed_config import offloads_optimizer

        offload = offloads_optimizer(ds_config)  # the YAML flag or the template
        optimizer = None if offload else torch.optim.AdamW(param_groups(), **_adam(cfg))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=param_groups() if optimizer is None else None,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor),
            config=ds_config,
            dist_init_required=False,
        )
        self.module, self.model = self.engine, model
        self.stage = cfg.deepspeed.stage
        self.backward_scale = float(mesh.world_size)
        self.lora = cfg.lora.lora_rank > 0

    def describe(self) -> str:
        return f"deepspeed stage {self.stage}"

    def backward(self, loss, last):
        self.engine.backward(loss, scale_wrt_gas=False)
        if not last:
            self.engine.step()  # DeepSpeed counts micro-batches here; the boundary's step() is taken in step()

    def step(self, loss, skip_nonfinite, grad_hook):
        problem = nonfinite_problem(loss)
        if problem is not None:
            return float("nan"), problem
        self.engine.step()
        if not self.engine.was_step_applied():  # ZeRO 1-3 skip an update whose gradients hold inf / nan
            problem = "the gradients hold inf or nan (DeepSpeed skipped the update)"
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, problem or nonfinite_problem(loss, norm)

    def save(self, directory, is_main):
        self.engine.save_checkpoint(str(directory), tag="ds", save_latest=False)

    def load(self, path, resharded_from=None, experts_from=None):
        self.check_saved_with(path)
        if resharded_from is None:
            load_deepspeed_files_safely(self.engine)  # no code runs from ds/*.pt
            self.engine.load_checkpoint(str(path), tag="ds", load_optimizer_states=True,
                                        load_lr_scheduler_states=True)
            return
        # DeepSpeed loads ZeRO partitions of the same world size only: join them, cut them anew
        if self.stage == 0:
            raise CheckpointError(f"resume from {path}: saved by {resharded_from} processes, this run has "
                                  f"{dist.get_world_size()}: deepspeed.stage 0 resumes on the same number of "
                                  "processes only (ZeRO 1-3, FSDP2 and no DeepSpeed reshard)")
        install_zero_state(self.engine, read_zero_state(path / "ds"))

    def export_state(self, is_main):
        if self.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()  # collective; full dict on rank 0 only
        if self.lora:
            return None
        return self.model.state_dict() if is_main else None


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

    def _part_key(self, key: str) -> str:
        """A checkpoint key of an expert parameter names its part: the parts are different tensors of one name."""
        return f"{key}@ep{self.mesh.ep_rank}"

    def _states(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer)
        if self.ep:
            model = {self._part_key(k) if k in self.expert_names else k: v for k, v in model.items()}
            optimizer = {**optimizer, "state": {self._part_key(k) if k in self.expert_names else k: v
                                                for k, v in optimizer["state"].items()}}
        return {"model": model, "optimizer": optimizer}

    def _unpart(self, states: dict) -> dict:
        if not self.ep:
            return states
        names = {self._part_key(k): k for k in self.expert_names}
        return {"model": {names.get(k, k): v for k, v in states["model"].items()},
                "optimizer": {**states["optimizer"], "state": {names.get(k, k): v for k, v in
                                                               states["optimizer"]["state"].items()}}}

    def save(self, directory, is_main):
        from train.engines import dcp as dcp_checkpoint

        dcp_checkpoint.save(self._states(), directory / "dcp")
        if is_main:
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def load(self, path, resharded_from=None, experts_from=None):  # DCP reads each rank's shards from whichever files hold them
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from train.engines import dcp as dcp_checkpoint

        self.check_saved_with(path)
        states = self._states()
        dcp_checkpoint.load(states, path / "dcp")
        states = self._unpart(states)
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
            if self.zero3 and cfg.model.model_path is not None:
                # from_pretrained then loads straight into partitions (zero.Init) instead of a full copy per rank
                from transformers.integrations import HfDeepSpeedConfig

                self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
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
