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
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from train.checkpoint import CheckpointError
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
    # under expert parallelism, whether a checkpoint holds each rank's part of the experts (a resume on another degree
    # puts the parts together and cuts them anew: `load`'s experts_from), rather than every expert whole (FSDP2's DCP)
    saves_expert_parts = False

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
        another degree (the plain engine only: FSDP2's checkpoints hold every expert parameter whole, any degree
        reads its part)."""
        raise NotImplementedError

    def export_state(self, is_main: bool) -> dict | None:
        """Collective. The full state dict to export on the main rank (None elsewhere), or None everywhere when
        the export reads the live parameters (LoRA on full copies)."""
        raise NotImplementedError

    def expert_parameter_names(self) -> list[str] | None:
        """The names of this rank's expert parameters where checkpoints hold parts of them (`saves_expert_parts`),
        else None."""
        return None

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
