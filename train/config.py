"""Typed trainer configuration: one YAML file plus `key=value` overrides (`a.b=value` for sections).

`TrainConfig.validate(world_size)` checks every invariant before the model is loaded, so a bad path, a vocabulary
mismatch or an impossible parallel layout fails in a second with a message naming the field, not after minutes of
model loading.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import yaml

from data.config import ConfigError, apply_overrides, from_dict, to_dict

logger = logging.getLogger(__name__)


@dataclass
class DeepSpeedSection:
    """stage None: no DeepSpeed (plain torch optimizer, gradients summed over ranks with all_reduce)."""

    stage: Literal[0, 1, 2, 3] | None = None
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (stage 2 or 3)
    offload_param: bool = False  # parameters too (stage 3 only)
    template: str | None = None  # a JSON file (e.g. configs/deepspeed/zero2.json) whose keys are the defaults
    overrides: dict = field(default_factory=dict)  # raw keys merged last into the built DeepSpeed dict


@dataclass
class LaunchSection:
    """Settings `train.sh` passes to `accelerate launch` (multi-node: one launch per machine)."""

    num_processes: int = 1  # total over all machines
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int = 29500


@dataclass
class TrainConfig:
    data_path: str  # a packed dataset directory (data.shards format)
    output_dir: str
    model_path: str | None = None  # HF model directory (weights loaded)
    model_config: str | None = None  # or: an HF config.json, random init (the CPU example)
    tokenizer_path: str | None = None  # exported with the model; default: model_path, then the shards' tokenizer
    eval_data_path: str | None = None
    max_steps: int | None = None  # optimizer steps; None: num_epochs over the data
    num_epochs: int = 1
    micro_batch_rows: int = 1  # packed rows concatenated into one micro-batch
    grad_accum: int = 1
    lr: float = 1e-5
    warmup_steps: int | None = None  # None: warmup_ratio * total steps
    warmup_ratio: float = 0.0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0  # cosine / linear decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping
    bf16: bool = False  # GPU only
    # activation checkpointing: true | false | auto (GPU: on when the estimated memory of a micro-batch without it
    # exceeds the free memory, train/memory_plan.py; CPU: on when the rows are at least `checkpointing_min_length` long)
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    checkpointing_min_length: int = 8192
    compile_layers: bool = False  # torch.compile each decoder layer (the attention call stays eager)
    liger: bool = False  # Liger-Kernel's fused RMSNorm / SwiGLU / RoPE (needs CUDA and liger-kernel)
    seed: int = 42
    save_steps: int = 0  # 0: only the final checkpoint
    save_total_limit: int = 2  # resumable checkpoints kept
    eval_steps: int = 0  # 0: no evaluation (needs eval_data_path)
    loss_reduction: Literal["token", "turn", "sample"] = "token"
    loss_chunk_size: int = 4096  # tokens per lm-head chunk
    attn_backend: Literal["auto", "flash_varlen", "torch_varlen", "flex", "sdpa"] = "auto"  # train/attention.py
    sequence_parallel_size: int = 1
    sp_backend: Literal["auto", "torch", "llama3", "zigzag"] = "auto"
    log_backends: list[str] = field(default_factory=list)  # "tensorboard", "wandb" (offline)
    wandb_project: str = "packsft"
    resume: str = "none"  # none | latest | a checkpoint directory
    overwrite_output_dir: bool = False  # resume=none into an output_dir with checkpoints: start over (else an error)
    stop_at_step: int | None = None  # stop (with a checkpoint) after this step, as a time-limited job would
    tokenizer_mismatch: Literal["warn", "error"] = "error"  # shards' tokenizer hash vs the model's tokenizer
    plot: bool = True  # loss curves PNG at the end
    # LoRA (train/lora.py); lora_rank 0 = full fine-tuning
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    lora_merge_on_save: bool = True
    balance_dp: bool = False  # train/balance.py: balance the step's rows over dp ranks by tokens
    online_max_length: int | None = None  # data_path is a tokenized dataset packed on the fly (train/online.py)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    launch: LaunchSection = field(default_factory=LaunchSection)

    # ------------------------------------------------------------------ derived
    @property
    def out(self) -> Path:
        return Path(self.output_dir)

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
        self.validate_values(world_size)
        self.validate_paths()
        self.validate_data()

    def validate_values(self, world_size: int = 1) -> None:
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
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("save_steps", "eval_steps", "lora_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.save_total_limit < 1:
            raise ConfigError(f"save_total_limit must be >= 1, got {self.save_total_limit}")
        if self.max_grad_norm < 0:
            raise ConfigError(f"max_grad_norm must be >= 0, got {self.max_grad_norm}")
        if self.eval_steps and not self.eval_data_path:
            raise ConfigError("eval_steps is set but eval_data_path is not")
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
        per_machine = self.launch.num_processes // self.launch.num_machines
        if per_machine % self.sequence_parallel_size:
            raise ConfigError(
                f"sequence_parallel_size={self.sequence_parallel_size} does not divide the {per_machine} processes per "
                f"machine (launch.num_processes={self.launch.num_processes} / launch.num_machines="
                f"{self.launch.num_machines}): a sequence-parallel group must not span machines"
            )
        if self.launch.num_machines > 1 and not self.launch.main_process_ip:
            raise ConfigError("launch.main_process_ip is required when launch.num_machines > 1")
        ds = self.deepspeed
        if ds.offload_param and ds.stage != 3:
            raise ConfigError(f"deepspeed.offload_param needs deepspeed.stage 3, got {ds.stage}")
        if ds.offload_optimizer and ds.stage not in (2, 3):
            raise ConfigError(f"deepspeed.offload_optimizer needs deepspeed.stage 2 or 3, got {ds.stage}")
        if self.bf16 and not _cuda_available():
            raise ConfigError("bf16: true needs a GPU (CUDA is not available); use bf16=false on CPU")
        if self.liger:
            if not _cuda_available():
                raise ConfigError("liger: true needs a GPU (Liger-Kernel runs Triton kernels); use liger=false on CPU")
            if importlib.util.find_spec("liger_kernel") is None:
                raise ConfigError("liger: true needs liger-kernel (pip install liger-kernel), or set liger=false")
        if self.resume not in ("none", "latest") and not Path(self.resume).is_dir():
            raise ConfigError(f"resume: {self.resume} is not a checkpoint directory (or use none / latest)")
        if self.resume == "none" and not self.overwrite_output_dir:
            from train.checkpoint import list_checkpoints

            earlier = list_checkpoints(self.output_dir)
            if earlier:
                raise ConfigError(
                    f"output_dir: {self.output_dir} holds checkpoints of an earlier run ({earlier[-1].name}); "
                    "resume=latest continues it, overwrite_output_dir=true starts over, or use another output_dir"
                )

    def validate_paths(self) -> None:
        if not Path(self.data_path).is_dir():
            raise ConfigError(f"data_path: {self.data_path} is not a directory (run sh data_process.sh first?)")
        if not (Path(self.data_path) / "meta.json").is_file():
            raise ConfigError(f"data_path: {self.data_path} has no meta.json: not a packed dataset")
        if self.online_max_length is not None and read_meta(self.data_path).get("kind") != "tokenized":
            raise ConfigError(
                f"online_max_length is set but data_path {self.data_path} is already packed; point data_path at a "
                "tokenized/ directory for online packing, or drop online_max_length"
            )
        if self.eval_data_path and not (Path(self.eval_data_path) / "meta.json").is_file():
            raise ConfigError(f"eval_data_path: {self.eval_data_path} is not a packed dataset (no meta.json)")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ConfigError(f"model_path: {self.model_path} has no config.json")
        if self.model_config is not None and not Path(self.model_config).is_file():
            raise ConfigError(f"model_config: {self.model_config} does not exist")
        if self.tokenizer_path is not None and not Path(self.tokenizer_path).exists():
            raise ConfigError(f"tokenizer_path: {self.tokenizer_path} does not exist")
        if self.deepspeed.template is not None and not Path(self.deepspeed.template).is_file():
            raise ConfigError(f"deepspeed.template: {self.deepspeed.template} does not exist")

    def validate_data(self) -> None:
        """Token ids below the model's vocabulary; the shards' tokenizer hash equal to the model tokenizer's."""
        vocab_size = model_vocab_size(self)
        for name in ("data_path", "eval_data_path"):
            path = getattr(self, name)
            if path is None:
                continue
            meta = read_meta(path)
            max_id = max_token_id(path, meta)
            if max_id >= vocab_size:
                raise ConfigError(
                    f"{name}: token id {max_id} in {path} does not fit the model's vocabulary "
                    f"(vocab_size={vocab_size}); the data was tokenized for another model"
                )
            self._check_tokenizer_hash(name, meta)

    def _check_tokenizer_hash(self, name: str, meta: dict) -> None:
        tok_path = self.resolved_tokenizer_path(meta)
        data_hash = _meta_tokenizer_hash(meta)
        if tok_path is None or data_hash is None:
            return
        model_hash = tokenizer_hash(tok_path)
        if model_hash is None or model_hash == data_hash:
            return
        message = (
            f"{name}: the shards were tokenized with tokenizer hash {data_hash} but the model's tokenizer "
            f"{tok_path} has hash {model_hash}"
        )
        if self.tokenizer_mismatch == "error":
            raise ConfigError(message + " (set tokenizer_mismatch=warn to train anyway)")
        logger.warning(message)

    def resolved_tokenizer_path(self, meta: dict | None = None) -> str | None:
        """tokenizer_path, else model_path when it holds a tokenizer, else the shards' tokenizer."""
        if self.tokenizer_path:
            return self.tokenizer_path
        if self.model_path and any((Path(self.model_path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return self.model_path
        meta = meta if meta is not None else read_meta(self.data_path)
        tok = meta.get("tokenizer_path") or (meta.get("tokenizer") or {}).get("path")
        return tok if tok and Path(tok).exists() else None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def read_meta(path: str | os.PathLike) -> dict:
    import orjson

    meta_file = Path(path) / "meta.json"
    try:
        return orjson.loads(meta_file.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{meta_file}: invalid JSON: {exc}") from None


def _meta_tokenizer_hash(meta: dict) -> str | None:
    tok = meta.get("tokenizer")
    if isinstance(tok, dict) and tok.get("hash"):
        return tok["hash"]
    return meta.get("tokenizer_hash")


def tokenizer_hash(path: str | os.PathLike) -> str | None:
    """The packing pipeline's tokenizer hash of `path` (data.shards.tokenizer_hash), None without tokenizer files."""
    from data.shards import tokenizer_hash as data_tokenizer_hash

    try:
        return data_tokenizer_hash(path)
    except FileNotFoundError:
        return None


def max_token_id(path: str | os.PathLike, meta: dict | None = None) -> int:
    """Largest input id of a packed dataset: from the manifest when recorded, else a chunked scan of the shards."""
    meta = meta if meta is not None else read_meta(path)
    for key in ("max_token_id", "max_input_id"):
        if isinstance(meta.get(key), int):
            return meta[key]
    from data.shards import PackedDataset

    best = -1
    for chunk in PackedDataset(path).token_chunks():
        if len(chunk):
            best = max(best, int(np.max(chunk["input_ids"])))
    return best


def model_vocab_size(cfg: TrainConfig) -> int:
    from transformers import AutoConfig

    source = cfg.model_path if cfg.model_path is not None else cfg.model_config
    try:
        model_cfg = AutoConfig.from_pretrained(source)
    except Exception as exc:  # transformers raises several types for a malformed config
        field_name = "model_path" if cfg.model_path is not None else "model_config"
        raise ConfigError(f"{field_name}: cannot read a model config from {source}: {exc}") from None
    text_cfg = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
    return int(text_cfg.vocab_size)


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    apply_overrides(raw, overrides or [])
    return from_dict(TrainConfig, raw, where=str(path))
