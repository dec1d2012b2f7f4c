"""A run's checkpoints from the loop's side: what a checkpoint records of the run (`trainer_state`), `save`, and
`resume` (the checkpoint chosen by `resume`, checked against this run — its data, its global batch and step count,
its model — then loaded, regrouping the experts' parts when the expert-parallel degree changed). The files, their
manifest and the choice among candidates are train/checkpoint.py's; the engines read and write their own state."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from train.checkpoint import (CheckpointError, check_same_model, checkpoint_root, choose_checkpoint, dataset_identity, describe_resume, discard_checkpoints, load_rng,
                              load_trainer_state, model_identity, remove_stale_saves, reshard_rng_seed,
                              resume_candidates, resume_refusal, save_checkpoint)
from train.engines.engine import saved_with
from train.metrics import truncate_log
from train.run.setup import Run, seed_everything

logger = logging.getLogger("packsft.train")


@dataclass(frozen=True)
class Resumed:
    """Where a run starts: `step` (0 for a new run), and `saved` the checkpoint of that step in output_dir (None: none
    there; a new run, or a checkpoint resumed from elsewhere)."""

    step: int = 0
    saved: Path | None = None


def step_layout(run: Run) -> dict:
    """What decides the rows and the lr of every step (a resume with another global batch or step count is refused),
    and how a step is split over ranks and micro-batches (a resume may change that)."""
    steps = run.cfg.steps
    return {"total_steps": run.plan.schedule.total_steps, "rows_per_step": run.sampler.rows_per_step,
            "dp_size": run.mesh.dp_size, "sp_size": run.mesh.sp_size, "grad_accum": steps.grad_accum,
            "micro_batch_rows": steps.micro_batch_rows, "max_steps": steps.max_steps, "num_epochs": steps.num_epochs}


def data_identity(run: Run) -> dict:
    return dataset_identity(run.cfg.data.data_path, len(run.dataset))


def trainer_state(run: Run, step: int) -> dict:
    """trainer_state.json of a checkpoint at `step`."""
    epoch, in_epoch = run.sampler.position(step)
    names = run.engine.expert_parameter_names()
    experts = {"expert_parameters": names} if run.mesh.ep_size > 1 and names is not None else {}
    return {"step": step, "epoch": epoch, "step_in_epoch": in_epoch, **step_layout(run), "seed": run.cfg.steps.seed,
            "world_size": run.mesh.world_size, "engine": run.engine.name, "expert_parallel_size": run.mesh.ep_size,
            **experts, "deepspeed_stage": run.cfg.deepspeed.stage, "data": data_identity(run),
            "model": model_identity(run.checked.model_config, run.cfg.lora)}


def state_bytes_estimate(run: Run) -> int:
    """Size of a first checkpoint: the weights plus two fp32 Adam moments per trainable parameter."""
    total = 0
    for p in run.model.parameters():
        numel = getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions: the full size
        total += numel * p.element_size() + (8 * numel if p.requires_grad else 0)
    return total


def save(run: Run, step: int) -> Path:
    """Collective: the checkpoint of `step` (train/checkpoint.py `save_checkpoint`); its directory."""
    return save_checkpoint(run.cfg.checkpoint.output_dir, step, run.mesh.rank,
                           lambda tmp: run.engine.save(tmp, run.mesh.is_main), trainer_state(run, step),
                           run.cfg.checkpoint.save_total_limit, estimate_bytes=state_bytes_estimate(run))


def resume(run: Run) -> Resumed:
    """Load the checkpoint `resume` names (none / latest / a path) into the run, or start a new one (the log and, with
    overwrite_output_dir, the earlier checkpoints cleared). Call before the log opens: a resume truncates log.jsonl to
    the checkpoint's step."""
    ckpt, mesh = run.cfg.checkpoint, run.mesh
    if mesh.is_main:
        for stale in remove_stale_saves(ckpt.output_dir):  # a killed save's partial files
            logger.warning("removed %s, left by a save that did not finish", stale)
    candidates = resume_candidates(ckpt.resume, ckpt.output_dir, warn=run.warn)
    if not candidates:
        if mesh.is_main:  # a new run: no records of an earlier run in the same output_dir
            truncate_log(ckpt.output_dir, 0)
            if ckpt.resume == "none" and ckpt.overwrite_output_dir:
                discard_checkpoints(ckpt.output_dir)
        if ckpt.resume == "latest":
            run.console(f"resume=latest: no checkpoint in {ckpt.output_dir}, starting from step 0")
        return Resumed()
    path = choose_checkpoint(candidates, ckpt.resume_corrupt, warn=run.warn)
    state = load_trainer_state(path)
    refusal, warning = resume_refusal(path, state, step_layout(run), data_identity(run), ckpt.resume_data_mismatch)
    if refusal:
        raise CheckpointError(refusal)
    if warning:
        run.warn(warning)
    check_same_model(path, state, model_identity(run.checked.model_config, run.cfg.lora), run.cfg.model)
    saved_world = state.get("world_size")
    resharded = saved_world is not None and int(saved_world) != mesh.world_size
    if resharded and "rows_per_step" not in state:
        raise CheckpointError(
            f"{path} was saved by {saved_world} processes, this run has {mesh.world_size}, and the checkpoint "
            "predates the record of its global batch (PackSFT's resume on another number of processes needs "
            "it); resume with the same number of processes"
        )
    run.engine.load(path, resharded_from=int(saved_world) if resharded else None,
                    experts_from=_expert_parts(run, path, state))
    step = int(state["step"])
    if resharded:  # rows move between ranks: no saved stream belongs to a new rank (dropout off: no effect)
        seed_everything(reshard_rng_seed(run.cfg.steps.seed, step, mesh.rank))
    else:
        load_rng(path, mesh.rank)
    # this step's checkpoint is already in output_dir (not a moved-aside copy)
    here = path.resolve().parent == checkpoint_root(ckpt.output_dir).resolve() and not path.name.startswith(".")
    if mesh.is_main:
        truncate_log(ckpt.output_dir, step)
    change = None if "rows_per_step" not in state else describe_resume(
        {**state, "engine": state.get("engine", saved_with(path))},  # older checkpoints: from their files
        {**step_layout(run), "world_size": mesh.world_size, "engine": run.engine.name,
         "deepspeed_stage": run.cfg.deepspeed.stage, "expert_parallel_size": mesh.ep_size})
    run.console(f"resumed from {path} at step {step}" + (f"; {change}" if change else ""))
    return Resumed(step, path if here else None)


def _expert_parts(run: Run, path: Path, state: dict) -> tuple[int, list[str]] | None:
    """(the saved expert-parallel degree, the expert parameters' names) when the checkpoint holds parts of the experts
    for another degree than this run's, which the engine puts together and cuts anew; None otherwise."""
    saved_ep = int(state.get("expert_parallel_size", 1))
    if saved_ep == run.mesh.ep_size or not run.engine.saves_expert_parts:
        return None
    run.engine.check_saved_with(path)  # a checkpoint of another engine: named as such
    names = state.get("expert_parameters") if saved_ep > 1 else run.engine.expert_parameter_names()
    if not names:
        raise CheckpointError(
            f"resume from {path}: saved with expert_parallel_size={saved_ep}, this run has "
            f"expert_parallel_size={run.mesh.ep_size}, and its trainer_state.json does not record which parameters "
            f"were split (expert_parameters), so its parts cannot be cut anew; resume with "
            f"expert_parallel_size={saved_ep}")
    return saved_ep, names
