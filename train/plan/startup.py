"""The start-up of a run as one value: `StartupPlan`, every decision made at start, in one place.

The decisions, each a function of this module's or of the plan wing's, called in order by train/run/setup.py (which
builds the run and decides nothing):
- `plan_data`: the data's facts, read once from the datasets' meta.json (the row length, else the longest row; the
  structure, `Structure`; the media kinds), and the refusals of the data against the model (images, videos or audios
  on a family that cannot train them, stepwise trees under sequence parallelism);
- `plan_layout` (train/plan/layout.py): dp, sp (`auto`), Ulysses / ring, ep, processes per machine;
- `plan_memory` (train/plan/memory_plan.py): checkpointing per layer, the MLP tile, the offload's host memory;
- `plan_schedule`: the lr schedule's steps (warmup from `warmup_ratio`);
- `plan_loss`: the reduction, the chunk, whether the chunk is compiled (`compile_loss: auto`), the router aux loss;
- `plan_experts`: expert parallelism, or transformers' experts kernel at degree 1 (`moe_kernel`);
- `plan_self_check`: whether the start-up self-check runs (not on weights ZeRO-3 loads partitioned);
- the family check (train/model/support.py) and the attention plan (train/plan/attention.py).
`StartupPlan.describe()` is the run's start line. The config stays as the user wrote it: every value chosen here
lives in the plan, never in the config.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import numpy as np
import torch

from common.config import ConfigError
from data.shards.dataset import Structure
from train.config.sections import TrainConfig
from train.engines.schedule import lr_lambda_factory
from train.families import MediaInputs
from train.model.moe import RouterAux, resolve_router_aux
from train.model.media_batch import dataset_media_kinds
from train.model.support import check_media_support
from train.plan.attention import TREE_SP_REFUSAL, AttentionPlan
from train.plan.layout import ParallelLayout
from train.plan.memory_plan import MemoryPlan


# ---------------------------------------------------------------------------------------------- the data
@dataclass(frozen=True)
class DataFacts:
    """What the run's data is, read once: the row length (the shards' `max_length`, else their longest row), the
    `structure` of its sequences, the media kinds the training or eval data holds (images, videos, audios; their
    meta.json counts), the categories."""

    row_length: int
    structure: Structure
    media_kinds: tuple[str, ...] = ()
    categories: Mapping[int, str] = field(default_factory=dict)

    @property
    def num_categories(self) -> int:
        return max([0, *self.categories]) + 1


def plan_data(dataset, eval_dataset, model_config) -> tuple[DataFacts, MediaInputs | None]:
    """The data's facts and, for data with media, how the model trains them (train/model/support.py: a family that
    cannot, or a kind it cannot, is refused here, before any weight loads)."""
    meta = dataset.meta
    row_length = int(meta.get("max_length") or int(np.max(dataset.row_n_tokens)))
    kinds = dataset_media_kinds(dataset, eval_dataset)
    facts = DataFacts(row_length, dataset.structure, kinds,
                      {int(k): v for k, v in (meta.get("categories") or {}).items()})
    return facts, (check_media_support(model_config, kinds) if kinds else None)


def check_layout_for_data(data: DataFacts, layout: ParallelLayout, data_path: str) -> None:
    """Stepwise trees have no sequence-parallel layout yet: refused before the mesh."""
    if data.structure is Structure.TREE and layout.sp_split is not None:
        raise ConfigError(f"data_path {data_path}: {TREE_SP_REFUSAL}")


# ---------------------------------------------------------------------------------------------- the schedule
@dataclass(frozen=True)
class Schedule:
    """The lr schedule: `total_steps` (max_steps, else the epochs' steps), warmup, the shape of the decay."""

    total_steps: int
    warmup_steps: int
    name: str
    min_lr_ratio: float

    def lr_factor(self) -> Callable[[int], float]:
        return lr_lambda_factory(self.total_steps, self.warmup_steps, self.name, self.min_lr_ratio)


def plan_schedule(cfg: TrainConfig, total_steps: int) -> Schedule:
    """`warmup_steps`, else `warmup_ratio` of the run's `total_steps` (the sampler's count for this data)."""
    optim = cfg.optim
    warmup = optim.warmup_steps if optim.warmup_steps is not None else int(optim.warmup_ratio * total_steps)
    return Schedule(total_steps, warmup, optim.schedule, optim.min_lr_ratio)


# ---------------------------------------------------------------------------------------------- the loss
@dataclass(frozen=True)
class LossPlan:
    """How a micro-batch's loss is computed: the step `reduction`, the lm-head chunk, whether the chunk is compiled,
    and the MoE router aux term (None: none)."""

    reduction: str
    chunk_size: int
    compiled: bool
    router_aux: RouterAux | None = None

    def describe(self) -> str:
        aux = self.router_aux
        return (f"loss {self.reduction}" + (", compiled loss chunks" if self.compiled else "")
                + (f", router aux loss (coef {aux.coef:g}, {aux.num_experts} experts, top {aux.top_k})"
                   if aux is not None else ""))


def plan_loss(cfg: TrainConfig, device: torch.device) -> LossPlan:
    """`compile_loss: auto` compiles the loss chunk on a GPU: measured 1.18x the step of the eager chunk on an H100
    (BENCHMARKS.md); on the CPU inductor's C++ build costs more than it saves."""
    compiled = cfg.model.compile_loss is True or (cfg.model.compile_loss == "auto" and device.type == "cuda")
    return LossPlan(cfg.steps.loss_reduction, cfg.steps.loss_chunk_size, compiled)


def plan_router_aux(cfg: TrainConfig, loss: LossPlan, lm: torch.nn.Module, warn) -> LossPlan:
    """The router aux term of the built model (train/model/moe.py: from the config's keys, else the model's)."""
    aux, warning = resolve_router_aux(lm, cfg.moe.output_router_logits, cfg.moe.router_aux_loss_coef)
    if warning:
        warn(warning)
    return replace(loss, router_aux=aux)


# ---------------------------------------------------------------------------------------------- the experts
@dataclass(frozen=True)
class ExpertsPlan:
    """How the routed experts of an MoE model run: split over `parallel` ranks (expert parallelism,
    train/model/experts.py), else as transformers' experts module with the `moe_kernel` chosen there. `applied`: what
    the model's experts turned out to be once built (layers, experts per rank, the kernel), None for a dense model."""

    parallel: int
    kernel: str
    applied: Mapping | None = None

    def describe(self) -> str | None:
        from train.model.experts import describe, describe_experts_kernel

        if self.applied is None:
            return None
        return describe(self.applied, self.parallel) if self.parallel > 1 else describe_experts_kernel(self.applied)


def plan_experts(cfg: TrainConfig, layout: ParallelLayout) -> ExpertsPlan:
    return ExpertsPlan(layout.ep, cfg.moe.moe_kernel)


# ---------------------------------------------------------------------------------------------- the self-check
@dataclass(frozen=True)
class SelfCheckPlan:
    """Whether the start-up self-check runs, and why not when the config asked for it."""

    runs: bool
    why_not: str | None = None


def plan_self_check(cfg: TrainConfig, partitioned_load: bool) -> SelfCheckPlan:
    """The start-up self-check (train/model/self_check.py) compares the packed path with the model's own unpacked
    forward on full weights: not where ZeRO-3 loads them partitioned."""
    if not cfg.model.self_check:
        return SelfCheckPlan(False)  # the user's call: nothing to say
    if partitioned_load:
        return SelfCheckPlan(False, "ZeRO-3 loads the weights partitioned (self_check covers ZeRO-0/1/2)")
    return SelfCheckPlan(True)


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class StartupPlan:
    """Every decision of a run's start-up (this module's docstring), and what the built parts say of themselves for
    the start line: `engine` (train/engines/), `features` (the model's patches, towers, LoRA)."""

    family: str
    data: DataFacts
    media: MediaInputs | None
    layout: ParallelLayout
    memory: MemoryPlan
    schedule: Schedule
    loss: LossPlan
    experts: ExpertsPlan
    self_check: SelfCheckPlan
    attention: AttentionPlan
    rows_per_step: int
    engine: str = ""
    features: tuple[str, ...] = ()

    def describe(self) -> list[str]:
        """The start lines: the attention plan, then what a step trains and how."""
        training = [self.layout.describe(), f"{self.rows_per_step} rows/step", self.engine, self.experts.describe(),
                    self.loss.describe(), self.memory.describe(), *self.features]
        return [self.attention.describe(),
                f"training {self.schedule.total_steps} steps: " + ", ".join(p for p in training if p)]
