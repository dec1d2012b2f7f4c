"""A run built in order: `build_run(cfg) -> Run`, everything the loop (train/trainer.py) trains with.

It decides nothing: each decision is a train/plan/ function called at its point (the plan's facts need what was built
before: the layout the data's row length, the schedule the sampler's step count, the attention plan the model), and
the `StartupPlan` that collects them is made last. The order:
process group -> preflight (train/preflight.py, unless `python -m train` ran it) -> the engine's set-up -> the
family check -> the datasets -> data facts -> layout -> memory plan -> mesh -> sampler -> schedule -> model (weights
load here) -> experts -> attention plan -> loss -> the packed model -> the self-check (train/run/check.py) -> engine.
"""
from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from data.shards.media import MediaLoader
from train.config.sections import TrainConfig
from train.distributed import Mesh, build_mesh, init_distributed
from train.engines.build import EngineSetup, start_process_group
from train.engines.engine import Engine
from train.engines.schedule import param_groups
from train.model.experts import apply_experts
from train.model.packed import PackedCausalLM, build_lm, model_features
from train.model.support import check_family
from train.plan.attention import plan_attention
from train.plan.layout import plan_layout
from train.plan.memory_plan import plan_memory
from train.plan.startup import (StartupPlan, check_layout_for_data, plan_data, plan_experts, plan_loss,
                                plan_router_aux, plan_schedule, plan_self_check)
from train.preflight import Preflight, preflight
from train.run.check import run_self_check
from train.steps.sampler import StepSampler

logger = logging.getLogger("packsft.train")


@dataclass
class Run:
    """What a training run is made of (train/run/setup.py builds it once)."""

    cfg: TrainConfig  # as the user wrote it (load_config + overrides); every value chosen at start is in `plan`
    checked: Preflight
    plan: StartupPlan
    mesh: Mesh
    engine_setup: EngineSetup
    dataset: Any  # PackedDataset, or OnlinePackedDataset (train/steps/online.py)
    eval_dataset: Any  # PackedDataset or None
    media_loader: MediaLoader | None  # each item of a micro-batch's stored media -> its processor output (None: text)
    sampler: StepSampler
    lm: torch.nn.Module  # the HF model (with its patches and adapters)
    model: PackedCausalLM
    engine: Engine
    console: Callable[[str], None]

    def warn(self, text: str) -> None:
        """A warning, said once for the run (by the main rank)."""
        if self.mesh.is_main:
            logger.warning(text)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_run(cfg: TrainConfig, console: Callable[[str], None] | None = None, checked: Preflight | None = None
              ) -> Run:
    """The run of `cfg` on this process (`checked`: what preflight found, None: it runs here)."""
    if not sys.stderr.isatty():  # redirected output: no "Loading weights" / "Writing model shards" bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    init_distributed()
    start_process_group(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    checked = checked or preflight(cfg, world)  # every check before the model loads
    setup = EngineSetup(cfg)  # what the engine decides before the model (DeepSpeed's dict)
    warnings: list[str] = []  # said once the main rank is known
    family = check_family(checked.model_config, cfg.model.self_check, warnings.append)  # a refused family: here
    seed_everything(cfg.steps.seed)

    from data.shards.dataset import PackedDataset
    from train.steps.online import open_train_dataset

    dataset = open_train_dataset(cfg.data.data_path, cfg.data.online_max_length, seed=cfg.steps.seed,
                                 verify=cfg.data.verify_data)
    # opened once and held: every evaluation reads the rows checked at start, even if the folder changes meanwhile
    eval_dataset = None if checked.eval_path is None else PackedDataset(checked.eval_path, verify=cfg.data.verify_data)
    data, media = plan_data(dataset, eval_dataset, checked.model_config)
    layout = plan_layout(cfg, checked.model_config, world, data.row_length, setup.offloads_optimizer,
                         data.media_kinds)
    check_layout_for_data(data, layout, cfg.data.data_path)
    memory = plan_memory(cfg, checked.model_config, world, layout.sp, data.row_length, setup.offloads_optimizer,
                         media_kinds=data.media_kinds)
    mesh = build_mesh(layout.sp, ulysses_size=layout.ulysses, ep_size=layout.ep)
    console = console or (print if mesh.is_main else (lambda *_: None))
    sampler = StepSampler(dataset, mesh.dp_size, mesh.dp_rank, cfg.steps.grad_accum, cfg.steps.micro_batch_rows,
                          cfg.steps.seed, balance=cfg.data.balance_dp)
    schedule = plan_schedule(cfg, sampler.total_steps(cfg.steps.max_steps, cfg.steps.num_epochs))
    if checked.tokenizer_path is None:  # none named anywhere (a named one must exist)
        warnings.append("no tokenizer (tokenizer_path, model_path, the shards' meta.json): final/ will be exported "
                        "without one")
    if mesh.is_main:
        for warning in warnings:
            logger.warning(warning)

    setup.before_weights_load()
    lm = build_lm(cfg, checked.model_config, setup.dtype, memory)
    experts = plan_experts(cfg, layout)
    applied = apply_experts(lm, checked.model_config, mesh, experts.parallel, experts.kernel)
    attention = plan_attention(cfg.model, cfg.parallel, layout.sp_split, mesh, lm, data.structure)
    loss = plan_router_aux(cfg, plan_loss(cfg, mesh.device), lm,
                           warn=logger.warning if mesh.is_main else (lambda *_: None))
    model = PackedCausalLM(lm, loss.chunk_size, data.num_categories, zero3=setup.zero3, router_aux=loss.router_aux,
                           fused_loss=loss.compiled, media=media, media_kinds=data.media_kinds)
    plan = StartupPlan(family, data, media, layout, memory, schedule, loss, replace(experts, applied=applied),
                       plan_self_check(cfg, setup.partitioned_load), attention, sampler.rows_per_step)
    media_loader = MediaLoader.of(dataset.meta)
    if plan.self_check.runs:
        run_self_check(model, plan, dataset, media_loader, setup.autocast_bf16, console)
    elif plan.self_check.why_not:
        console(f"self-check skipped: {plan.self_check.why_not}")
    engine = setup.build(cfg, model, lambda: param_groups(model, cfg.optim.weight_decay), schedule.lr_factor(), mesh)
    plan = replace(plan, engine=engine.describe(), features=model_features(cfg, lm, model, memory))
    return Run(cfg, checked, plan, mesh, setup, dataset, eval_dataset, media_loader, sampler, lm, model, engine,
               console)
