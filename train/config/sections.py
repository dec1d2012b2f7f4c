"""Typed trainer configuration: one YAML file plus `key=value` overrides, in sections.

`TrainConfig` is a dataclass of sections (`model`, `data`, `steps`, `optim`, `parallel`, `checkpoint`, `eval`,
`logging`, `lora`, `moe`, `deepspeed`, `fsdp2`, `launch`). The keys of every section but `deepspeed`, `fsdp2` and
`launch` are unique across sections, so they may be written flat (`lr: 1e-4`, `lr=1e-4`, as every config before the
sections did) or in their section (`optim: {lr: 1e-4}`, `optim.lr=1e-4`); `deepspeed.*`, `fsdp2.*` and `launch.*` are
written with their section.
Code reads them in their section (`cfg.optim.lr`).

`TrainConfig.validate(world_size)` checks every rule that needs nothing but the values, in a millisecond; what needs
the file system, the model's config, the tokenizer or the data is train/preflight.py's (run before the model loads).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from common.config import (
    ConfigError,
    apply_overrides,
    check_keys,
    check_override_values,
    check_value,
    closest_key_hint,
    field_help,
    from_dict,
    key_help_lines,
    key_tree,
    relative_note,
    to_dict,
)
from train.config.backend_names import ATTN_BACKEND_CHOICES, SP_BACKEND_CHOICES
from train.config.ep_rules import expert_parallel_problem
from train.config.sp_rules import placement_problem, processes_problem, ulysses_size_problem

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
# other frameworks' trainer keys whose setting PackSFT takes elsewhere: what to set instead (no spelling is close)
_ROW_LENGTH = ("packed rows get their length when the data is packed: set max_length (or pack.max_length) in the data "
               "config and re-run sh data_process.sh CONFIG --stages merge,tokenize,pack max_length=N; the trainer "
               "reads the rows as packed (online_max_length is only for data_path at a tokenized/ directory, packed "
               "while training)")
_PACKING = ("PackSFT always trains on packed rows, each packed sequence attending only to itself: the pack stage of "
            "sh data_process.sh packs them (max_length / pack.max_length in the data config), or data_path at a "
            "tokenized/ directory with online_max_length packs them while training")
TRAIN_KEY_NOTES = {
    "max_length": _ROW_LENGTH, "max_seq_length": _ROW_LENGTH, "max_seq_len": _ROW_LENGTH, "cutoff_len": _ROW_LENGTH,
    "seq_length": _ROW_LENGTH, "model_max_length": _ROW_LENGTH, "packing": _PACKING, "neat_packing": _PACKING,
    "template": "the chat template is applied when the data is tokenized: chat_template in the data config "
                "(sh data_process.sh), and the exported model carries it",
}
MODEL_SOURCES = ("model_path", "model_config")  # exactly one is set
# LoRA's target_modules when the config sets none: the attention and dense MLP projections of Llama-style families
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOG_BACKENDS = ("tensorboard", "wandb")
# micro-batches the feed thread may hold ahead of the loop (train/steps/feed.py): each is held in host memory whole (its
# rows, targets, weights, an image row's pixel values), and a couple already hide the building of the next ones
MAX_PREFETCH_MICRO_BATCHES = 64


@dataclass
class DataSection:
    """The packed training data."""

    data_path: str  # a packed dataset directory (data.shards.dataset format)
    verify_data: Literal["full", "rows", "off"] = "rows"  # shard checks: per-row crc32 on read, + file hashes at start, none
    online_max_length: int | None = None  # data_path is a tokenized dataset packed on the fly (train/steps/online.py)
    balance_dp: bool = False  # train/steps/balance.py: balance the step's rows over dp ranks by tokens
    prefetch_micro_batches: int = 2  # micro-batches built ahead on a thread (train/steps/feed.py); 0: in the loop
    # data_path (or the eval split) that the data pipeline's report.json lists as stale (an earlier stage re-ran after
    # it was written): a config error, or a warning and trained as it is
    stale_data: Literal["error", "warn"] = "error"


@dataclass
class CheckpointSection:
    """Where the run writes, what it saves and how it resumes."""

    output_dir: str  # logs, checkpoints/, final/ (the exported model)
    save_steps: int = 0  # checkpoint every N steps; 0: only the final checkpoint
    save_total_limit: int = 2  # resumable checkpoints kept
    resume: str = "none"  # none | latest | a checkpoint directory
    resume_corrupt: Literal["fallback", "error"] = "fallback"  # a checkpoint failing its manifest: use the previous one
    resume_data_mismatch: Literal["error", "allow"] = "error"  # data_path differs from the checkpoint's data
    overwrite_output_dir: bool = False  # resume=none into an output_dir with checkpoints: remove PackSFT's checkpoints, start over


@dataclass
class ModelSection:
    """The model, its tokenizer, and how its layers run."""

    model_path: str | None = None  # pretrained HF model: a local directory or a Hub id (org/name), weights loaded
    model_config: str | None = None  # or: an HF config.json, random init (the CPU example)
    tokenizer_path: str | None = None  # dir or Hub id, exported with the model; default: model_path, then the shards'
    tokenizer_mismatch: Literal["warn", "error"] = "error"  # shards' tokenizer hash vs the model's tokenizer
    self_check: bool = True  # before step 1: a few sequences packed vs the model's own unpacked forward must agree
    bf16: bool = False  # bf16 weights (DeepSpeed) or autocast; GPU only
    attn_backend: Literal[ATTN_BACKEND_CHOICES] = "auto"  # attention kernel over packed sequences (train/attention/function.py)
    # activation checkpointing: true | false | auto (GPU: on when the estimated memory of a micro-batch without it
    # exceeds the free memory, train/plan/memory.py; CPU: on when the rows are at least `checkpointing_min_length` long)
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    checkpointing_min_length: int = 8192  # tokens per rank from which gradient_checkpointing=auto turns on (CPU)
    compile_layers: bool = False  # torch.compile each decoder layer (the attention call stays eager)
    # torch.compile the lm-head chunk's softmax, loss and gradient into one kernel (train/model/loss.py); auto: on CUDA
    compile_loss: bool | Literal["auto"] = "auto"
    liger: bool = False  # Liger-Kernel's fused RMSNorm / SwiGLU / RoPE (needs CUDA and liger-kernel)
    tiled_mlp: bool = False  # run each decoder layer's feed-forward over the row in tiles of tokens (long rows)
    tiled_mlp_tile: int | None = None  # tokens per tile of tiled_mlp; null: chosen from the intermediate size
    # keep the checkpointed layer inputs in pinned host memory until backward (needs gradient_checkpointing)
    activation_offload: bool = False
    # composite (multimodal) checkpoints trained on text (train/model/composite.py): keep the towers / projectors frozen
    freeze_vision_tower: bool = True  # vision towers (and every tower of a composite that is not an audio one)
    freeze_audio_tower: bool = True  # audio towers (Qwen2-Audio's, the Omni thinker's `audio_tower`)
    freeze_multi_modal_projector: bool = True  # the projectors between a tower and the text decoder

    def checkpointing_enabled(self, row_length: int) -> bool:
        """gradient_checkpointing for rows of `row_length` tokens per rank, by row length (auto on CPU)."""
        if self.gradient_checkpointing == "auto":
            return row_length >= self.checkpointing_min_length
        return bool(self.gradient_checkpointing)


@dataclass
class StepsSection:
    """What an optimizer step trains, and for how many steps."""

    max_steps: int | None = None  # optimizer steps; null: num_epochs over the data
    num_epochs: int = 1  # passes over the data when max_steps is null
    micro_batch_rows: int = 1  # packed rows concatenated into one micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step per data-parallel rank
    loss_reduction: Literal["token", "turn", "sample"] = "token"  # mean over tokens, turns or samples of a step
    loss_chunk_size: int = 4096  # tokens per lm-head chunk
    seed: int = 42  # data order, online packing plan, random init
    stop_at_step: int | None = None  # stop (with a checkpoint) after this step, as a time-limited job would


@dataclass
class OptimSection:
    """AdamW, the learning-rate schedule, clipping and non-finite steps."""

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
    # a step whose loss or gradient norm is inf / nan: stop there (the last checkpoint stays finite, nothing is
    # exported) or skip_step: skip its update and train on (plain torch optimizer only)
    nonfinite: Literal["stop", "skip_step"] = "stop"


@dataclass
class ParallelSection:
    """How the ranks share the work: the data-parallel backend, and sequence parallelism (ranks sharing one row;
    train/plan/attention.py chooses the layout)."""

    # deepspeed: DeepSpeed ZeRO as deepspeed.stage says (null: plain torch, gradients all-reduced); fsdp2: torch's
    # FSDP2 (fully_shard per decoder layer over every rank, checkpoints in torch Distributed Checkpoint format)
    distributed_backend: Literal["deepspeed", "fsdp2"] = "deepspeed"

    # ranks sharing one row; auto: the smallest degree whose share of a row fits the GPU (train/plan/memory.py; 1 on CPU)
    sequence_parallel_size: int | Literal["auto"] = 1
    sp_backend: Literal[SP_BACKEND_CHOICES] = "auto"  # sequence-parallel attention (auto: by heads and placement)
    sp_ulysses_size: int | None = None  # Ulysses degree inside the sp group (< sequence_parallel_size: the hybrid); null: chosen
    # MoE: split each MoE layer's experts over this many data-parallel ranks (num_experts / N each, tokens exchanged
    # by all-to-all, dropless; train/model/experts.py); 1: every rank holds every expert
    expert_parallel_size: int = 1


@dataclass
class EvalSection:
    """Evaluation on a held-out packed set."""

    # packed eval set (token-mean loss, overall and per category); null: the data pipeline's eval split beside
    # data_path (<data_path>/../eval/packed, from eval_size) when there is one; none: no evaluation
    eval_data_path: str | None = None
    eval_steps: int = 0  # with an eval set: evaluate every N steps and after the last step; 0: after the last step only


@dataclass
class LoggingSection:
    """log.jsonl and the console always; optional backends."""

    log_backends: list[str] = field(default_factory=list)  # "tensorboard", "wandb" (offline)
    wandb_project: str = "packsft"  # wandb project (offline mode)
    plot: bool = True  # loss curves PNG at the end


@dataclass
class LoraSection:
    """LoRA adapters (train/model/lora.py)."""

    lora_rank: int = 0  # LoRA rank; 0: full fine-tuning
    lora_alpha: float = 16.0  # LoRA scaling alpha / rank, > 0
    lora_dropout: float = 0.0  # LoRA dropout, in [0, 1)
    target_modules: list[str] = field(  # LoRA: module name suffixes, or all-linear
        default_factory=lambda: list(DEFAULT_TARGET_MODULES)
    )
    lora_merge_on_save: bool = True  # LoRA: also export the merged model to final/merged/
    # LoRA on parameters that are no linear layer (peft's parameter targets): `module.parameter` suffixes, e.g. an MoE's
    # fused routed experts ["experts.gate_up_proj", "experts.down_proj"]; [] (default): none
    target_parameters: list[str] = field(default_factory=list)


@dataclass
class MoESection:
    """The mixture-of-experts router load-balancing loss (train/model/moe.py)."""

    # true | false | null (null: the model config's output_router_logits); logged as aux_loss, added to the optimised
    # objective
    output_router_logits: bool | None = None
    router_aux_loss_coef: float | None = None  # weight of the router aux loss, >= 0; null: the model config's
    # the routed experts' kernel at every expert_parallel_size: one grouped matrix product per projection
    # (torch._grouped_mm), or one product per expert (loop); auto: grouped_mm where torch has it for the weights'
    # dtype and device. At expert_parallel_size 1 it sets transformers' experts_implementation (grouped_mm / eager)
    moe_kernel: Literal["auto", "grouped_mm", "loop"] = "auto"


@dataclass
class DeepSpeedSection:
    """stage None: no DeepSpeed (plain torch optimizer, gradients summed over ranks with all_reduce)."""

    stage: Literal[0, 1, 2, 3] | None = None  # ZeRO stage; null: no DeepSpeed (plain torch AdamW)
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (stage 2 or 3)
    offload_param: bool = False  # parameters too (stage 3 only)
    template: str | None = None  # a JSON file (e.g. configs/deepspeed/zero2.json) whose keys are the defaults
    overrides: dict = field(default_factory=dict)  # raw keys merged last into the built DeepSpeed dict


@dataclass
class FSDP2Section:
    """torch FSDP2 settings (distributed_backend: fsdp2, train/engines/build.py)."""

    cpu_offload: bool = False  # sharded parameters, gradients and optimizer states in host memory (GPU runs)
    reshard_after_forward: bool = True  # free each layer's gathered weights after forward (false: ZeRO-2-like)


@dataclass
class LaunchSection:
    """Settings `train.sh` passes to `accelerate launch` (multi-node: one launch per machine)."""

    num_processes: int = 1  # total over all machines
    num_machines: int = 1  # machines (one `sh train.sh` per machine)
    machine_rank: int = 0  # this machine's index, 0 .. num_machines-1
    main_process_ip: str | None = None  # rank 0's address (required with num_machines > 1)
    main_process_port: int = 29500  # rank 0's port (with num_machines > 1, the machines' heartbeat uses the next one)
    cpu_threads_per_process: int | None = None  # intra-op CPU threads of each process; null: chosen (docs §3)
    heartbeat_timeout_s: float = 60.0  # num_machines > 1: a machine silent this long is lost and the others stop

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines


@dataclass
class TrainConfig:
    data: DataSection  # the packed training data
    checkpoint: CheckpointSection  # output_dir, checkpoints, resuming
    model: ModelSection = field(default_factory=ModelSection)  # the model, its tokenizer, how its layers run
    steps: StepsSection = field(default_factory=StepsSection)  # what a step trains, how many steps
    optim: OptimSection = field(default_factory=OptimSection)  # AdamW, lr schedule, clipping, non-finite steps
    parallel: ParallelSection = field(default_factory=ParallelSection)  # the distributed backend, sequence parallelism
    eval: EvalSection = field(default_factory=EvalSection)  # evaluation
    logging: LoggingSection = field(default_factory=LoggingSection)  # logging backends, loss curves
    lora: LoraSection = field(default_factory=LoraSection)  # LoRA
    moe: MoESection = field(default_factory=MoESection)  # MoE router aux loss
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)  # DeepSpeed ZeRO settings
    fsdp2: FSDP2Section = field(default_factory=FSDP2Section)  # torch FSDP2 settings
    launch: LaunchSection = field(default_factory=LaunchSection)  # accelerate launch layout (train.sh)

    # ------------------------------------------------------------------ derived
    @property
    def out(self) -> Path:
        return Path(self.checkpoint.output_dir)

    @property
    def uses_deepspeed(self) -> bool:
        return self.deepspeed.stage is not None

    @property
    def uses_fsdp2(self) -> bool:
        return self.parallel.distributed_backend == "fsdp2"

    def to_dict(self) -> dict:
        return to_dict(self)

    # ------------------------------------------------------------------ rules of the values
    def validate(self, world_size: int = 1) -> None:
        """Every rule of the values alone (each written once; the sequence-parallel ones are train/config/sp_rules.py's);
        raises ConfigError naming the key. train/preflight.py runs it first."""
        self._validate_numbers()
        self._validate_counts()
        self._validate_parallel(world_size)
        self._validate_combinations()

    def _validate_numbers(self) -> None:
        """Finite floats in their ranges (a NaN passes every `<` test, so it is checked first)."""
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            for f in dataclasses.fields(values):
                value = getattr(values, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ConfigError(f"{key_name(section.name, f.name)} must be a finite number, got {value}")
        optim, lora, launch = self.optim, self.lora, self.launch
        ranges = [
            ("lr", optim.lr, optim.lr > 0, "> 0"),
            ("adam_beta1", optim.adam_beta1, 0.0 <= optim.adam_beta1 < 1.0, "in [0, 1)"),
            ("adam_beta2", optim.adam_beta2, 0.0 <= optim.adam_beta2 < 1.0, "in [0, 1)"),
            ("adam_eps", optim.adam_eps, optim.adam_eps > 0, "> 0"),
            ("weight_decay", optim.weight_decay, optim.weight_decay >= 0, ">= 0"),
            ("max_grad_norm", optim.max_grad_norm, optim.max_grad_norm >= 0, ">= 0 (0: no clipping)"),
            ("min_lr_ratio", optim.min_lr_ratio, 0.0 <= optim.min_lr_ratio <= 1.0, "in [0, 1]"),
            ("warmup_ratio", optim.warmup_ratio, 0.0 <= optim.warmup_ratio < 1.0, "in [0, 1)"),
            ("lora_alpha", lora.lora_alpha, lora.lora_alpha > 0, "> 0"),
            ("lora_dropout", lora.lora_dropout, 0.0 <= lora.lora_dropout < 1.0, "in [0, 1)"),
            ("checkpointing_min_length", self.model.checkpointing_min_length, self.model.checkpointing_min_length >= 1,
             ">= 1"),
            ("seed", self.steps.seed, self.steps.seed >= 0, ">= 0"),
            ("router_aux_loss_coef", self.moe.router_aux_loss_coef,
             self.moe.router_aux_loss_coef is None or self.moe.router_aux_loss_coef >= 0, ">= 0 (or null)"),
            ("stop_at_step", self.steps.stop_at_step, self.steps.stop_at_step is None or self.steps.stop_at_step >= 1,
             ">= 1 (or null)"),
            ("online_max_length", self.data.online_max_length,
             self.data.online_max_length is None or self.data.online_max_length >= 1, ">= 1 (or null)"),
            ("prefetch_micro_batches", self.data.prefetch_micro_batches,
             0 <= self.data.prefetch_micro_batches <= MAX_PREFETCH_MICRO_BATCHES,
             f"in [0, {MAX_PREFETCH_MICRO_BATCHES}] (0: built in the loop; each one ahead is held in host memory "
             "whole, images included, and 2 already hide the building)"),
            ("launch.main_process_port", launch.main_process_port,
             0 < launch.main_process_port < (65535 if launch.num_machines > 1 else 65536),
             "in [1, 65534] (the machines' heartbeat takes the next port)" if launch.num_machines > 1 else
             "in [1, 65535]"),
            ("launch.cpu_threads_per_process", launch.cpu_threads_per_process,
             launch.cpu_threads_per_process is None or launch.cpu_threads_per_process >= 1, ">= 1 (or null: auto)"),
            ("launch.heartbeat_timeout_s", launch.heartbeat_timeout_s, launch.heartbeat_timeout_s >= 3,
             ">= 3 (seconds; a line is sent every second)"),
            ("launch.machine_rank", launch.machine_rank, 0 <= launch.machine_rank < max(1, launch.num_machines),
             f"in [0, launch.num_machines={launch.num_machines})"),
        ]
        for name, value, ok, expected in ranges:
            if not ok:
                raise ConfigError(f"{name} must be {expected}, got {value}")

    def _validate_counts(self) -> None:
        model, steps = self.model, self.steps
        if (model.model_path is None) == (model.model_config is None):
            raise ConfigError("exactly one of model_path (pretrained) and model_config (random init) must be set")
        positive = {
            "micro_batch_rows": steps.micro_batch_rows,
            "grad_accum": steps.grad_accum,
            "num_epochs": steps.num_epochs,
            "loss_chunk_size": steps.loss_chunk_size,
        }
        if self.parallel.sequence_parallel_size != "auto":  # auto is chosen at start (train/plan/layout.py)
            positive["sequence_parallel_size"] = self.parallel.sequence_parallel_size
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if steps.max_steps is not None and steps.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 (or null for num_epochs), got {steps.max_steps}")
        if self.optim.warmup_steps is not None and self.optim.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.optim.warmup_steps}")
        for name, value in (("save_steps", self.checkpoint.save_steps), ("eval_steps", self.eval.eval_steps),
                            ("lora_rank", self.lora.lora_rank)):
            if value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.checkpoint.save_total_limit < 1:
            raise ConfigError(f"save_total_limit must be >= 1, got {self.checkpoint.save_total_limit}")
        for backend in self.logging.log_backends:
            if backend not in LOG_BACKENDS:
                raise ConfigError(f"log_backends: unknown backend {backend!r}; known: {list(LOG_BACKENDS)}")

    def _validate_parallel(self, world_size: int) -> None:
        """The processes against the sp degree, the Ulysses degree and the placement (train/config/sp_rules.py; the
        heads are checked when train/plan/attention.py reads the model config)."""
        parallel, launch = self.parallel, self.launch
        sp = parallel.sequence_parallel_size
        if sp == "auto" and parallel.sp_ulysses_size is not None:
            raise ConfigError(f"sp_ulysses_size={parallel.sp_ulysses_size} needs a fixed sequence_parallel_size, got "
                              "auto (drop sp_ulysses_size: the layout is then chosen for the degree auto picks)")
        if launch.num_machines < 1 or launch.num_processes < launch.num_machines:
            raise ConfigError(
                f"launch: num_processes={launch.num_processes} must be >= num_machines={launch.num_machines} >= 1"
            )
        if launch.num_processes % launch.num_machines:
            raise ConfigError(
                f"launch.num_processes={launch.num_processes} is not divisible by launch.num_machines="
                f"{launch.num_machines}: every machine runs the same number of processes"
            )
        if launch.num_machines > 1 and not launch.main_process_ip:
            raise ConfigError("launch.main_process_ip is required when launch.num_machines > 1")
        if sp != "auto" and (problem := self.parallel_problem(world_size, sp)):
            raise ConfigError(problem)
        if sp == "auto" and (problem := expert_parallel_problem(self, world_size)):  # the degree: checked once chosen
            raise ConfigError(problem)

    def parallel_problem(self, world_size: int, sp: int) -> str | None:
        """What the processes, the Ulysses degree, the placement and expert parallelism forbid for the sequence-parallel
        degree `sp` (the configured one, or the one `auto` chose: train/plan/layout.py); None: nothing."""
        parallel, launch = self.parallel, self.launch
        return (processes_problem(world_size, f"world size {world_size}", sp)
                or processes_problem(launch.num_processes, f"launch.num_processes={launch.num_processes}", sp)
                or ulysses_size_problem(parallel.sp_backend, sp, parallel.sp_ulysses_size)
                or placement_problem(parallel.sp_backend, sp, parallel.sp_ulysses_size, launch.processes_per_machine)
                or expert_parallel_problem(self, world_size, sp))

    def _validate_combinations(self) -> None:
        ds, model = self.deepspeed, self.model
        if model.tiled_mlp_tile is not None and model.tiled_mlp_tile < 1:
            raise ConfigError(f"tiled_mlp_tile must be >= 1 (or null: chosen), got {model.tiled_mlp_tile}")
        if model.tiled_mlp and ds.stage == 3:
            raise ConfigError("tiled_mlp: true needs deepspeed.stage null or 0-2: under ZeRO-3 the tiles' recomputation "
                              "in backward would gather the partitioned MLP weights once per tile; for sharded weights "
                              "with tiled MLPs use distributed_backend=fsdp2 (deepspeed.stage=null; it gathers each "
                              "decoder layer whole), else set tiled_mlp=false or use deepspeed.stage 2")
        lora = self.lora
        if lora.lora_rank == 0:  # LoRA keys that would be ignored: the run would fine-tune every weight instead
            ignored = [f"{key}={value}" for key, value in (
                ("target_parameters", lora.target_parameters),
                ("target_modules", lora.target_modules if lora.target_modules != list(DEFAULT_TARGET_MODULES) else []))
                if value]
            if ignored:
                raise ConfigError(
                    f"{' and '.join(ignored)} set, but lora_rank is 0 (full fine-tuning: no adapter, every weight "
                    "trains); set lora_rank (e.g. lora_rank=16 lora_alpha=32) for LoRA, or drop "
                    f"{' and '.join(i.split('=', 1)[0] for i in ignored)}")
        if self.lora.target_parameters and self.lora.lora_rank > 0:
            if model.tiled_mlp:
                raise ConfigError(
                    f"target_parameters={self.lora.target_parameters} with tiled_mlp: true: a tile's recomputation "
                    "in backward would not reach the adapters of the targeted parameters; set tiled_mlp=false, or "
                    "target_parameters=[] (LoRA on the linear layers only)")
            if self.lora.lora_dropout:
                raise ConfigError(
                    f"target_parameters={self.lora.target_parameters} needs lora_dropout=0 (got "
                    f"{self.lora.lora_dropout}): peft's parameter adapters fold B·A into the weight, where no dropout "
                    "of the input applies")
        if model.activation_offload and model.gradient_checkpointing is False:
            raise ConfigError("activation_offload: true moves the inputs that gradient checkpointing keeps; it needs "
                              "gradient_checkpointing: true (or auto, which it turns on); got gradient_checkpointing: "
                              "false")
        if ds.offload_param and ds.stage != 3:
            raise ConfigError(f"deepspeed.offload_param needs deepspeed.stage 3, got {ds.stage}")
        if ds.offload_optimizer and ds.stage not in (2, 3):
            raise ConfigError(f"deepspeed.offload_optimizer needs deepspeed.stage 2 or 3, got {ds.stage}")
        if self.uses_fsdp2 and ds.stage is not None:
            raise ConfigError(
                f"distributed_backend: fsdp2 shards the model with torch FSDP2, in place of DeepSpeed, and needs "
                f"deepspeed.stage null (got {ds.stage}); set deepspeed.stage=null, or distributed_backend=deepspeed to "
                "train with DeepSpeed ZeRO"
            )
        changed = [f"fsdp2.{f.name}" for f in dataclasses.fields(FSDP2Section)
                   if getattr(self.fsdp2, f.name) != f.default]
        if changed and not self.uses_fsdp2:
            raise ConfigError(f"{', '.join(changed)} set, but distributed_backend is "
                              f"{self.parallel.distributed_backend}: the fsdp2 section needs distributed_backend: fsdp2")
        if self.optim.nonfinite == "skip_step" and self.uses_deepspeed:
            raise ConfigError(
                f"nonfinite=skip_step needs deepspeed.stage null (got {ds.stage}): DeepSpeed applies the update inside "
                "its engine, which PackSFT can stop before but not skip; use nonfinite=stop"
            )


# ---------------------------------------------------------------------------------------------- keys
SECTIONS: dict[str, type] = typing.get_type_hints(TrainConfig)
DOTTED_ONLY = ("deepspeed", "fsdp2", "launch")  # sections whose keys are written with the section's name


def _flat_keys() -> dict[str, str]:
    """Key -> its section, for every section whose keys may be written flat (each key in exactly one of them)."""
    owner: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        if section in DOTTED_ONLY:
            continue
        for f in dataclasses.fields(cls):
            if f.name in owner or f.name in SECTIONS:
                raise TypeError(f"train config key {f.name!r} is not unique across sections")
            owner[f.name] = section
    return owner


FLAT_KEYS = _flat_keys()


def key_path(key: str) -> str:
    """The dotted path of a key as written: `lr` -> `optim.lr`; a dotted key is already one."""
    return f"{FLAT_KEYS[key]}.{key}" if key in FLAT_KEYS else key


def key_name(section: str, key: str) -> str:
    """How messages name a key: flat where it may be written flat (`lr`), else dotted (`launch.machine_rank`)."""
    return f"{section}.{key}" if section in DOTTED_ONLY else key


def check_train_keys(raw: dict, origin: str, help_hint: str = "") -> None:
    """Unknown keys (flat or in sections) name where they came from and the closest known key, or for another
    framework's key whose setting lives elsewhere in PackSFT (TRAIN_KEY_NOTES), what to set instead."""
    for key, value in raw.items():
        if key in FLAT_KEYS:
            continue
        if key in SECTIONS:
            if isinstance(value, dict):
                noted = [k for k in value if k in TRAIN_KEY_NOTES and k not in {f.name for f in
                                                                                 dataclasses.fields(SECTIONS[key])}]
                if noted:
                    raise ConfigError(f"{origin}: unknown key '{key}.{noted[0]}': {TRAIN_KEY_NOTES[noted[0]]}")
                check_keys(value, SECTIONS[key], origin, f"{key}.", help_hint=help_hint)
            continue
        if key in TRAIN_KEY_NOTES:
            raise ConfigError(f"{origin}: unknown key '{key}': {TRAIN_KEY_NOTES[key]}")
        hint = closest_key_hint(key, [*FLAT_KEYS, *SECTIONS], aliases=TRAIN_KEY_ALIASES)
        raise ConfigError(f"{origin}: unknown key '{key}'{hint}{help_hint}")


def nest_keys(raw: dict, where: str) -> dict:
    """The config's keys with the flat ones moved into their sections (each value type-checked first, so that a bad
    one is named as written: `<where>.lr`); a key given both ways is an error."""
    nested: dict = {}
    for key, value in raw.items():
        if key not in FLAT_KEYS:
            nested[key] = value
    for key, value in raw.items():
        if key not in FLAT_KEYS:
            continue
        check_value(TrainConfig, key_path(key), value, f"{where}.{key}")
        section = nested.setdefault(FLAT_KEYS[key], {})
        if not isinstance(section, dict):
            raise ConfigError(f"{where}.{FLAT_KEYS[key]}: expected a section (mapping), got {section!r}")
        if key in section:
            raise ConfigError(f"{where}: {key} is set twice, as {key} and as {key_path(key)}")
        section[key] = value
    for name in ("data", "checkpoint"):  # their required keys are then named by from_dict
        nested.setdefault(name, {})
    return nested


def from_keys(raw: dict, where: str = "config") -> TrainConfig:
    """A TrainConfig from keys as a config file holds them (flat or in sections): what tests and scripts build."""
    check_train_keys(raw, where)
    return from_dict(TrainConfig, nest_keys(raw, where), where=where)


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
    check_train_keys(raw, f"config file {path}", help_hint=help_hint)
    overridden: dict[str, str] = {}
    for item in overrides or []:
        key = item.split("=", 1)[0].strip() if "=" in item else None
        if key is not None:
            check_train_keys(key_tree(key), f"override {item!r}", help_hint=help_hint)
            overridden[key_path(key)] = item
    check_override_values(TrainConfig, overrides or [], key_path=key_path)
    raw = nest_keys(raw, str(path))
    file_sources = {key: raw.get("model", {}).get(key) for key in MODEL_SOURCES}
    apply_overrides(raw, [_dotted(item) for item in overrides or []])
    choose_model_source(raw.setdefault("model", {}), file_sources, overridden, path)
    return from_dict(TrainConfig, raw, where=str(path))


def _dotted(item: str) -> str:
    """An override with its key as a dotted path (`lr=1` -> `optim.lr=1`); a malformed one as it is."""
    if "=" not in item:
        return item
    key, value = item.split("=", 1)
    return f"{key_path(key.strip())}={value}"


def choose_model_source(model: dict, file_sources: dict, overridden: dict[str, str], path) -> None:
    """model_path and model_config exclude each other: one given as an override replaces the other one of the
    config file (said in one line); two given by the same source are an error naming it. `model`: the model
    section's keys; `overridden`: the overrides by dotted key."""
    given = [key for key in MODEL_SOURCES if model.get(key) is not None]
    if len(given) < 2:
        return
    by_override = [key for key in given if f"model.{key}" in overridden]
    if len(by_override) == 1:
        winner = by_override[0]
        loser = next(key for key in MODEL_SOURCES if key != winner)
        model[loser] = None
        logger.info(f"override {overridden[f'model.{winner}']!r} replaces {loser}: {file_sources[loser]} of config "
                    f"file {path}")
        return
    where = ("overrides " + " and ".join(repr(overridden[f"model.{key}"]) for key in given) if by_override
             else f"config file {path}")
    raise ConfigError(f"exactly one of model_path (pretrained) and model_config (random init) must be set; {where} "
                      "sets both")


# ---------------------------------------------------------------------------------------------- --help
def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def help_text() -> str:
    """`sh train.sh --help`: every key of TrainConfig, section by section, with its type, default and help."""
    out = [
        "usage: sh train.sh [config.yaml] [key=value ...]   (default config: configs/train/example.yaml)",
        "",
        "Trains a causal LM on packed shards. Every key below can be set in the YAML file or overridden as",
        "key=value. Keys come in sections; those listed without their section's name may be written flat",
        "(lr: 2.0e-4, lr=2e-4) or in it (optim: {lr: 2.0e-4}, optim.lr=2e-4); deepspeed.*, fsdp2.* and",
        "launch.* keys always with it (deepspeed.stage=3). Values parse as JSON when they can (numbers, true/false/null,",
        "lists). Full reference: docs/TRAINING.md.",
    ]
    helps = field_help(TrainConfig)
    for name, cls in SECTIONS.items():
        out += ["", f"{name}: {helps[name]}"]
        out += key_help_lines(cls, _yaml_value, prefix=f"{name}." if name in DOTTED_ONLY else "")
    return "\n".join(out)
