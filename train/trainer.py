"""The training loop: packed rows -> exact step loss -> the engine's optimizer step (DeepSpeed, FSDP2 or plain
torch: train/engines/). The run it trains is built by train/run/setup.py (every start-up decision is the
`StartupPlan`'s, train/plan/startup.py); checkpoints and the export are train/run/resume.py's and export.py's.

Why DeepSpeed is driven directly (`deepspeed.initialize` with the dict built by train/engines/deepspeed_config.py) and
`accelerate launch` is only the launcher: under `accelerate launch --use_deepspeed` on CPU, accelerate's rank
bookkeeping is wrong (process_index 0 and num_processes 1 on every rank, measured with accelerate 1.15 on CPU), and accelerate's
DeepSpeed plugin rewrites the JSON and divides the loss by the accumulation steps behind our back. Ranks come from
torch.distributed through train.distributed.build_mesh.

Exact loss. Every token of a micro-batch carries the weight of the WHOLE optimizer step (train/steps/batch.py), so the
step loss is the plain sum of the local weighted sums over micro-batches, dp ranks and sp ranks. The gradient to
apply is therefore the SUM of the local gradients; how each engine gets it (DeepSpeed's mean undone by the backward
scale, FSDP2's reduce-scatter set to sum, the plain all_reduce) is train/engines/'s. The equivalence tests check
every engine against a single process, through the scale-sensitive gradient norm as well as the losses (Adam alone
would hide a constant gradient factor).

MoE models with a router load-balancing loss (train/model/moe.py): each micro-batch adds its rank's share of the aux
term, divided by the step's real micro-batches, to the local sum before the same scaling, so the aux term is
exact under the same conventions. The logged `loss` is the LM loss; `aux_loss` is the aux term; the optimised
objective is their sum.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from train.checkpoint import FINAL_DIR
from train.distributed import all_reduce_sum
from train.metrics import EvalProgress, MetricsLogger, plot_losses, process_age, run_summary, step_progress
from train.model.moe import real_tokens
from train.nonfinite import SKIPPED, NonFiniteError, stop_message
from train.row import queued_copy
from train.run import export as run_export
from train.run import resume as run_resume
from train.run.setup import build_run
from train.steps.batch import MicroBatch, StepTotals, make_batch, step_totals
from train.steps.feed import InlineFeed, PrefetchFeed, open_feed
from train.steps.sampler import MicroBatchPlan, StepPlan


class Trainer:
    def __init__(self, cfg, console=None, checked=None):
        """`checked`: what train/preflight.py found (python -m train runs it before the heavy imports); None: it
        runs here."""
        self.run = run = build_run(cfg, console, checked)
        self.cfg, self.plan, self.mesh, self.device = run.cfg, run.plan, run.mesh, run.mesh.device
        self.dataset, self.eval_dataset, self.sampler = run.dataset, run.eval_dataset, run.sampler
        self.lm, self.model, self.engine = run.lm, run.model, run.engine
        self.optimizer, self.scheduler = self.engine.optimizer, self.engine.scheduler
        self.console = run.console
        self.progress_bar = sys.stderr.isatty()  # redirected output: plain step lines, no tqdm fragments
        resumed = run_resume.resume(run)  # before the logger opens log.jsonl: resuming truncates it
        self.step = resumed.step
        if resumed.saved is not None:  # this step's checkpoint is in output_dir already
            self._saved_step, self._saved_path = resumed.step, resumed.saved
        self.metrics = MetricsLogger(cfg.checkpoint.output_dir, self.mesh.is_main, cfg.logging.log_backends,
                                     cfg.to_dict(), cfg.logging.wandb_project, write_console=self._console_write)

    @property
    def total_steps(self) -> int:
        return self.plan.schedule.total_steps

    def _console_write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            self.console(text)

    _bar = None
    _saved_step: int | None = None  # the step whose checkpoint is in output_dir (saved or resumed from)
    _saved_path: Path | None = None  # and its directory
    grad_hook = None  # callable(trainer) after the gradients of a step are complete (not DeepSpeed); tests use it

    # ------------------------------------------------------------------ one micro-batch
    def _micro_batch(self, plan: StepPlan | None, rows: list[int], filler: bool) -> MicroBatch:
        # a filler (a rank with no row left in this step: forward/backward for the collectives, contributes 0) is
        # not part of the step's totals, which may be smaller than its own: build it with its own, then zero it
        totals = step_totals(self.dataset, rows) if filler else plan.totals
        batch = make_batch([self.dataset[r] for r in rows], totals, self.plan.loss.reduction,
                           structure=self.plan.data.structure, media=self.run.media_loader)
        return batch.as_filler() if filler else batch

    def forward_micro_batch(self, batch: MicroBatch, filler: bool = False):
        """(weighted_sum, cat_loss_sum, cat_count, router_aux) of this rank's part of one full micro-batch;
        router_aux: this rank's share of the micro-batch's router aux term (PackedCausalLM), None without one."""
        media = self.model.row_media(batch)  # on the whole row, before sequence-parallel sharding
        batch, attn = self.plan.attention.context(batch)
        dev = self.device

        def to_dev(tensor: torch.Tensor) -> torch.Tensor:  # queued (pinned, non-blocking) on a GPU
            return queued_copy(tensor, dev)

        router = {}
        if self.plan.loss.router_aux is not None:
            router["router_tokens"] = to_dev(real_tokens(batch.input_ids.numel(), attn.sp, filler))
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.engine.autocasts else nullcontext()
        with autocast:
            out = self.engine.module(
                to_dev(batch.input_ids).reshape(1, -1),
                to_dev(batch.position_ids).reshape(1, -1),
                to_dev(batch.targets).reshape(-1),
                to_dev(batch.weights).reshape(-1),
                to_dev(batch.target_categories).reshape(-1),
                attn,
                media=media,
                **router,
            )
        return out if self.plan.loss.router_aux is not None else (*out, None)

    # ------------------------------------------------------------------ one optimizer step
    def _build_micro_batch(self, plan: StepPlan, micro: MicroBatchPlan) -> MicroBatch:
        return self._micro_batch(plan, micro.rows, micro.filler)

    def train_step(self, plan: StepPlan, feed: InlineFeed | PrefetchFeed | None = None) -> dict:
        """One optimizer step; its record's `loss` is the LM loss, `aux_loss` (MoE) the router aux term, which the
        step optimises too. `feed`: where its micro-batches come from (train/steps/feed.py; None: built here), and
        `batch_wait_s` in the record how long the step waited for them."""
        start = time.perf_counter()
        feed = feed or InlineFeed(self.sampler, self._build_micro_batch, plan.step + 1, current=plan)
        waited = feed.waited
        lr = self.scheduler.get_last_lr()[0]  # the lr this step applies (DeepSpeed steps the scheduler itself)
        C = self.plan.data.num_categories
        # [loss, cat_loss_sum[C], cat_count[C], aux_loss] on the communication device: no host sync per micro-batch
        local = torch.zeros(2 + 2 * C, dtype=torch.float64, device=self._comm_device())
        last = len(plan.micro_batches) - 1
        for i, mb in enumerate(plan.micro_batches):
            batch = feed.micro_batch(i)
            weighted, cat_sum, cat_count, router_aux = self.forward_micro_batch(batch, mb.filler)
            objective = weighted
            if router_aux is not None:  # the step's aux term: the mean over its real micro-batches
                router_aux = router_aux / plan.n_real_micro_batches
                objective = weighted + router_aux
                local[-1] += router_aux.detach().double()
            self.engine.backward(objective * self.engine.backward_scale, last=i == last)
            local[0] += weighted.detach().double()
            local[1 : 1 + C] += cat_sum.double()
            local[1 + C : 1 + 2 * C] += cat_count.double()
        stats = all_reduce_sum(local).cpu()
        grad_norm, skipped = self._optimizer_step(plan.step + 1, float(stats[0]), lr)
        elapsed = time.perf_counter() - start
        n_tokens = int(np.asarray(self.dataset.row_n_tokens)[plan.step_rows].sum())
        cat_loss = {}
        for cid, name in sorted(self.plan.data.categories.items()):
            count = float(stats[1 + C + cid])
            if cid > 0 and count > 0:
                cat_loss[name] = float(stats[1 + cid]) / count
        record = {
            "step": plan.step + 1,
            "epoch": plan.epoch + (plan.step_in_epoch + 1) / self.sampler.steps_in_epoch(plan.epoch),
            "loss": float(stats[0]),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": n_tokens / elapsed if elapsed > 0 else 0.0,
            "batch_wait_s": feed.waited - waited,
            "loss_tokens": plan.totals.n_loss_tokens,
            "tokens": n_tokens,
            "category_loss": cat_loss,
        }
        if self.plan.loss.router_aux is not None:
            record["aux_loss"] = float(stats[-1])
        if skipped:
            record["skipped"] = SKIPPED
        return record

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _optimizer_step(self, step: int, loss: float, lr: float) -> tuple[float, bool]:
        """Apply step `step`'s update unless its loss (all-reduced) or gradient norm is not finite: then stop
        (NonFiniteError) or, with nonfinite=skip_step, drop its gradients. Returns (gradient norm, skipped)."""
        skip = self.cfg.optim.nonfinite == "skip_step"  # a config error under DeepSpeed
        hook = (lambda: self.grad_hook(self)) if self.grad_hook is not None else None
        norm, problem = self.engine.step(loss, skip, hook)
        if problem and not skip:
            raise NonFiniteError(stop_message(step, problem, lr, self._saved_path))
        if problem:
            self._console_write(f"step {step}: {problem}: its update is skipped (nonfinite=skip_step)")
        return norm, problem is not None

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """`eval_loss`, the token-mean loss over the whole eval set (whatever loss_reduction), and
        `eval_category_loss` {name: token-mean loss} (every rank its rows; fillers keep ranks in step)."""
        ds = self.eval_dataset
        totals = StepTotals(int(np.sum(ds.row_n_loss_tokens)), int(np.sum(ds.row_n_trained_turns)),
                            int(np.sum(ds.row_n_samples)))
        mine = list(range(self.mesh.dp_rank, len(ds), self.mesh.dp_size))
        n_iter = math.ceil(len(ds) / self.mesh.dp_size)
        was_training = self.model.training
        self.model.eval()
        C = self.plan.data.num_categories
        local = torch.zeros(1 + 2 * C, dtype=torch.float64)  # [loss, cat_loss_sum[C], cat_count[C]], as train_step
        progress = EvalProgress(len(ds), self._console_write, bar=self.progress_bar, enabled=self.mesh.is_main)
        for k in range(n_iter):
            filler = k >= len(mine)
            batch = make_batch([ds[mine[k] if not filler else 0]], totals, "token",
                               structure=self.plan.data.structure, media=self.run.media_loader)
            weighted, cat_sum, cat_count = self.forward_micro_batch(batch.as_filler() if filler else batch,
                                                                    filler=filler)[:3]
            local[0] += weighted.double().cpu()
            local[1:1 + C] += cat_sum.double().cpu()
            local[1 + C:] += cat_count.double().cpu()
            progress.update(min(len(ds), (k + 1) * self.mesh.dp_size))
        progress.close()
        self.model.train(was_training)
        stats = all_reduce_sum(local.to(self._comm_device())).cpu()
        return {"eval_loss": float(stats[0]), "eval_category_loss": {
            name: float(stats[1 + cid] / stats[1 + C + cid])
            for cid, name in sorted(self.plan.data.categories.items()) if cid > 0 and stats[1 + C + cid] > 0}}

    def _evaluates_after(self, step: int) -> bool:
        """With an eval set: every eval_steps steps and after the last step."""
        if self.eval_dataset is None:
            return False
        return step == self.total_steps or bool(self.cfg.eval.eval_steps) and step % self.cfg.eval.eval_steps == 0

    # ------------------------------------------------------------------ checkpoints and export
    def save(self) -> Path:
        path = run_resume.save(self.run, self.step)
        self._saved_step, self._saved_path = self.step, path
        return path

    def export(self, out_dir: Path) -> Path:
        """HF format (safetensors + config + tokenizer) in `out_dir` (train/run/export.py)."""
        return run_export.export(self.run, out_dir)

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict]:
        """Run to total_steps (or stop after cfg.steps.stop_at_step, checkpointing, as an interrupted job would)."""
        from tqdm import tqdm

        cfg = self.cfg
        stop_at_step = cfg.steps.stop_at_step
        records = []
        self.model.train()
        end = self.total_steps if stop_at_step is None else min(self.total_steps, stop_at_step)
        if self.progress_bar and self.mesh.is_main:
            self._bar = tqdm(total=self.total_steps, initial=self.step, desc="train", dynamic_ncols=True)
        for line in self.plan.describe():  # the start lines go above the bar (through it), never over it
            self._console_write(line)
        if self.eval_dataset is not None:
            self._console_write(f"evaluating {self.eval_dataset.path} after step {self.total_steps}"
                                + (f" and every {cfg.eval.eval_steps} steps" if cfg.eval.eval_steps else ""))
        first_step, started = self.step, time.perf_counter()
        feed = open_feed(self.sampler, self._build_micro_batch, self.step, end, cfg.data.prefetch_micro_batches)
        try:
            while self.step < end:
                plan = feed.next_plan()
                record = self.train_step(plan, feed)
                self.step += 1
                if self._evaluates_after(self.step):
                    record.update(self.evaluate())
                records.append(record)
                self.metrics.log(record, progress=None if self._bar is not None else
                                 step_progress(self.step, self.total_steps, first_step, time.perf_counter() - started))
                if self._bar is not None:
                    self._bar.update(1)
                    self._bar.set_postfix(loss=f"{record['loss']:.4f}")
                if cfg.checkpoint.save_steps and self.step % cfg.checkpoint.save_steps == 0 and self.step < end:
                    self.save()
        finally:
            feed.close()
            if self._bar is not None:
                self._bar.close()
            self._bar = None
        if self._saved_step != self.step:  # the end of the run, or the stop point of an interrupted one
            self.save()
        if self.step < self.total_steps:
            self.console(f"stopped at step {self.step} of {self.total_steps} (stop_at_step={stop_at_step}); "
                         f"checkpoint: {self._saved_path}")
        if self.step >= self.total_steps:
            path = self.export(cfg.out / FINAL_DIR)
            self.console(f"exported the final model to {path}")
            if cfg.logging.plot and self.mesh.is_main:
                png = plot_losses(cfg.checkpoint.output_dir)
                if png:
                    self.console(f"loss curves: {png}")
        self.console(run_summary(records, time.perf_counter() - started, self._saved_path, cfg.out / FINAL_DIR
                                 if self.step >= self.total_steps else None, process_age()))
        self.metrics.close()
        return records
