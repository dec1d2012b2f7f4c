"""Typed trainer configuration: one YAML file plus `key=value` overrides (`a.b=value` for sections).

`TrainConfig.validate(world_size)` checks every invariant before the model is loaded, so a bad path, a vocabulary
mismatch or an impossible parallel layout fails in a second with a message naming the field, not after minutes of
model loading.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import yaml

from common.config import (
    ConfigError,
    apply_overrides,
    check_keys,
    check_override_values,
    from_dict,
    key_help_lines,
    key_tree,
    pretrained_dir,
    relative_note,
    to_dict,
)

logger = logging.getLogger(__name__)

# other frameworks' names for trainer keys (HF TrainingArguments, LLaMA-Factory, ...): the "did you mean" of an
# unknown key, which no spelling distance finds
TRAIN_KEY_ALIASES = {
    "learning_rate": "lr", "gradient_accumulation_steps": "grad_accum", "per_device_train_batch_size": "micro_batch_rows",
    "batch_size": "micro_batch_rows", "num_train_epochs": "num_epochs", "epochs": "num_epochs",
    "max_train_steps": "max_steps", "model_name_or_path": "model_path", "lr_scheduler_type": "schedule",
    "lr_scheduler": "schedule", "warmup": "warmup_steps", "output_path": "output_dir", "dataset": "data_path",
    "dataset_path": "data_path", "train_data_path": "data_path", "eval_dataset": "eval_data_path",
    "report_to": "log_backends", "resume_from_checkpoint": "resume", "lora_r": "lora_rank",
    "lora_target_modules": "target_modules", "gradient_clipping": "max_grad_norm",
}
MODEL_SOURCES = ("model_path", "model_config")  # exactly one is set


@dataclass
class DeepSpeedSection:
    """stage None: no DeepSpeed (plain torch optimizer, gradients summed over ranks with all_reduce)."""

    stage: Literal[0, 1, 2, 3] | None = None  # ZeRO stage; null: no DeepSpeed (plain torch AdamW)
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (stage 2 or 3)
    offload_param: bool = False  # parameters too (stage 3 only)
    template: str | None = None  # a JSON file (e.g. configs/deepspeed/zero2.json) whose keys are the defaults
    overrides: dict = field(default_factory=dict)  # raw keys merged last into the built DeepSpeed dict


@dataclass
class LaunchSection:
    """Settings `train.sh` passes to `accelerate launch` (multi-node: one launch per machine)."""

    num_processes: int = 1  # total over all machines
    num_machines: int = 1  # machines (one `sh train.sh` per machine)
    machine_rank: int = 0  # this machine's index, 0 .. num_machines-1
    main_process_ip: str | None = None  # rank 0's address (required with num_machines > 1)
    main_process_port: int = 29500  # rank 0's port


@dataclass
class TrainConfig:
    data_path: str  # a packed dataset directory (data.shards format)
    output_dir: str  # logs, checkpoints/, final/ (the exported model)
    model_path: str | None = None  # pretrained HF model: a local directory or a Hub id (org/name), weights loaded
    model_config: str | None = None  # or: an HF config.json, random init (the CPU example)
    tokenizer_path: str | None = None  # dir or Hub id, exported with the model; default: model_path, then the shards'
    # packed eval set (token-mean loss, overall and per category); null: the data pipeline's eval split beside
    # data_path (<data_path>/../eval/packed, from eval_size) when there is one; none: no evaluation
    eval_data_path: str | None = None
    verify_data: Literal["full", "rows", "off"] = "rows"  # shard checks: per-row crc32 on read, + file hashes at start, none
    max_steps: int | None = None  # optimizer steps; null: num_epochs over the data
    num_epochs: int = 1  # passes over the data when max_steps is null
    micro_batch_rows: int = 1  # packed rows concatenated into one micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step per data-parallel rank
    lr: float = 1e-5  # peak learning rate (AdamW), > 0
    warmup_steps: int | None = None  # linear warmup steps; null: warmup_ratio * total steps
    warmup_ratio: float = 0.0  # warmup as a fraction of the total steps, in [0, 1)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # lr decay after warmup
    min_lr_ratio: float = 0.0  # cosine / linear decay to lr * min_lr_ratio
    weight_decay: float = 0.0  # AdamW, >= 0; not applied to 1-D parameters and norms
    adam_beta1: float = 0.9  # AdamW, in [0, 1)
    adam_beta2: float = 0.95  # AdamW, in [0, 1)
    adam_eps: float = 1e-8  # AdamW, > 0
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0: no clipping
    bf16: bool = False  # bf16 weights (DeepSpeed) or autocast; GPU only
    # activation checkpointing: true | false | auto (GPU: on when the estimated memory of a micro-batch without it
    # exceeds the free memory, train/memory_plan.py; CPU: on when the rows are at least `checkpointing_min_length` long)
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    checkpointing_min_length: int = 8192  # tokens per rank from which gradient_checkpointing=auto turns on (CPU)
    compile_layers: bool = False  # torch.compile each decoder layer (the attention call stays eager)
    # torch.compile the lm-head chunk's softmax, loss and gradient into one kernel (train/loss.py); auto: on CUDA
    compile_loss: bool | Literal["auto"] = "auto"
    liger: bool = False  # Liger-Kernel's fused RMSNorm / SwiGLU / RoPE (needs CUDA and liger-kernel)
    tiled_mlp: bool = False  # run each decoder layer's feed-forward over the row in tiles of tokens (long rows)
    tiled_mlp_tile: int | None = None  # tokens per tile of tiled_mlp; null: chosen from the intermediate size
    # keep the checkpointed layer inputs in pinned host memory until backward (needs gradient_checkpointing)
    activation_offload: bool = False
    seed: int = 42  # data order, online packing plan, random init
    save_steps: int = 0  # checkpoint every N steps; 0: only the final checkpoint
    save_total_limit: int = 2  # resumable checkpoints kept
    eval_steps: int = 0  # with an eval set: evaluate every N steps and after the last step; 0: after the last step only
    loss_reduction: Literal["token", "turn", "sample"] = "token"  # mean over tokens, turns or samples of a step
    loss_chunk_size: int = 4096  # tokens per lm-head chunk
    attn_backend: Literal["auto", "flash_varlen", "torch_varlen", "flex", "sdpa"] = "auto"  # attention kernel over packed sequences (train/attention.py)
    sequence_parallel_size: int = 1  # ranks sharing one row
    sp_backend: Literal["auto", "torch", "llama3", "zigzag", "ulysses"] = "auto"  # sequence-parallel attention (auto: by heads and placement)
    sp_ulysses_size: int | None = None  # Ulysses degree inside the sp group (< sequence_parallel_size: the hybrid); null: chosen
    self_check: bool = True  # before step 1: a few sequences packed vs the model's own unpacked forward must agree
    log_backends: list[str] = field(default_factory=list)  # "tensorboard", "wandb" (offline)
    wandb_project: str = "packsft"  # wandb project (offline mode)
    resume: str = "none"  # none | latest | a checkpoint directory
    resume_corrupt: Literal["fallback", "error"] = "fallback"  # a checkpoint failing its manifest: use the previous one
    resume_data_mismatch: Literal["error", "allow"] = "error"  # data_path differs from the checkpoint's data
    overwrite_output_dir: bool = False  # resume=none into an output_dir with checkpoints: remove PackSFT's checkpoints, start over
    stop_at_step: int | None = None  # stop (with a checkpoint) after this step, as a time-limited job would
    # a step whose loss or gradient norm is inf / nan: stop there (the last checkpoint stays finite, nothing is
    # exported) or skip_step: skip its update and train on (plain torch optimizer only)
    nonfinite: Literal["stop", "skip_step"] = "stop"
    tokenizer_mismatch: Literal["warn", "error"] = "error"  # shards' tokenizer hash vs the model's tokenizer
    plot: bool = True  # loss curves PNG at the end
    # LoRA (train/lora.py); lora_rank 0 = full fine-tuning
    lora_rank: int = 0
    lora_alpha: float = 16.0  # LoRA scaling alpha / rank, > 0
    lora_dropout: float = 0.0  # LoRA dropout, in [0, 1)
    target_modules: list[str] = field(  # LoRA: module name suffixes, or all-linear
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    lora_merge_on_save: bool = True  # LoRA: also export the merged model to final/merged/
    # mixture-of-experts router load-balancing loss (train/moe.py): true | false | null (null: the model config's
    # output_router_logits); logged as aux_loss, added to the optimised objective
    output_router_logits: bool | None = None
    router_aux_loss_coef: float | None = None  # weight of the router aux loss, >= 0; null: the model config's
    balance_dp: bool = False  # train/balance.py: balance the step's rows over dp ranks by tokens
    online_max_length: int | None = None  # data_path is a tokenized dataset packed on the fly (train/online.py)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)  # DeepSpeed ZeRO settings
    launch: LaunchSection = field(default_factory=LaunchSection)  # accelerate launch layout (train.sh)

    # ------------------------------------------------------------------ derived
    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    def eval_path(self) -> str | None:
        """The eval set: eval_data_path, else the eval split the data pipeline wrote beside data_path (None with
        `eval_data_path: none`, or without either)."""
        if self.eval_data_path == "none":
            return None
        if self.eval_data_path:
            return self.eval_data_path
        beside = pipeline_eval_split(self.data_path)
        return str(beside) if (beside / "meta.json").is_file() else None

    def checkpointing_enabled(self, row_length: int) -> bool:
        if self.gradient_checkpointing == "auto":
            return row_length >= self.checkpointing_min_length
        return bool(self.gradient_checkpointing)

    @property
    def uses_deepspeed(self) -> bool:
        return self.deepspeed.stage is not None

    def to_dict(self) -> dict:
        return to_dict(self)

    # ------------------------------------------------------------------ invariants
    def validate(self, world_size: int = 1) -> None:
        """Every check that needs no model weights; raises ConfigError naming the field."""
        self.validate_output_dir()
        self.validate_values(world_size)
        self.validate_paths()
        self.validate_data()

    def validate_ulysses(self) -> None:
        """sp_ulysses_size against sequence_parallel_size and sp_backend (the heads are checked when the trainer
        reads the model config: train/ulysses.py choose_sp_layout)."""
        size, sp = self.sp_ulysses_size, self.sequence_parallel_size
        if size is None:
            return
        if size < 1 or sp % size:
            raise ConfigError(f"sp_ulysses_size={size} must divide sequence_parallel_size={sp} (or be null)")
        if size > 1 and self.sp_backend == "zigzag":
            raise ConfigError("sp_ulysses_size > 1 needs the contiguous layout; sp_backend=zigzag cannot be the ring "
                              "part of the hybrid (use auto, torch, llama3 or ulysses)")
        if size == 1 and self.sp_backend == "ulysses":
            raise ConfigError("sp_backend=ulysses needs sp_ulysses_size > 1 (or null: sequence_parallel_size)")

    def _hybrid_may_span(self, per_machine: int) -> bool:
        """An sp group across machines is the hybrid: whole machines of Ulysses groups, the ring between them."""
        sp, size = self.sequence_parallel_size, self.sp_ulysses_size
        if sp % per_machine:
            return False
        if size is None:
            return self.sp_backend == "auto"
        return size > 1 and per_machine % size == 0

    def validate_numbers(self) -> None:
        """Finite floats in their ranges (a NaN passes every `<` test, so it is checked first)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        ranges = [
            ("lr", self.lr > 0, "> 0"),
            ("adam_beta1", 0.0 <= self.adam_beta1 < 1.0, "in [0, 1)"),
            ("adam_beta2", 0.0 <= self.adam_beta2 < 1.0, "in [0, 1)"),
            ("adam_eps", self.adam_eps > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("max_grad_norm", self.max_grad_norm >= 0, ">= 0 (0: no clipping)"),
            ("min_lr_ratio", 0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]"),
            ("warmup_ratio", 0.0 <= self.warmup_ratio < 1.0, "in [0, 1)"),
            ("lora_alpha", self.lora_alpha > 0, "> 0"),
            ("lora_dropout", 0.0 <= self.lora_dropout < 1.0, "in [0, 1)"),
            ("checkpointing_min_length", self.checkpointing_min_length >= 1, ">= 1"),
            ("seed", self.seed >= 0, ">= 0"),
            ("router_aux_loss_coef", self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
             ">= 0 (or null)"),
            ("stop_at_step", self.stop_at_step is None or self.stop_at_step >= 1, ">= 1 (or null)"),
            ("online_max_length", self.online_max_length is None or self.online_max_length >= 1, ">= 1 (or null)"),
            ("launch.main_process_port", 0 < self.launch.main_process_port < 65536, "in [1, 65535]"),
            ("launch.machine_rank", 0 <= self.launch.machine_rank < max(1, self.launch.num_machines),
             f"in [0, launch.num_machines={self.launch.num_machines})"),
        ]
        for name, ok, expected in ranges:
            if not ok:
                value = getattr(self.launch, name.split(".")[1]) if name.startswith("launch.") else getattr(self, name)
                raise ConfigError(f"{name} must be {expected}, got {value}")

    def validate_values(self, world_size: int = 1) -> None:
        self.validate_numbers()
        if (self.model_path is None) == (self.model_config is None):
            raise ConfigError("exactly one of model_path (pretrained) and model_config (random init) must be set")
        positive = {
            "micro_batch_rows": self.micro_batch_rows,
            "grad_accum": self.grad_accum,
            "num_epochs": self.num_epochs,
            "loss_chunk_size": self.loss_chunk_size,
            "sequence_parallel_size": self.sequence_parallel_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 (or null for num_epochs), got {self.max_steps}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("save_steps", "eval_steps", "lora_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.save_total_limit < 1:
            raise ConfigError(f"save_total_limit must be >= 1, got {self.save_total_limit}")
        if self.eval_steps and self.eval_path() is None:
            raise ConfigError(f"eval_steps is set but eval_data_path is not, and there is no eval split beside "
                              f"data_path ({pipeline_eval_split(self.data_path)}): set eval_size in the data config, "
                              "or eval_data_path")
        for backend in self.log_backends:
            if backend not in ("tensorboard", "wandb"):
                raise ConfigError(f"log_backends: unknown backend {backend!r}; known: ['tensorboard', 'wandb']")
            if importlib.util.find_spec(backend if backend == "wandb" else "tensorboard") is None:
                raise ConfigError(f"log_backends: {backend} is not installed (pip install {backend})")
        if world_size % self.sequence_parallel_size:
            raise ConfigError(
                f"world size {world_size} is not divisible by sequence_parallel_size={self.sequence_parallel_size}"
            )
        if self.launch.num_processes % self.sequence_parallel_size:
            raise ConfigError(
                f"launch.num_processes={self.launch.num_processes} is not divisible by "
                f"sequence_parallel_size={self.sequence_parallel_size}"
            )
        if self.launch.num_machines < 1 or self.launch.num_processes < self.launch.num_machines:
            raise ConfigError(
                f"launch: num_processes={self.launch.num_processes} must be >= num_machines={self.launch.num_machines} >= 1"
            )
        if self.launch.num_processes % self.launch.num_machines:
            raise ConfigError(
                f"launch.num_processes={self.launch.num_processes} is not divisible by launch.num_machines="
                f"{self.launch.num_machines}: every machine runs the same number of processes"
            )
        self.validate_ulysses()
        per_machine = self.launch.num_processes // self.launch.num_machines
        if per_machine % self.sequence_parallel_size and not self._hybrid_may_span(per_machine):
            raise ConfigError(
                f"sequence_parallel_size={self.sequence_parallel_size} does not divide the {per_machine} processes per "
                f"machine (launch.num_processes={self.launch.num_processes} / launch.num_machines="
                f"{self.launch.num_machines}): a sequence-parallel group must not span machines, except the "
                "Ulysses x ring hybrid (sp_backend auto or sp_ulysses_size dividing the processes per machine, "
                "sequence_parallel_size a multiple of them)"
            )
        if self.launch.num_machines > 1 and not self.launch.main_process_ip:
            raise ConfigError("launch.main_process_ip is required when launch.num_machines > 1")
        ds = self.deepspeed
        if ds.offload_param and ds.stage != 3:
            raise ConfigError(f"deepspeed.offload_param needs deepspeed.stage 3, got {ds.stage}")
        if ds.offload_optimizer and ds.stage not in (2, 3):
            raise ConfigError(f"deepspeed.offload_optimizer needs deepspeed.stage 2 or 3, got {ds.stage}")
        if self.nonfinite == "skip_step" and self.uses_deepspeed:
            raise ConfigError(
                f"nonfinite=skip_step needs deepspeed.stage null (got {ds.stage}): DeepSpeed applies the update inside "
                "its engine, which PackSFT can stop before but not skip; use nonfinite=stop"
            )
        if self.compile_loss is True and not self.loss_chunk_size:
            raise ConfigError("compile_loss: true compiles the chunked loss; set loss_chunk_size > 0 (e.g. 4096)")
        if self.bf16 and not _cuda_available():
            raise ConfigError("bf16: true needs a GPU (CUDA is not available); use bf16=false on CPU")
        if self.liger:
            if not _cuda_available():
                raise ConfigError("liger: true needs a GPU (Liger-Kernel runs Triton kernels); use liger=false on CPU")
            if importlib.util.find_spec("liger_kernel") is None:
                raise ConfigError("liger: true needs liger-kernel (pip install liger-kernel), or set liger=false")
        if self.tiled_mlp_tile is not None and self.tiled_mlp_tile < 1:
            raise ConfigError(f"tiled_mlp_tile must be >= 1 (or null: chosen), got {self.tiled_mlp_tile}")
        if self.tiled_mlp and ds.stage == 3:
            raise ConfigError("tiled_mlp: true needs deepspeed.stage null or 0-2: under ZeRO-3 the tiles' recomputation "
                              "in backward would gather the partitioned MLP weights once per tile; set tiled_mlp=false "
                              "or use deepspeed.stage 2")
        if self.activation_offload and self.gradient_checkpointing is False:
            raise ConfigError("activation_offload: true moves the inputs that gradient checkpointing keeps; it needs "
                              "gradient_checkpointing: true (or auto, which it turns on); got gradient_checkpointing: "
                              "false")
        if self.resume not in ("none", "latest") and not Path(self.resume).is_dir():
            raise ConfigError(f"resume: {self.resume} is not a checkpoint directory (or use none / latest)"
                              f"{relative_note(self.resume)}")
        if self.resume == "none" and not self.overwrite_output_dir:
            from train.checkpoint import list_checkpoints

            earlier = list_checkpoints(self.output_dir)
            if earlier:
                raise ConfigError(
                    f"output_dir: {self.output_dir} holds checkpoints of an earlier run ({earlier[-1].name}); "
                    "resume=latest continues it, overwrite_output_dir=true starts over, or use another output_dir"
                )

    def validate_output_dir(self) -> None:
        """What output_dir already holds. PackSFT writes, replaces and removes its outputs there and never follows a
        link (a link to another folder would receive the checkpoints, and pruning or overwrite_output_dir would
        delete there): a link among them is refused. So is a step-N/ PackSFT did not write when starting over, and a
        log.jsonl that is not PackSFT's log (the new run would truncate it)."""
        from train.checkpoint import foreign_step_dirs
        from train.metrics import read_log

        links = output_links(self.output_dir)
        if links:
            raise ConfigError(
                f"output_dir: {links[0]} is a symbolic link to {os.readlink(links[0])}: PackSFT writes, replaces and "
                "removes its outputs in output_dir and follows no link there. Replace the link by a directory (move "
                "its content in), or set output_dir to a directory on that storage (output_dir itself may be a link)"
            )
        foreign = foreign_step_dirs(self.output_dir) if self.resume == "none" and self.overwrite_output_dir else []
        if foreign:
            raise ConfigError(f"output_dir: {foreign[0]}; overwrite_output_dir=true removes only PackSFT's own "
                              "checkpoints and the new run would replace this directory: move it out of output_dir")
        read_log(self.output_dir)

    def validate_paths(self) -> None:
        if not Path(self.data_path).is_dir():
            raise ConfigError(f"data_path: {self.data_path} is not a directory (run sh data_process.sh first?)"
                              f"{relative_note(self.data_path)}")
        if not (Path(self.data_path) / "meta.json").is_file():
            raise ConfigError(f"data_path: {self.data_path} has no meta.json: not a packed dataset")
        if self.online_max_length is not None and read_meta(self.data_path).get("kind") != "tokenized":
            raise ConfigError(
                f"online_max_length is set but data_path {self.data_path} is already packed; point data_path at a "
                "tokenized/ directory for online packing, or drop online_max_length"
            )
        if self.eval_data_path not in (None, "none") and not (Path(self.eval_data_path) / "meta.json").is_file():
            raise ConfigError(f"eval_data_path: {self.eval_data_path} is not a packed dataset (no meta.json)"
                              f"{relative_note(self.eval_data_path)}")
        model_dir = pretrained_dir(self.model_path, "model_path") if self.model_path is not None else None
        if model_dir is not None and not (model_dir / "config.json").is_file():
            raise ConfigError(f"model_path: {self.model_path} has no config.json")
        if self.model_config is not None and not Path(self.model_config).is_file():
            raise ConfigError(f"model_config: {self.model_config} does not exist{relative_note(self.model_config)}")
        if self.tokenizer_path is not None:
            pretrained_dir(self.tokenizer_path, "tokenizer_path")
        if self.deepspeed.template is not None and not Path(self.deepspeed.template).is_file():
            raise ConfigError(f"deepspeed.template: {self.deepspeed.template} does not exist"
                              f"{relative_note(self.deepspeed.template)}")

    def validate_data(self) -> None:
        """Token ids below the model's vocabulary; the shards' tokenizer hash equal to the model tokenizer's. Both
        problems of a dataset are reported together, each with the key that fixes it."""
        vocab_size = model_vocab_size(self)
        for name, path in (("data_path", self.data_path), ("eval_data_path", self.eval_path())):
            if path is None:
                continue
            meta = read_meta(path)
            if not meta["counts"].get("loss_tokens"):
                raise ConfigError(
                    f"{name}: {path} has no loss token (every label is -100): training on it would run steps of loss 0 "
                    "and export the initial weights. Check the data config (the assistant turns and their labels, "
                    "loss_turns) and re-run sh data_process.sh"
                )
            data_tok = _meta_tokenizer_path(meta) or "an unrecorded tokenizer"
            problems = []
            max_id = max_token_id(path, meta)
            if max_id >= vocab_size:
                key = "model_path" if self.model_path else "model_config"
                problems.append(
                    f"token id {max_id} in {path} does not fit the vocabulary of {key}={getattr(self, key)} "
                    f"(vocab_size={vocab_size}): the data was tokenized with {data_tok}, for another model. Set "
                    "model_path to a pretrained model of that tokenizer (a directory or a Hub id), or model_config to "
                    f"a config.json with vocab_size > {max_id} (configs/train/qwen2_5_tiny.yaml does this for Qwen2.5 "
                    "tokenizers)"
                )
            if name == "data_path":
                self._check_export_tokenizer(meta)
            mismatch = self._tokenizer_hash_mismatch(meta, data_tok)
            if mismatch and (problems or self.tokenizer_mismatch == "error"):
                problems.append(mismatch + " (tokenizer_mismatch=warn trains anyway: only when both give the same ids)")
            elif mismatch:
                logger.warning(f"{name}: {mismatch}")
            if problems:
                raise ConfigError(f"{name}: " + "; and ".join(problems))
            warn_past_max_positions(self, name, path)

    def _check_export_tokenizer(self, meta: dict) -> None:
        """The tokenizer final/ is exported with must exist now, not be found missing after the last step (the
        shards' meta.json of older pipelines holds the path as typed, relative to where the data was built)."""
        recorded = _meta_tokenizer_path(meta)
        if recorded is None or self.resolved_tokenizer_path(meta) is not None:
            return
        where = "" if Path(recorded).is_absolute() else f" (a relative path, from {os.getcwd()} here)"
        model = f"model_path {self.model_path} holds no tokenizer files, and " if self.model_path else ""
        raise ConfigError(
            f"tokenizer_path: not set; {model}the shards' meta.json names the tokenizer {recorded}, which does not "
            f"exist{where}: the model would be exported without its tokenizer. Set tokenizer_path to the tokenizer "
            "the data was tokenized with"
        )

    def _tokenizer_hash_mismatch(self, meta: dict, data_tok: str) -> str | None:
        tok_path, key = self._resolved_tokenizer(meta)
        data_hash = _meta_tokenizer_hash(meta)
        if tok_path is None or data_hash is None:
            return None
        model_hash = tokenizer_hash(tok_path)
        if model_hash is None or model_hash == data_hash:
            return None
        if self.model_path is not None:  # its embeddings belong to its own tokenizer's ids
            advice = (f"the model is pretrained, its embeddings belong to the ids of its own tokenizer, so "
                      f"re-tokenize the data with the model's tokenizer: tokenizer_path: {tok_path} in the data config, "
                      "then sh data_process.sh again")
        else:
            advice = "set tokenizer_path to the tokenizer the data was tokenized with"
        return (
            f"the shards were tokenized with {data_tok} (tokenizer hash {data_hash}) but the tokenizer exported with "
            f"the model, {tok_path} (from {key}), has hash {model_hash}: {advice}"
        )

    def resolved_tokenizer_path(self, meta: dict | None = None) -> str | None:
        """tokenizer_path, else model_path when it holds a tokenizer, else the shards' tokenizer."""
        return self._resolved_tokenizer(meta)[0]

    def _resolved_tokenizer(self, meta: dict | None = None) -> tuple[str | None, str]:
        """(path, the key it came from)."""
        if self.tokenizer_path:
            return str(pretrained_dir(self.tokenizer_path, "tokenizer_path")), "tokenizer_path"
        if self.model_path:
            model_dir = pretrained_dir(self.model_path, "model_path")
            if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                return str(model_dir), "model_path"
        meta = meta if meta is not None else read_meta(self.data_path)
        tok = _meta_tokenizer_path(meta)
        return (tok, "the shards' meta.json") if tok and Path(tok).exists() else (None, "")


def output_links(output_dir: str | os.PathLike) -> list[Path]:
    """The symbolic links among what PackSFT writes in output_dir: its outputs, and the checkpoint directories
    and `latest` pointer in checkpoints/."""
    from train.checkpoint import CHECKPOINT_DIR, FINAL_DIR, LATEST, checkpoint_root
    from train.metrics import LOG_FILE, PLOT_FILE, TENSORBOARD_DIR, WANDB_DIR

    out = Path(output_dir)
    candidates = [out / name for name in (CHECKPOINT_DIR, FINAL_DIR, TENSORBOARD_DIR, WANDB_DIR, LOG_FILE, PLOT_FILE)]
    root = checkpoint_root(out)
    if root.is_dir() and not root.is_symlink():
        candidates += [p for p in sorted(root.iterdir()) if p.name == LATEST or p.name.startswith(("step-", ".step-"))]
    return [p for p in candidates if p.is_symlink()]


def pipeline_eval_split(data_path: str) -> Path:
    """Where `sh data_process.sh` with `eval_size` puts the eval split of `<output_dir>/packed` (or tokenized/):
    `<output_dir>/eval/packed`."""
    return Path(data_path).parent / "eval" / "packed"


def _meta_tokenizer_path(meta: dict) -> str | None:
    tok = meta.get("tokenizer")
    return meta.get("tokenizer_path") or (tok.get("path") if isinstance(tok, dict) else None)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def read_meta(path: str | os.PathLike) -> dict:
    """The dataset's manifest, checked (format, and its own checksum: data.shards.read_meta)."""
    from data.shards import ShardFormatError
    from data.shards import read_meta as read_checked_meta

    try:
        return read_checked_meta(path)
    except ShardFormatError as exc:
        raise ConfigError(str(exc)) from None


def _meta_tokenizer_hash(meta: dict) -> str | None:
    tok = meta.get("tokenizer")
    if isinstance(tok, dict) and tok.get("hash"):
        return tok["hash"]
    return meta.get("tokenizer_hash")


def tokenizer_hash(path: str | os.PathLike) -> str | None:
    """The packing pipeline's tokenizer hash of `path` (common.fsutil.tokenizer_hash), None without tokenizer files."""
    from common import fsutil

    try:
        return fsutil.tokenizer_hash(path)
    except FileNotFoundError:
        return None


def max_token_id(path: str | os.PathLike, meta: dict | None = None) -> int:
    """Largest input id of a packed dataset: from a checksummed manifest, else a chunked scan of the shards (an older
    manifest without its checksum may have been edited)."""
    from data.shards import PackedDataset, trusted_manifest

    meta = meta if meta is not None else read_meta(path)
    if trusted_manifest(meta) and isinstance(meta.get("max_token_id"), int):
        return meta["max_token_id"]

    best = -1
    for chunk in PackedDataset(path).token_chunks():
        if len(chunk):
            best = max(best, int(np.max(chunk["input_ids"])))
    return best


def _text_model_config(source: str, field_name: str):
    from transformers import AutoConfig

    try:
        model_cfg = AutoConfig.from_pretrained(source)
    except Exception as exc:  # transformers raises several types for a malformed config
        raise ConfigError(f"{field_name}: cannot read a model config from {source}: {exc}") from None
    return model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg


def text_model_config(cfg: TrainConfig):
    """The (text part of the) model's config, from model_path or model_config."""
    if cfg.model_path is not None:
        return _text_model_config(str(pretrained_dir(cfg.model_path, "model_path")), "model_path")
    return _text_model_config(str(cfg.model_config), "model_config")


def model_vocab_size(cfg: TrainConfig) -> int:
    return int(text_model_config(cfg).vocab_size)


def warn_past_max_positions(cfg: TrainConfig, name: str, path: str) -> None:
    """A warning when the dataset's longest sequence (from the shard index) is longer than the model's
    max_position_embeddings: it would train on positions the model has no embedding / RoPE range for."""
    limit = getattr(text_model_config(cfg), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return  # recurrent models: no position limit
    from data.shards import PackedDataset

    lengths = PackedDataset(path, verify="off").seq_column("length")
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > limit:
        key = "model_path" if cfg.model_path is not None else "model_config"
        logger.warning(
            f"{name}: the longest sequence of {path} has {longest:,} tokens, more than max_position_embeddings="
            f"{limit:,} of {key}={getattr(cfg, key)} ({int((lengths > limit).sum()):,} such sequences): positions "
            f"past {limit:,} are outside the model's trained range. Re-pack with max_length <= {limit}, or use a "
            "model with a longer context"
        )


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist{relative_note(path)} (sh train.sh --help lists the "
                          "keys)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    help_hint = " (sh train.sh --help lists every key)"
    check_keys(raw, TrainConfig, f"config file {path}", aliases=TRAIN_KEY_ALIASES, help_hint=help_hint)
    overridden = {}
    for item in overrides or []:
        key = item.split("=", 1)[0].strip() if "=" in item else None
        if key is not None:
            check_keys(key_tree(key), TrainConfig, f"override {item!r}", aliases=TRAIN_KEY_ALIASES,
                       help_hint=help_hint)
            overridden[key] = item
    check_override_values(TrainConfig, overrides or [])
    file_sources = {key: raw.get(key) for key in MODEL_SOURCES}
    apply_overrides(raw, overrides or [])
    choose_model_source(raw, file_sources, overridden, path)
    return from_dict(TrainConfig, raw, where=str(path))


def choose_model_source(raw: dict, file_sources: dict, overridden: dict[str, str], path) -> None:
    """model_path and model_config exclude each other: one given as an override replaces the other one of the
    config file (said in one line); two given by the same source are an error naming it."""
    given = [key for key in MODEL_SOURCES if raw.get(key) is not None]
    if len(given) < 2:
        return
    by_override = [key for key in given if key in overridden]
    if len(by_override) == 1:
        winner = by_override[0]
        loser = next(key for key in MODEL_SOURCES if key != winner)
        raw[loser] = None
        logger.info(f"override {overridden[winner]!r} replaces {loser}: {file_sources[loser]} of config file {path}")
        return
    where = "overrides " + " and ".join(repr(overridden[key]) for key in given) if by_override else f"config file {path}"
    raise ConfigError(f"exactly one of model_path (pretrained) and model_config (random init) must be set; {where} "
                      "sets both")


# ---------------------------------------------------------------------------------------------- keys and --help


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def help_text() -> str:
    """`sh train.sh --help`: every key of TrainConfig with its type, default and help, sections flattened."""
    out = [
        "usage: sh train.sh [config.yaml] [key=value ...]   (default config: configs/train/example.yaml)",
        "",
        "Trains a causal LM on packed shards. Every key below can be set in the YAML file or overridden as",
        "key=value (sections with dots: deepspeed.stage=3). Values parse as JSON when they can (numbers,",
        "true/false/null, lists). Full reference: docs/TRAINING.md.",
        "",
    ]
    return "\n".join(out + key_help_lines(TrainConfig, _yaml_value))
