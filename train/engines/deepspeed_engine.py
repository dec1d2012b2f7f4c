"""The DeepSpeed engine (deepspeed.stage 0-3) and its checkpoint format: DeepSpeed's `ds/` files, read through
safe_load (`load_deepspeed_files_safely`), and the ZeRO reshard (`read_zero_state` / `install_zero_state`): a
checkpoint saved on another number of ranks, joined and re-sliced by PackSFT instead of DeepSpeed's universal
checkpoint."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.checkpoint import CheckpointError, safe_load
from train.distributed import Mesh
from train.engines.engine import Engine, _adam
from train.nonfinite import gradient_norm, nonfinite_problem


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, cfg, model, param_groups, lr_factor, mesh: Mesh, ds_config: dict | None):
        import deepspeed

        from train.engines.deepspeed_config import offloads_optimizer

        offload = offloads_optimizer(ds_config)  # the YAML flag or the template
        optimizer = None if offload else torch.optim.AdamW(param_groups(), **_adam(cfg))
        # stage 0 in fp32 steps the torch optimizer as it is: DeepSpeed records no gradient norm there (and clips
        # with a float32 norm); the norm is then computed and the gradients clipped here, as the plain engine does
        self.own_norm = cfg.deepspeed.stage == 0 and optimizer is not None and not any(
            (ds_config.get(key) or {}).get("enabled") for key in ("bf16", "fp16", "torch_autocast"))
        self.max_grad_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
        if self.own_norm:
            ds_config = {**ds_config, "gradient_clipping": 0.0}
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
        if self.own_norm and self.engine.optimizer is not optimizer:
            raise RuntimeError(f"deepspeed.stage 0 wrapped the optimizer in {type(self.engine.optimizer).__name__}; "
                               "the engine expected to step torch's AdamW itself")
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
        if self.own_norm:
            return self._step_with_own_norm(loss)
        self.engine.step()
        if not self.engine.was_step_applied():  # ZeRO 1-3 skip an update whose gradients hold inf / nan
            problem = "the gradients hold inf or nan (DeepSpeed skipped the update)"
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, problem or nonfinite_problem(loss, norm)

    def _step_with_own_norm(self, loss):
        """Stage 0 in fp32: the gradients are already summed over the ranks (DeepSpeed all-reduces them in the
        boundary's backward); their norm in float64 (the same on every rank), clipped as the plain engine clips,
        then DeepSpeed's step (its own clipping is off). A non-finite norm leaves the model untouched (the trainer
        stops: nonfinite=skip_step is refused with DeepSpeed, train/config/)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = gradient_norm(p.grad for p in params if p.grad is not None)
        problem = nonfinite_problem(loss, norm)
        if problem:
            return norm, problem
        if math.isfinite(self.max_grad_norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, torch.tensor(norm))
        self.engine.step()
        return norm, None

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


def deepspeed_checkpoint_classes() -> list:
    """The classes DeepSpeed's checkpoint files hold besides tensors and containers (ZeRO 1-3 optimizer states:
    the static loss scaler, the stage enum, fragment addresses)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_files_safely(engine) -> None:
    """Make `engine` read checkpoint files as safe_load does (weights_only=True with the classes above) instead of
    DeepSpeed's unrestricted unpickling, so a pickle planted in `ds/` is refused, not run. DeepSpeed reads
    every file of a checkpoint through `engine.checkpoint_engine.load`, except universal checkpoints (refused)."""
    if engine.load_universal_checkpoint():
        raise CheckpointError("deepspeed checkpoint.load_universal unpickles files without restriction, outside "
                              "DeepSpeed's checkpoint engine: PackSFT does not resume universal checkpoints")
    allowed = deepspeed_checkpoint_classes()
    engine.checkpoint_engine.load = lambda path, map_location=None: safe_load(path, allowed)


# DeepSpeed refuses to load ZeRO partitions written by another number of ranks, and its own way around that (the
# universal checkpoint: ds_to_universal.py, then `load_universal`) unpickles files without restriction. PackSFT reads
# the saved partitions itself (through safe_load), joins them into whole tensors per parameter and writes this rank's
# slices into the new engine: copies only, so the resumed step sees bit for bit the fp32 weights and Adam moments the
# saving run held (tested with deepspeed 0.19.8 for ZeRO-1/2/3).
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
_ZERO_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


@dataclass
class WholeZeroState:
    """A ZeRO checkpoint with no world size left in it."""

    stage: int
    saved_ranks: int
    params: dict[str, dict[str, torch.Tensor]]  # trainable parameter name -> {"fp32", "exp_avg", "exp_avg_sq"}, whole
    step: Any  # the optimizer's step count (a tensor for torch's AdamW)
    groups: list[dict]  # each param group's hyperparameters (lr, betas, ...), its params left out
    engine_state: dict  # lr_scheduler, global_steps, global_samples, skipped_steps
    module: dict | None  # ZeRO-1/2: the module's state dict (every weight, frozen ones included); ZeRO-3: None


def _zero_rank_files(ds_dir: Path) -> list[Path]:
    """The optimizer partition files of `ds_dir`, by rank (0..n-1, none missing)."""
    found = {int(m.group(1)): p for p in ds_dir.iterdir() if (m := _ZERO_FILE.match(p.name))}
    if not found or sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{ds_dir}: the ZeRO optimizer partition files are not ranks 0..n-1 "
                              f"(found ranks {sorted(found)})")
    return [found[r] for r in range(len(found))]


def read_zero_state(ds_dir: Path) -> WholeZeroState:
    """The whole optimizer state of the ZeRO-1/2/3 checkpoint `ds_dir` (DeepSpeed's files of any number of ranks),
    every file read through safe_load."""
    allowed = deepspeed_checkpoint_classes()
    files = _zero_rank_files(ds_dir)
    parts = [safe_load(f, allowed)["optimizer_state_dict"] for f in files]
    stage = int(parts[0]["zero_stage"])
    model_file = ds_dir / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt")
    model = safe_load(model_file, allowed)
    if int(model["dp_world_size"]) != len(files):
        raise CheckpointError(f"{model_file}: written by {model['dp_world_size']} ranks, but {ds_dir} holds "
                              f"{len(files)} optimizer partition files")
    if stage == 3 and model.get("frozen_param_shapes"):
        raise CheckpointError(f"{model_file}: ZeRO-3 with frozen parameters (LoRA): resuming it on another number of "
                              "processes is not supported; resume with the saving run's processes")
    base = [p["optimizer_state_dict"] if stage == 3 else p["base_optimizer_state"] for p in parts]
    shapes = model["param_shapes"]
    if stage == 3:
        params = _join_zero3(parts, base, shapes)
    else:
        params = _join_zero12(parts, base, shapes)
    states = base[0]["state"]
    step = states[min(states)]["step"]
    groups = [{k: v for k, v in group.items() if k != "params"} for group in base[0]["param_groups"]]
    engine_state = {k: model[k] for k in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")}
    return WholeZeroState(stage, len(files), params, step, groups, engine_state,
                          None if stage == 3 else model["module"])


def _join_zero12(parts: list[dict], base: list[dict], shapes: list[dict]) -> dict:
    """ZeRO-1/2: each rank holds one contiguous slice of every param group's flat vector; its file says where each
    parameter's piece lies in it (param_slice_mappings), in rank order."""
    params = {}
    for g, group_shapes in enumerate(shapes):
        sources = [("fp32", [p["single_partition_of_fp32_groups"][g] for p in parts])]
        sources += [(key, [b["state"][g][key] for b in base]) for key in ADAM_MOMENTS]
        for name, shape in group_shapes.items():
            whole = {}
            for key, flats in sources:
                pieces = [flat.narrow(0, m.start, m.numel) for part, flat in zip(parts, flats)
                          if (m := part["param_slice_mappings"][g].get(name)) is not None]
                whole[key] = torch.cat(pieces).view(shape)  # a wrong piece count fails here (numel)
            params[name] = whole
    return params


def _join_zero3(parts: list[dict], base: list[dict], shapes: list[dict]) -> dict:
    """ZeRO-3: every parameter is cut into n equal slices (the last one padded), slice r on rank r; a rank's flat
    vector is its slices of every parameter in order."""
    n = len(parts)
    flats = {"fp32": [torch.cat(list(p["fp32_flat_groups"])) for p in parts]}
    for key in ADAM_MOMENTS:
        flats[key] = [torch.cat([b["state"][i][key] for i in sorted(b["state"])]) for b in base]
    params, offset = {}, 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            size = -(-numel // n)
            params[name] = {key: torch.cat([flat.narrow(0, offset, size) for flat in ranks])[:numel].view(shape)
                            for key, ranks in flats.items()}
            offset += size
    return params


def install_zero_state(engine, whole: WholeZeroState) -> None:
    """Write this rank's slices of `whole` into a freshly built engine of the same ZeRO stage (any number of ranks):
    fp32 master weights, Adam moments and step, the module's weights, the lr scheduler and the engine's counters."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() != whole.stage:
        raise CheckpointError(f"the checkpoint was saved with ZeRO-{whole.stage}, this run uses ZeRO-"
                              f"{engine.zero_optimization_stage()}: resume with deepspeed.stage={whole.stage}")
    names = {p: n for n, p in engine.module.named_parameters()}
    if engine.zero_optimization_stage() == 3:
        flats, groups = optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups
    else:
        flats, groups = optimizer.single_partition_of_fp32_groups, optimizer.bit16_groups
        engine.module.load_state_dict(whole.module)  # the module's weights: every rank holds them whole
    trained, saved = {names[p] for group in groups for p in group}, set(whole.params)
    if trained != saved:
        def some(found: set) -> str:
            return ", ".join(sorted(found)[:3]) + (", ..." if len(found) > 3 else "") or "none"

        raise CheckpointError("the checkpoint's optimizer state does not fit the parameters this run trains (only in "
                              f"the checkpoint: {some(saved - trained)}; only here: {some(trained - saved)})")
    for g, (flat, params) in enumerate(zip(flats, groups)):
        local = {"fp32": flat.detach().clone(), **{key: torch.zeros_like(flat) for key in ADAM_MOMENTS}}
        for p in params:
            whole_p = whole.params[names[p]]
            for key, dest in local.items():
                _copy_local_slice(optimizer, p, whole_p[key].reshape(-1), dest)
        flat.data.copy_(local["fp32"])
        state_step = whole.step.clone() if torch.is_tensor(whole.step) else whole.step
        optimizer.optimizer.state[flat] = {"step": state_step, **{k: local[k] for k in ADAM_MOMENTS}}
        group_id = optimizer.sub_group_to_group_id[g] if whole.stage == 3 else g
        optimizer.optimizer.param_groups[group_id].update(whole.groups[group_id])  # lr, betas, ...
    if engine.zero_optimization_stage() == 3:  # the module's partitions from the fp32 masters (as DeepSpeed does)
        for g, flat in enumerate(optimizer.fp16_partitioned_groups_flat):
            flat.data.copy_(optimizer.fp32_partitioned_groups_flat[g].data)
            for part, view in zip(optimizer.fp16_partitioned_groups[g],
                                  optimizer.unflatten(flat, optimizer.fp16_partitioned_groups[g])):
                part.data = view.data
    else:
        optimizer._hp_optimizer_states_linked = False  # relinked to the new moments at the next step
    engine.lr_scheduler.load_state_dict(whole.engine_state["lr_scheduler"])
    for key in ("global_steps", "global_samples", "skipped_steps"):
        setattr(engine, key, whole.engine_state[key])


def _copy_local_slice(optimizer, param, whole: torch.Tensor, dest: torch.Tensor) -> None:
    """Copy this rank's part of `whole` (one parameter, flattened) to where the engine keeps it in `dest`."""
    if hasattr(param, "ds_id"):  # ZeRO-3: slice `rank` of n equal slices, at the parameter's offset
        _, offset, size = optimizer.grad_position[optimizer.get_param_id(param)]
        piece = whole[size * optimizer._get_param_partition_rank(param):][:size]
        dest.narrow(0, offset, piece.numel()).copy_(piece)
    elif param._hp_mapping is not None:  # ZeRO-1/2: the fragment of the parameter this rank's partition holds
        hp, lp = param._hp_mapping.hp_fragment_address, param._hp_mapping.lp_fragment_address
        dest.narrow(0, hp.start, hp.numel).copy_(whole.narrow(0, lp.start, lp.numel))
