"""Which rows each rank trains on at each optimizer step: seeded per epoch, a pure function of the step number.

A step takes `rows_per_step = dp_size * grad_accum * micro_batch_rows` rows of the epoch's permutation; the rank
of data-parallel index d gets its share as `grad_accum` micro-batches of up to `micro_batch_rows` whole rows.
The plan of step g depends only on (seed, g, dataset size, layout), so resuming at any step needs nothing but g
(the sampler position saved in checkpoints is (epoch, step)). All sp ranks of one dp index get the same rows.

The last step of an epoch may have fewer rows than rows_per_step; a rank then left with an empty micro-batch runs
a filler row whose loss weights are zeroed (it contributes exactly 0, and every rank still runs the same number of
forward/backward passes, which DeepSpeed's accumulation and ZeRO-3's collectives need).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from train.steps.batch import StepTotals, step_totals


@dataclass
class MicroBatchPlan:
    rows: list[int]
    filler: bool = False  # no real row: weights zeroed


@dataclass
class StepPlan:
    step: int  # global optimizer step, 0-based
    epoch: int
    step_in_epoch: int
    step_rows: np.ndarray  # every real row of the step (all dp ranks)
    totals: StepTotals
    micro_batches: list[MicroBatchPlan] = field(default_factory=list)  # this dp rank's
    n_real_micro_batches: int = 0  # micro-batches with rows, over all dp ranks (fillers excluded)


class StepSampler:
    def __init__(
        self,
        dataset,
        dp_size: int,
        dp_rank: int,
        grad_accum: int,
        micro_batch_rows: int,
        seed: int,
        balance: bool = False,
    ):
        self.dataset = dataset
        self.n_rows = len(dataset)
        if self.n_rows == 0:
            raise ValueError("the training dataset has no rows")
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.grad_accum, self.micro_batch_rows = grad_accum, micro_batch_rows
        self.seed, self.balance = seed, balance
        self.rows_per_step = dp_size * grad_accum * micro_batch_rows
        # online packing (train/steps/online.py) re-plans its rows per epoch: the row count may change with the epoch
        self._replans = hasattr(dataset, "set_epoch")
        self._epoch_steps: dict[int, int] = {}
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None
        self._costs: np.ndarray | None = None  # attention cost per row (balance), per epoch for online packing

    @property
    def replans(self) -> bool:
        """Whether the dataset's rows change with the epoch (online packing): its length and rows move when a plan
        reaches the next epoch."""
        return self._replans

    def _use_epoch(self, epoch: int) -> int:
        """Make `epoch` the dataset's current epoch (online packing) and return its row count."""
        if self._replans:
            if getattr(self.dataset, "epoch", None) != epoch:  # re-plan only on an epoch change
                self._costs = None
                self.dataset.set_epoch(epoch)
            return len(self.dataset)
        return self.n_rows

    def steps_in_epoch(self, epoch: int) -> int:
        if epoch not in self._epoch_steps:
            self._epoch_steps[epoch] = math.ceil(self._use_epoch(epoch) / self.rows_per_step)
        return self._epoch_steps[epoch]

    @property
    def steps_per_epoch(self) -> int:
        return self.steps_in_epoch(0)

    def total_steps(self, max_steps: int | None, num_epochs: int) -> int:
        if max_steps is not None:
            return max_steps
        return sum(self.steps_in_epoch(e) for e in range(num_epochs))

    def permutation(self, epoch: int) -> np.ndarray:
        n_rows = self._use_epoch(epoch)
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n_rows)
            self._perm_epoch = epoch
        return self._perm

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of global step `step` (0-based)."""
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        return epoch, step

    def plan(self, step: int) -> StepPlan:
        """The rows of global step `step`; afterwards the dataset serves that step's epoch."""
        epoch, in_epoch = self.position(step)
        perm = self.permutation(epoch)
        step_rows = perm[in_epoch * self.rows_per_step : (in_epoch + 1) * self.rows_per_step]
        totals = step_totals(self.dataset, step_rows)
        rank_rows = self._rank_rows(step_rows)
        mine = rank_rows[self.dp_rank]
        micro = []
        for k in range(self.grad_accum):
            rows = mine[k * self.micro_batch_rows : (k + 1) * self.micro_batch_rows]
            if rows:
                micro.append(MicroBatchPlan(rows=rows))
            else:
                micro.append(MicroBatchPlan(rows=[int(perm[0])], filler=True))
        n_real = sum(math.ceil(len(rows) / self.micro_batch_rows) for rows in rank_rows)
        return StepPlan(step, epoch, in_epoch, step_rows, totals, micro, n_real)

    def _row_costs(self) -> np.ndarray:
        """Σ seq_len² of every row, from the sequence index (no token reads), once per dataset epoch."""
        if self._costs is None:
            from train.steps.balance import dataset_row_costs

            self._costs = dataset_row_costs(self.dataset)
        return self._costs

    def _rank_rows(self, step_rows: np.ndarray) -> list[list[int]]:
        """The rows of every dp rank, by dp index."""
        if self.dp_size == 1:
            return [[int(r) for r in step_rows]]
        if self.balance:
            from train.steps.balance import balance_step

            costs = self._row_costs()[np.asarray(step_rows, dtype=np.int64)]
            return balance_step(step_rows, costs, self.dp_size)
        return [[int(r) for r in step_rows[rank :: self.dp_size]] for rank in range(self.dp_size)]
