"""The parallel layout of a run, decided once at start before the mesh exists: `plan_layout` -> `ParallelLayout`.

From the config, the world, the model config and the data's row length: the sequence-parallel degree (set, or
`auto`'s choice from the memory estimates: train/plan/memory_plan.py `choose_sp_degree_for`), the sp rules of that
degree (checked here once when auto chose it: the config's own degree was checked by TrainConfig.validate), how an sp
group splits into Ulysses and gather / ring ranks (train/plan/attention.py `plan_sp_layout`, with its refusals of
model features no SP path honours), the expert-parallel degree and the processes per machine. The mesh
(train/distributed.py `build_mesh`) is built from it as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError
from train.config.sections import TrainConfig
from train.distributed import ranks_per_machine
from train.plan.attention import SPLayout, plan_sp_layout
from train.plan.memory_plan import choose_sp_degree_for


@dataclass(frozen=True)
class ParallelLayout:
    """How the `world` ranks share the work: data parallel x sequence parallel (`sp` ranks per row, split as
    `sp_split` says), and expert parallel (`ep` data-parallel ranks share one copy of the experts)."""

    world: int
    per_machine: int  # processes on one machine (the launcher's LOCAL_WORLD_SIZE, else the config's launch section)
    sp: int
    sp_reason: str | None  # why this degree when `auto` chose it; None: the config set it
    sp_split: SPLayout | None  # Ulysses / gather-ring split of an sp group; None without sequence parallelism
    ep: int

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def ulysses(self) -> int:
        return self.sp_split.ulysses_size if self.sp_split is not None else 1

    def describe(self) -> str:
        """`world 4 (dp 2 x sp 2 [auto: ...])` (the experts' split is said by the experts plan)."""
        why = f" [{self.sp_reason}]" if self.sp_reason else ""
        return f"world {self.world} (dp {self.dp} x sp {self.sp}{why})"


def plan_layout(cfg: TrainConfig, model_config, world: int, row_length: int, offloads_optimizer: bool,
                media_kinds=()) -> ParallelLayout:
    """The layout of a run of `world` processes on rows of `row_length` tokens (`offloads_optimizer`: the engine keeps
    the optimizer state on the host, which the memory estimate of `auto` counts, as the towers of the data's
    `media_kinds`). Raises ConfigError naming the key
    when the degree `auto` chose breaks a rule of the processes or the placement."""
    parallel = cfg.parallel
    sp, reason = parallel.sequence_parallel_size, None
    if sp == "auto":
        sp, reason = choose_sp_degree_for(cfg, model_config, world, row_length, offloads_optimizer, media_kinds)
        if problem := cfg.parallel_problem(world, sp):
            raise ConfigError(f"sequence_parallel_size auto chose {sp} ({reason}): {problem}")
    split = plan_sp_layout(parallel, cfg.launch, model_config, sp)
    return ParallelLayout(world, ranks_per_machine(cfg.launch.processes_per_machine), sp, reason, split,
                          parallel.expert_parallel_size)
