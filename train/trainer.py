"""The training loop: packed rows -> exact step loss -> the engine's optimizer step (DeepSpeed, FSDP2 or plain
torch: train/engines/).

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

import logging
import math
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data.shards.images import ImageLoader
from common.config import ConfigError
from data.shards.chat_templates import data_chat_template
from train.plan.attention import TREE_SP_REFUSAL, plan_attention, plan_sp_layout
from train.plan.startup import plan_memory
from train.steps.batch import make_batch, step_totals
from train.checkpoint import (
    FINAL_DIR,
    CheckpointError,
    check_same_model,
    checkpoint_root,
    choose_checkpoint,
    data_mismatch,
    dataset_identity,
    describe_resume,
    discard_checkpoints,
    export_directory,
    from_main,
    layout_mismatch,
    load_rng,
    load_trainer_state,
    model_identity,
    remove_stale_temporaries,
    reshard_rng_seed,
    resume_candidates,
    save_checkpoint,
)
from train.model.composite import copy_processor_files, processor_dir
from train.model.support import check_family, check_media_support
from train.config.sections import TrainConfig
from train.preflight import Preflight, preflight
from train.steps.sampler import MicroBatchPlan, StepPlan, StepSampler
from train.steps.feed import InlineFeed, PrefetchFeed, open_feed
from train.distributed import Mesh, all_reduce_sum, build_mesh, init_distributed
from train.engines.build import EngineSetup, start_process_group
from train.engines.engine import Engine, saved_with
from train.engines.schedule import lr_lambda_factory, param_groups
from train.model.media import SELF_CHECK_MAX_TOKENS
from train.model.media_batch import dataset_media_kinds
from train.metrics import EvalProgress, MetricsLogger, plot_losses, process_age, run_summary, step_progress, truncate_log
from train.model.experts import (apply_expert_parallel, describe as describe_experts, describe_experts_kernel,
                                  set_experts_kernel)
from train.model.moe import real_tokens, resolve_router_aux
from train.nonfinite import SKIPPED, NonFiniteError, nonfinite_tensors, stop_message
from train.model.packed import PackedCausalLM, build_lm
from train.model.patches.rope import switch_points as rope_switch_points
from train.model.patches.tiled_mlp import describe_tiling
from train.row import queued_copy

logger = logging.getLogger("packsft.train")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, cfg: TrainConfig, console=None, checked: Preflight | None = None):
        """`checked`: what train/preflight.py found (python -m train runs it before the heavy imports); None: it
        runs here."""
        init_distributed()
        start_process_group(cfg)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.checked = checked = checked or preflight(cfg, world)  # every check before the model loads
        self.engine_setup = setup = EngineSetup(cfg)  # what the engine decides before the model (DeepSpeed's dict)
        family_warnings = []  # said below, once the main rank is known
        self.family = check_family(checked.model_config, cfg.model.self_check, family_warnings.append)  # refused: here
        _seed_everything(cfg.steps.seed)

        from train.steps.online import open_train_dataset

        self.dataset = open_train_dataset(cfg.data.data_path, cfg.data.online_max_length, seed=cfg.steps.seed, verify=cfg.data.verify_data)
        row_length = int(self.dataset.meta.get("max_length") or int(np.max(self.dataset.row_n_tokens)))
        # SP degree (auto), checkpointing per layer, the MLP tile, the offload's host memory: once, before any weight
        self.memory = plan_memory(cfg, checked.model_config, world, row_length, setup.offloads_optimizer,
                                  media_kinds=dataset_media_kinds(self.dataset))  # the towers' activations too
        self.cfg = cfg = self.memory.config  # the config as planned (sequence_parallel_size auto resolved)
        self.sp_layout = plan_sp_layout(cfg.parallel, cfg.launch, checked.model_config)  # before the mesh
        if "tree_spans" in self.dataset.token_fields and self.sp_layout is not None:
            raise ConfigError(f"data_path {cfg.data.data_path}: {TREE_SP_REFUSAL}")
        self.mesh: Mesh = build_mesh(cfg.parallel.sequence_parallel_size,
                                     ulysses_size=self.sp_layout.ulysses_size if self.sp_layout else 1,
                                     ep_size=cfg.parallel.expert_parallel_size)
        self.device = self.mesh.device
        self.console = console or (print if self.mesh.is_main else (lambda *_: None))
        self.progress_bar = sys.stderr.isatty()  # redirected output: plain step lines, no tqdm fragments
        if not self.progress_bar:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars
        self.image_loader = ImageLoader.of(self.dataset.meta)  # None for text-only data
        if checked.tokenizer_path is None:  # none named anywhere (a named one must exist)
            self._warn("no tokenizer (tokenizer_path, model_path, the shards' meta.json): final/ will be exported "
                       "without one")
        self.eval_dataset = self._open_eval_set()
        self.categories = {int(k): v for k, v in (self.dataset.meta.get("categories") or {}).items()}
        self.num_categories = max([0, *self.categories]) + 1
        self.structure = "block_ids" in self.dataset.token_fields or "tree_spans" in self.dataset.token_fields
        self.sampler = StepSampler(
            self.dataset, self.mesh.dp_size, self.mesh.dp_rank, cfg.steps.grad_accum, cfg.steps.micro_batch_rows, cfg.steps.seed,
            balance=cfg.data.balance_dp,
        )
        self.total_steps = self.sampler.total_steps(cfg.steps.max_steps, cfg.steps.num_epochs)
        self.warmup_steps = (
            cfg.optim.warmup_steps if cfg.optim.warmup_steps is not None else int(cfg.optim.warmup_ratio * self.total_steps)
        )
        for warning in family_warnings:
            self._warn(warning)
        # idem: how the model trains on the data's images / videos / audios (None for text data), or why it cannot
        self.media_kinds = dataset_media_kinds(self.dataset, self.eval_dataset)
        self.media_inputs = check_media_support(checked.model_config, self.media_kinds) if self.media_kinds else None
        self.model_identity = model_identity(checked.model_config, cfg.lora)
        setup.before_weights_load()
        self.lm = build_lm(cfg, checked.model_config, setup.dtype, self.memory)
        # expert parallelism: this rank's part of every MoE layer's experts (train/model/experts.py)
        self.experts = apply_expert_parallel(self.lm, checked.model_config, self.mesh, cfg.moe.moe_kernel)
        # without it: moe_kernel chooses transformers' experts_implementation (the same kernel at every degree)
        self.experts_kernel = (set_experts_kernel(self.lm, checked.model_config, cfg.moe.moe_kernel)
                               if self.experts is None else None)
        self.plan = plan_attention(cfg.model, cfg.parallel, self.sp_layout, self.mesh, self.lm, self.structure)
        self.router_aux, router_warning = resolve_router_aux(self.lm, cfg.moe.output_router_logits,
                                                             cfg.moe.router_aux_loss_coef)
        if router_warning:
            self._warn(router_warning)
        # the compiled loss chunk: measured 1.18x the step of the eager chunk on an H100 (BENCHMARKS.md); auto keeps
        # the CPU on the eager loop (inductor's C++ build there costs more than it saves)
        self.compiles_loss = cfg.model.compile_loss is True or (cfg.model.compile_loss == "auto"
                                                                and self.device.type == "cuda")
        self.model = PackedCausalLM(self.lm, cfg.steps.loss_chunk_size, self.num_categories, zero3=setup.zero3,
                                    router_aux=self.router_aux, fused_loss=self.compiles_loss,
                                    media=self.media_inputs, media_kinds=self.media_kinds)
        if cfg.model.self_check:
            self._self_check()
        self.lr_factor = lr_lambda_factory(self.total_steps, self.warmup_steps, cfg.optim.schedule, cfg.optim.min_lr_ratio)
        self.engine: Engine = setup.build(cfg, self.model, lambda: param_groups(self.model, cfg.optim.weight_decay),
                                          self.lr_factor, self.mesh)
        self.optimizer, self.scheduler = self.engine.optimizer, self.engine.scheduler
        self.step = 0
        self._maybe_resume()  # before the logger opens log.jsonl: resuming truncates it to the checkpoint's step
        self.metrics = MetricsLogger(cfg.checkpoint.output_dir, self.mesh.is_main, cfg.logging.log_backends, cfg.to_dict(),
                                     cfg.logging.wandb_project, write_console=self._console_write)

    # ------------------------------------------------------------------ setup
    def _open_eval_set(self):
        """The eval set, opened (memory-mapped) once at start and held for the whole run, or None: every evaluation
        reads the rows checked at start, even if its folder is removed or rewritten meanwhile (it was looked up
        again at every evaluation, and a folder deleted mid-run silently ended the evaluations)."""
        from data.shards.dataset import PackedDataset

        path = self.checked.eval_path
        return None if path is None else PackedDataset(path, verify=self.cfg.data.verify_data)

    def _self_check(self) -> None:
        """Packed path vs the model's own unpacked eager forward on a few sequences of the data, same weights:
        training stops if they differ (a family or feature PackSFT does not reproduce). See train/model/self_check.py."""
        from train.model.self_check import SelfCheckError, compare_packed_with_reference, self_check_sequences

        if self.engine_setup.partitioned_load:
            self.console("self-check skipped: ZeRO-3 loads the weights partitioned (self_check covers ZeRO-0/1/2)")
            return
        switch_points = rope_switch_points(self.lm.config.get_text_config())
        seqs, images = self_check_sequences(self.dataset, switch_points=switch_points), None
        if self.model.media is not None:  # whole sequences of the first rows, each with its media
            seqs, images = [], []
            for row in range(min(len(self.dataset), 8)):
                if len(seqs) < 4:  # a filler's batch: the row's own totals (its weights are not used)
                    more, their = self.model.media.sequences(self._micro_batch(None, [row], True), 4 - len(seqs),
                                                               SELF_CHECK_MAX_TOKENS)
                    seqs, images = seqs + more, images + their
        if len(seqs) < 2:
            self.console("self-check skipped: " + (
                "the data has no sequence of 2 tokens or more" if self.model.media is None else
                f"the first {min(len(self.dataset), 8)} rows hold fewer than 2 sequences of 2 to "
                f"{SELF_CHECK_MAX_TOKENS:,} tokens, which it checks whole (images are never cut; a "
                "longer sequence's eager reference forward would hold its full attention and logits)"))
            return
        start = time.perf_counter()
        self.model.to(self.device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.engine_setup.autocast_bf16 else None
        result = compare_packed_with_reference(self.model, seqs, self.plan.packed, gradient_probe=True,
                                              autocast=autocast, media=images)
        if not result.ok:
            raise SelfCheckError(
                f"start-up self-check failed for model family {self.family!r}: on {len(seqs)} sequences of the data, "
                f"the packed path differs from the model's own unpacked forward: {result.describe()}. PackSFT does "
                "not reproduce this model on packed rows; do not train it packed (self_check=false skips this check "
                "at your own risk)"
            )
        tree = ""
        if "tree_spans" in self.dataset.token_fields and self.sp_layout is None:
            from train.model.self_check import compare_tree_with_reference, self_check_tree

            cut = self_check_tree(self.dataset)
            if cut is not None:  # a branching tree through the structured kernels vs transformers on its paths
                checked = compare_tree_with_reference(self.model, *cut, self.plan.train, gradient_probe=True,
                                                      autocast=autocast)
                if not checked.ok:
                    raise SelfCheckError(
                        f"start-up self-check failed for model family {self.family!r}: on a prefix tree of the data "
                        f"({len(cut[0])} tokens), the tree attention differs from the model's own unpacked forward of "
                        f"each root-to-leaf path: {checked.describe()}")
                tree = (f"; tree = its paths on {len(cut[0])} tokens (loss difference {checked.loss_error:.1e}, "
                        f"gradient difference {checked.grad_error:.1e})")
        rope = ""
        if switch_points:
            longest = max(seq.numel() for seq in seqs)
            rope = (f"; rope switch point {switch_points[-1]}: " + (
                f"sequences of at most {switch_points[0]} tokens and one of {longest}" if longest > switch_points[-1]
                else "no sequence of the data is longer, so its long side never trains"))
        with_images = sum(image is not None for image in images or ())
        self.console(f"self-check: packed = unpacked on {len(seqs)} sequences"
                     + (f" ({with_images} with media: the towers, their features and positions)"
                        if images is not None else "") + " (loss difference "
                     f"{result.loss_error:.1e}, gradient difference {result.grad_error:.1e}{rope}{tree}) in "
                     f"{time.perf_counter() - start:.2f} s")

    def _warn(self, text: str) -> None:
        if self.mesh.is_main:
            logger.warning(text)

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
    def _micro_batch(self, plan: StepPlan, rows: list[int], filler: bool) -> dict:
        # a filler (a rank with no row left in this step: forward/backward for the collectives, contributes 0) is
        # not part of the step's totals, which may be smaller than its own: build it with its own, then zero it
        totals = step_totals(self.dataset, rows) if filler else plan.totals
        batch = make_batch([self.dataset[r] for r in rows], totals, self.cfg.steps.loss_reduction, structure=self.structure,
                           images=self.image_loader)
        if filler:
            batch["targets"] = torch.full_like(batch["targets"], -100)
            batch["weights"] = torch.zeros_like(batch["weights"])
        return batch

    def forward_micro_batch(self, batch: dict, filler: bool = False):
        """(weighted_sum, cat_loss_sum, cat_count, router_aux) of this rank's part of one full micro-batch;
        router_aux: this rank's share of the micro-batch's router aux term (PackedCausalLM), None without one."""
        media = self.model.row_media(batch)  # on the whole row, before sequence-parallel sharding
        batch, attn = self.plan.context(batch)
        dev = self.device

        def to_dev(tensor: torch.Tensor) -> torch.Tensor:  # queued (pinned, non-blocking) on a GPU
            return queued_copy(tensor, dev)

        module = self.engine.module
        router = {}
        if self.router_aux is not None:
            router["router_tokens"] = to_dev(real_tokens(batch["input_ids"].numel(), attn.sp, filler))
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.engine.autocasts else nullcontext()
        with autocast:
            out = module(
                to_dev(batch["input_ids"]).reshape(1, -1),
                to_dev(batch["position_ids"]).reshape(1, -1),
                to_dev(batch["targets"]).reshape(-1),
                to_dev(batch["weights"]).reshape(-1),
                to_dev(batch["target_categories"]).reshape(-1),
                attn,
                media=media,
                **router,
            )
        return out if self.router_aux is not None else (*out, None)

    # ------------------------------------------------------------------ one optimizer step
    def _build_micro_batch(self, plan: StepPlan, micro: MicroBatchPlan) -> dict:
        return self._micro_batch(plan, micro.rows, micro.filler)

    def train_step(self, plan: StepPlan, feed: InlineFeed | PrefetchFeed | None = None) -> dict:
        """One optimizer step; its record's `loss` is the LM loss, `aux_loss` (MoE) the router aux term, which the
        step optimises too. `feed`: where its micro-batches come from (train/steps/feed.py; None: built here), and
        `batch_wait_s` in the record how long the step waited for them."""
        start = time.perf_counter()
        feed = feed or InlineFeed(self.sampler, self._build_micro_batch, plan.step + 1, current=plan)
        waited = feed.waited
        lr = self.scheduler.get_last_lr()[0]  # the lr this step applies (DeepSpeed steps the scheduler itself)
        C = self.num_categories
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
        for cid, name in sorted(self.categories.items()):
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
        if self.router_aux is not None:
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
        from train.steps.batch import StepTotals

        ds = self.eval_dataset
        totals = StepTotals(int(np.sum(ds.row_n_loss_tokens)), int(np.sum(ds.row_n_trained_turns)),
                            int(np.sum(ds.row_n_samples)))
        mine = list(range(self.mesh.dp_rank, len(ds), self.mesh.dp_size))
        n_iter = math.ceil(len(ds) / self.mesh.dp_size)
        was_training = self.model.training
        self.model.eval()
        C = self.num_categories
        local = torch.zeros(1 + 2 * C, dtype=torch.float64)  # [loss, cat_loss_sum[C], cat_count[C]], as train_step
        progress = EvalProgress(len(ds), self._console_write, bar=self.progress_bar, enabled=self.mesh.is_main)
        for k in range(n_iter):
            row = mine[k] if k < len(mine) else 0
            batch = make_batch([ds[row]], totals, "token", structure=self.structure, images=self.image_loader)
            if k >= len(mine):
                batch["targets"].fill_(-100)
                batch["weights"].zero_()
            weighted, cat_sum, cat_count = self.forward_micro_batch(batch, filler=k >= len(mine))[:3]
            local[0] += weighted.double().cpu()
            local[1:1 + C] += cat_sum.double().cpu()
            local[1 + C:] += cat_count.double().cpu()
            progress.update(min(len(ds), (k + 1) * self.mesh.dp_size))
        progress.close()
        self.model.train(was_training)
        stats = all_reduce_sum(local.to(self._comm_device())).cpu()
        return {"eval_loss": float(stats[0]), "eval_category_loss": {
            name: float(stats[1 + cid] / stats[1 + C + cid])
            for cid, name in sorted(self.categories.items()) if cid > 0 and stats[1 + C + cid] > 0}}

    def _evaluates_after(self, step: int) -> bool:
        """With an eval set: every eval_steps steps and after the last step."""
        if self.eval_dataset is None:
            return False
        return step == self.total_steps or bool(self.cfg.eval.eval_steps) and step % self.cfg.eval.eval_steps == 0

    # ------------------------------------------------------------------ checkpoints and export
    def _trainer_state(self) -> dict:
        epoch, in_epoch = self.sampler.position(self.step)
        return {"step": self.step, "epoch": epoch, "step_in_epoch": in_epoch, **self._step_layout(),
                "seed": self.cfg.steps.seed, "world_size": self.mesh.world_size, "engine": self.engine.name,
                "expert_parallel_size": self.mesh.ep_size, **self._expert_record(),
                "deepspeed_stage": self.cfg.deepspeed.stage, "data": self._data_identity(),
                "model": self.model_identity}

    def _expert_record(self) -> dict:
        """Under expert parallelism on the plain engine: the expert parameters' names (a resume on another degree
        cuts them anew)."""
        names = getattr(self.engine, "expert_parameter_names", None)
        return {"expert_parameters": names()} if self.mesh.ep_size > 1 and names is not None else {}

    def _step_layout(self) -> dict:
        """What decides the rows and the lr of every step (a resume with another global batch or step count is
        refused), and how a step is split over ranks and micro-batches (a resume may change that)."""
        cfg = self.cfg
        return {"total_steps": self.total_steps, "rows_per_step": self.sampler.rows_per_step,
                "dp_size": self.mesh.dp_size, "sp_size": self.mesh.sp_size, "grad_accum": cfg.steps.grad_accum,
                "micro_batch_rows": cfg.steps.micro_batch_rows, "max_steps": cfg.steps.max_steps,
                "num_epochs": cfg.steps.num_epochs}

    def _data_identity(self) -> dict:
        return dataset_identity(self.cfg.data.data_path, len(self.dataset))

    def _state_bytes_estimate(self) -> int:
        """Size of a first checkpoint: the weights plus two fp32 Adam moments per trainable parameter."""
        total = 0
        for p in self.model.parameters():
            numel = getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions: the full size
            total += numel * p.element_size() + (8 * numel if p.requires_grad else 0)
        return total

    def save(self) -> Path:
        def save_fn(tmp: Path) -> None:
            self.engine.save(tmp, self.mesh.is_main)

        path = save_checkpoint(self.cfg.checkpoint.output_dir, self.step, self.mesh.rank, save_fn, self._trainer_state(),
                               self.cfg.checkpoint.save_total_limit, estimate_bytes=self._state_bytes_estimate())
        self._saved_step, self._saved_path = self.step, path
        return path

    def _maybe_resume(self) -> None:
        if self.mesh.is_main:
            for stale in remove_stale_temporaries(self.cfg.checkpoint.output_dir):  # a killed save's partial files
                logger.warning("removed %s, left by a save that did not finish", stale)
        candidates = resume_candidates(self.cfg.checkpoint.resume, self.cfg.checkpoint.output_dir)
        if not candidates:
            if self.mesh.is_main:  # a new run: no records of an earlier run in the same output_dir
                truncate_log(self.cfg.checkpoint.output_dir, 0)
                if self.cfg.checkpoint.resume == "none" and self.cfg.checkpoint.overwrite_output_dir:
                    discard_checkpoints(self.cfg.checkpoint.output_dir)
            if self.cfg.checkpoint.resume == "latest":
                self.console(f"resume=latest: no checkpoint in {self.cfg.checkpoint.output_dir}, starting from step 0")
            return
        path = choose_checkpoint(candidates, self.cfg.checkpoint.resume_corrupt, warn=self._warn)
        state = load_trainer_state(path)
        mismatch = data_mismatch(state.get("data"), self._data_identity())
        if mismatch:
            if self.cfg.checkpoint.resume_data_mismatch == "error":
                raise CheckpointError(
                    f"resume from {path}: {mismatch}; resume with the same data_path, or set "
                    "resume_data_mismatch=allow to continue on the new data (the sampler order then differs)"
                )
            self._warn(f"resume from {path}: {mismatch} (resume_data_mismatch=allow: continuing)")
        other_layout = layout_mismatch(state, self._step_layout(), compare_steps=not mismatch)
        if other_layout:
            raise CheckpointError(
                f"resume from {path}: {other_layout}: the resumed run would train other rows than the run it continues "
                "(some twice, some never); resume with the checkpoint's value (any dp x grad_accum x micro_batch_rows "
                "giving its rows per step), or start a new run (another output_dir, or overwrite_output_dir=true with "
                "resume=none)"
            )
        check_same_model(path, state, self.model_identity, self.cfg.model)
        saved_ep = int(state.get("expert_parallel_size", 1))
        experts_from = None
        if saved_ep != self.mesh.ep_size and self.engine.name == "plain":  # FSDP2's DCP holds the experts whole
            self.engine.check_saved_with(path)  # a checkpoint of another engine: named as such
            names = (state.get("expert_parameters") if saved_ep > 1 else
                     getattr(self.engine, "expert_parameter_names", lambda: None)())
            if not names:
                raise CheckpointError(
                    f"resume from {path}: saved with expert_parallel_size={saved_ep}, this run has "
                    f"expert_parallel_size={self.mesh.ep_size}, and its trainer_state.json does not record which "
                    f"parameters were split (expert_parameters), so its parts cannot be cut anew; resume with "
                    f"expert_parallel_size={saved_ep}")
            experts_from = (saved_ep, names)
        saved_world = state.get("world_size")
        resharded = saved_world is not None and int(saved_world) != self.mesh.world_size
        if resharded and "rows_per_step" not in state:
            raise RuntimeError(
                f"{path} was saved by {saved_world} processes, this run has {self.mesh.world_size}, and the checkpoint "
                "predates the record of its global batch (PackSFT's resume on another number of processes needs "
                "it); resume with the same number of processes"
            )
        self.engine.load(path, resharded_from=int(saved_world) if resharded else None, experts_from=experts_from)
        self.step = int(state["step"])
        if resharded:  # rows move between ranks: no saved stream belongs to a new rank (dropout off: no effect)
            _seed_everything(reshard_rng_seed(self.cfg.steps.seed, self.step, self.mesh.rank))
        else:
            load_rng(path, self.mesh.rank)
        if path.resolve().parent == checkpoint_root(self.cfg.checkpoint.output_dir).resolve() and not path.name.startswith("."):
            # this step's checkpoint is already in output_dir (not a moved-aside copy)
            self._saved_step, self._saved_path = self.step, path
        if self.mesh.is_main:
            truncate_log(self.cfg.checkpoint.output_dir, self.step)
        change = None if "rows_per_step" not in state else describe_resume(
            {**state, "engine": state.get("engine", saved_with(path))},  # older checkpoints: from their files
            {**self._step_layout(), "world_size": self.mesh.world_size, "engine": self.engine.name,
             "deepspeed_stage": self.cfg.deepspeed.stage, "expert_parallel_size": self.mesh.ep_size})
        self.console(f"resumed from {path} at step {self.step}" + (f"; {change}" if change else ""))

    def export(self, out_dir: Path) -> Path:
        """HF format (safetensors + config + tokenizer), loadable with AutoModelForCausalLM.from_pretrained.
        With LoRA: the adapter (train/model/lora.py), plus the merged model in `merged/` when lora_merge_on_save."""
        state = self.engine.export_state(self.mesh.is_main)  # collective
        error = None
        if self.mesh.is_main:
            try:
                self._refuse_nonfinite_export(out_dir, state)
                self._write_export(out_dir, state)
            except CheckpointError as exc:  # a full disk: every rank stops with rank 0's message
                error = str(exc)
        error = from_main(error)  # also the barrier after rank 0's write
        if error:
            raise CheckpointError(error)
        return out_dir

    def _refuse_nonfinite_export(self, out_dir: Path, state: dict | None) -> None:
        """A model with inf / nan weights is never exported (state None: LoRA, whose export reads the model)."""
        tensors = state.items() if state is not None else self.lm.state_dict().items()
        bad, total = nonfinite_tensors(tensors)
        if bad:
            names = ", ".join(name.removeprefix("lm.") for name in bad[:5]) + (", ..." if len(bad) > 5 else "")
            raise CheckpointError(
                f"export directory {out_dir}: refused: {len(bad)} of {total} tensors hold inf or nan ({names}): the "
                "training diverged; nothing was written. Lower lr and resume from a checkpoint before the divergence"
            )

    def _write_export(self, out_dir: Path, state: dict | None) -> None:
        prefix = "lm."
        lm_state = None if state is None else {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        tok_path = self.checked.tokenizer_path  # checked at start (train/preflight.py)
        tokenizer = None
        if tok_path:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tok_path)
            tokenizer.chat_template = data_chat_template(self.dataset.meta) or tokenizer.chat_template  # the data's
        processor = processor_dir(self.lm.config, self.cfg.model.model_path, tok_path)  # a composite's image processor
        if self.cfg.lora.lora_rank > 0:
            from train.model.lora import save_lora

            save_lora(self.lm, out_dir, merge=self.cfg.lora.lora_merge_on_save, tokenizer=tokenizer, is_main=True,
                      state_dict=lm_state, processor_dir=processor)
            return
        self.lm.config.use_cache = True  # generation wants the cache; training turned it off
        try:
            with export_directory(out_dir) as tmp:
                self.lm.save_pretrained(tmp, state_dict=lm_state, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if processor is not None:
                    copy_processor_files(processor, tmp)
        finally:
            self.lm.config.use_cache = False

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
        # the start lines go above the bar (through it), never over it
        self._console_write(self.plan.describe())
        self._console_write(
            f"training {self.total_steps} steps: world {self.mesh.world_size} (dp {self.mesh.dp_size} x sp "
            f"{self.mesh.sp_size}" + (f" [{self.memory.sp_reason}]" if self.memory.sp_reason else "")
            + f"), {self.sampler.rows_per_step} rows/step, {self.engine.describe()}, "
            + (f"{describe_experts(self.experts, self.mesh.ep_size)}, " if self.experts else "")
            + (f"{describe_experts_kernel(self.experts_kernel)}, " if self.experts_kernel else "")
            + f"loss {cfg.steps.loss_reduction}, "
            f"activation checkpointing {self.memory.checkpointing_reason}"
            + (", compiled decoder layers" if cfg.model.compile_layers else "")
            + (", compiled loss chunks" if self.compiles_loss else "") + (", Liger kernels" if cfg.model.liger else "")
            + (f", {describe_tiling(self.lm)}" if cfg.model.tiled_mlp else "")
            + (f", {self.model.media.describe(self.lm)}" if self.model.media is not None else "")
            + (", checkpointed inputs offloaded to host memory" if cfg.model.activation_offload and self.memory.checkpointing
               else "")
            + (f", router aux loss (coef {self.router_aux.coef:g}, {self.router_aux.num_experts} experts, top "
               f"{self.router_aux.top_k})" if self.router_aux is not None else "")
        )
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
