"""The start-up checks that read something: run before any weight loads, by `sh train.sh` before accelerate starts a
process (a bad config is refused in seconds, naming the key) and by every trainer process before the model loads.

`preflight(cfg, world_size)` runs, in order: the rules of the values (`TrainConfig.validate`); what the machine
offers (CUDA for bf16 and Liger, the installed logging backends, a named attention or sequence-parallel backend's
kernels); what output_dir already holds (links, the `latest` pointer); the paths (online packing's sequence
lengths); then the model's config, read here once (`Preflight.model_config`, which the trainer carries to everything
that needs it: the family check, the attention plan, the memory estimate, the model itself and the checkpoints'
model record), against the data: loss tokens, token ids within the vocabulary, the shards' tokenizer hash, the
tokenizer final/ is exported with, positions past the model's range (a warning), tree rows under sequence
parallelism, outputs the data pipeline marked stale; and the checkpoint a resume starts from against the run (its
data, global batch, step count and model).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, pretrained_dir, relative_note
from train.config.sections import TrainConfig

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Preflight:
    """What the checks found, for the trainer: nothing here is read again."""

    model_config: Any  # transformers' PretrainedConfig of model_path / model_config, read once
    eval_path: str | None  # the eval set (eval_data_path, or the pipeline's eval split beside data_path), or None
    tokenizer_path: str | None  # the tokenizer exported with the model (tokenizer_path, model_path's, the shards')

    @property
    def text_config(self):
        """The text part of the model config (the config itself for a text-only model)."""
        config = self.model_config
        return config.get_text_config() if hasattr(config, "get_text_config") else config


def preflight(cfg: TrainConfig, world_size: int = 1) -> Preflight:
    """Every check before the model loads; raises ConfigError naming the key."""
    cfg.validate(world_size)
    check_machine(cfg)
    check_kernels(cfg)
    check_output_dir(cfg)
    check_paths(cfg)
    model_config = read_model_config(cfg)
    check_expert_parallel(cfg, model_config)
    check_lora_targets(cfg, model_config)
    checked = Preflight(model_config, eval_path(cfg), resolved_tokenizer(cfg)[0])
    check_data(cfg, checked)
    check_resume(cfg, model_config, world_size)
    return checked


def check_expert_parallel(cfg: TrainConfig, model_config) -> None:
    """expert_parallel_size against the model: an MoE family whose experts the table marks, experts divisible."""
    from train.config.ep_rules import model_expert_parallel_problem

    problem = model_expert_parallel_problem(cfg.parallel.expert_parallel_size, model_config,
                                            getattr(model_config, "model_type", "?"))
    if problem:
        raise ConfigError(problem)



def check_lora_targets(cfg: TrainConfig, model_config) -> None:
    """LoRA's target_modules / target_parameters against the model's module names, on a meta-device model (its
    modules, no memory, no weights read): a target that matches nothing, the output head, the routed experts named
    as a module are refused now, not after the weights have loaded (minutes for a large checkpoint). A model that
    cannot be built on the meta device is left to the same check in apply_lora."""
    if cfg.lora.lora_rank <= 0:
        return
    import copy

    import torch

    from train.model.composite import auto_model_class
    from train.model.lora import check_targets

    try:
        with torch.device("meta"):
            config = copy.deepcopy(model_config)  # transformers sets the attention on the config it is given
            model = auto_model_class(config).from_config(config, attn_implementation="eager")
    except Exception as err:  # noqa: BLE001 (a family's init that needs real tensors: apply_lora checks later)
        logging.getLogger(__name__).debug("LoRA targets not checked before loading: %s", err)
        return
    check_targets(model, cfg.lora.target_modules, cfg.lora.target_parameters, cfg.lora.lora_dropout)

# ---------------------------------------------------------------------------------------------- the machine
def check_machine(cfg: TrainConfig) -> None:
    """CUDA where the config needs a GPU; the packages of the named logging backends and kernels."""
    model = cfg.model
    if model.bf16 and not _cuda_available():
        raise ConfigError("bf16: true needs a GPU (CUDA is not available); use bf16=false on CPU")
    if cfg.fsdp2.cpu_offload and not _cuda_available():
        raise ConfigError("fsdp2.cpu_offload: true needs a GPU (on the CPU the parameters are in host memory "
                          "already); use fsdp2.cpu_offload=false on CPU")
    if model.liger:
        if not _cuda_available():
            raise ConfigError("liger: true needs a GPU (Liger-Kernel runs Triton kernels); use liger=false on CPU")
        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError("liger: true needs liger-kernel (pip install liger-kernel), or set liger=false")
    for backend in cfg.logging.log_backends:
        if importlib.util.find_spec(backend) is None:
            raise ConfigError(f"log_backends: {backend} is not installed (pip install {backend})")


def check_kernels(cfg: TrainConfig) -> None:
    """A named attn_backend or sequence-parallel backend that cannot run on this machine (its device, the precision,
    the installed kernels), refused before any process starts instead of when the trainer plans its attention after
    the model has loaded. On CUDA machines the attention backend is checked by that plan on the training device
    (the launcher touches no GPU); what a backend cannot express of the model's layers (windows, softcaps, sinks) is
    the plan's too."""
    from train.attention.function import backend_problem
    from train.attention.sequence_parallel import SP_BACKENDS
    from train.attention.varlen_kernels import NO_FEATURES
    from train.config.backend_names import AUTO, TORCH

    model, parallel = cfg.model, cfg.parallel
    if model.attn_backend != AUTO and not _cuda_available():
        import torch

        probe = torch.empty((1, 1, 0, 1), dtype=torch.bfloat16 if model.bf16 else torch.float32)
        if problem := backend_problem(model.attn_backend, probe, NO_FEATURES):
            raise ConfigError(problem)
    if parallel.sequence_parallel_size != 1 and parallel.sp_backend in SP_BACKENDS and parallel.sp_backend != TORCH:
        reasons = SP_BACKENDS[parallel.sp_backend].reasons(model.bf16)
        if reasons:
            raise ConfigError("; ".join(reasons))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- output_dir
def check_output_dir(cfg: TrainConfig) -> None:
    """What output_dir already holds. PackSFT writes, replaces and removes its outputs there and never follows a
    link (a link to another folder would receive the checkpoints, and pruning or overwrite_output_dir would
    delete there): a link among them is refused. So is a step-N/ PackSFT did not write when starting over, a
    log.jsonl that is not PackSFT's log (the new run would truncate it), and an earlier run's checkpoints when
    neither resuming nor overwriting."""
    from train.checkpoint import CheckpointError, checkpoint_root, foreign_step_dirs, latest_pointer, list_checkpoints
    from train.metrics import read_log

    ckpt = cfg.checkpoint
    links = output_links(ckpt.output_dir)
    if links:
        raise ConfigError(
            f"output_dir: {links[0]} is a symbolic link to {os.readlink(links[0])}: PackSFT writes, replaces and "
            "removes its outputs in output_dir and follows no link there. Replace the link by a directory (move "
            "its content in), or set output_dir to a directory on that storage (output_dir itself may be a link)"
        )
    starting_over = ckpt.resume == "none" and ckpt.overwrite_output_dir
    foreign = foreign_step_dirs(ckpt.output_dir) if starting_over else []
    if foreign:
        raise ConfigError(f"output_dir: {foreign[0]}; overwrite_output_dir=true removes only PackSFT's own "
                          "checkpoints and the new run would replace this directory: move it out of output_dir")
    read_log(ckpt.output_dir)
    if ckpt.resume == "latest":
        try:  # a pointer naming a path outside checkpoints/: refused before anything loads
            latest_pointer(checkpoint_root(ckpt.output_dir))
        except CheckpointError as exc:
            raise ConfigError(f"resume=latest: {exc}") from None
    if ckpt.resume not in ("none", "latest") and not Path(ckpt.resume).is_dir():
        raise ConfigError(f"resume: {ckpt.resume} is not a checkpoint directory (or use none / latest)"
                          f"{relative_note(ckpt.resume)}")
    if ckpt.resume == "none" and not ckpt.overwrite_output_dir:
        earlier = list_checkpoints(ckpt.output_dir)
        if earlier:
            raise ConfigError(
                f"output_dir: {ckpt.output_dir} holds checkpoints of an earlier run ({earlier[-1].name}); "
                "resume=latest continues it, overwrite_output_dir=true starts over, or use another output_dir"
            )


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


# ---------------------------------------------------------------------------------------------- paths
def check_paths(cfg: TrainConfig) -> None:
    data_path, model = cfg.data.data_path, cfg.model
    if not Path(data_path).is_dir():
        raise ConfigError(f"data_path: {data_path} is not a directory (run sh data_process.sh first?)"
                          f"{relative_note(data_path)}")
    if not (Path(data_path) / "meta.json").is_file():
        raise ConfigError(f"data_path: {data_path} has no meta.json: not a packed dataset"
                          f"{pipeline_output_hint(data_path)}")
    if cfg.data.online_max_length is not None and checked_meta(data_path).get("kind") != "tokenized":
        raise ConfigError(
            f"online_max_length is set but data_path {data_path} is already packed; point data_path at a "
            "tokenized/ directory for online packing, or drop online_max_length"
        )
    if cfg.data.online_max_length is not None:
        check_online_lengths(data_path, cfg.data.online_max_length)
    named_eval = cfg.eval.eval_data_path
    if named_eval not in (None, "none") and not (Path(named_eval) / "meta.json").is_file():
        raise ConfigError(f"eval_data_path: {named_eval} is not a packed dataset (no meta.json)"
                          f"{relative_note(named_eval)}")
    if cfg.eval.eval_steps and eval_path(cfg) is None:
        raise ConfigError(f"eval_steps is set but eval_data_path is not, and there is no eval split beside "
                          f"data_path ({pipeline_eval_split(data_path)}): set eval_size in the data config, "
                          "or eval_data_path")
    model_dir = pretrained_dir(model.model_path, "model_path") if model.model_path is not None else None
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise ConfigError(f"model_path: {model.model_path} has no config.json")
    if model.model_config is not None and not Path(model.model_config).is_file():
        raise ConfigError(f"model_config: {model.model_config} does not exist{relative_note(model.model_config)}")
    if model.tokenizer_path is not None:
        pretrained_dir(model.tokenizer_path, "tokenizer_path")
    template = cfg.deepspeed.template
    if template is not None and not Path(template).is_file():
        raise ConfigError(f"deepspeed.template: {template} does not exist{relative_note(template)}")


def check_online_lengths(data_path: str, online_max_length: int) -> None:
    """Online packing puts each tokenized sequence whole into a row of online_max_length tokens: none may be
    longer (from the shard index, no token read)."""
    from data.shards.dataset import PackedDataset

    lengths = np.asarray(PackedDataset(data_path, verify="off").row_n_tokens)
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > online_max_length:
        raise ConfigError(
            f"online_max_length={online_max_length}: data_path {data_path} holds sequences of up to {longest:,} tokens "
            f"({int((lengths > online_max_length).sum()):,} longer than {online_max_length:,}), and online packing "
            f"puts each one whole into a row: set online_max_length >= {longest}, or tokenize with max_length <= "
            f"{online_max_length} (sh data_process.sh CONFIG --stages merge,tokenize max_length={online_max_length})")


def pipeline_output_hint(data_path: str) -> str:
    """Where the data is when `data_path` is the data pipeline's output_dir (or holds it): its packed/ (or only
    tokenized/) directory; "" otherwise."""
    root = Path(data_path)
    for name, hint in (("packed", "the packed rows of sh data_process.sh are in its packed/ directory: "
                                  "data_path={}"),
                       ("tokenized", "it holds a tokenized/ directory but no packed/ one: run the pack stage (sh "
                                     "data_process.sh CONFIG --stages pack), or pack while training with "
                                     "data_path={} online_max_length=N")):
        if (root / name / "meta.json").is_file():
            return "; " + hint.format(root / name)
    return ""


def eval_path(cfg: TrainConfig) -> str | None:
    """The eval set: eval_data_path, else the eval split the data pipeline wrote beside data_path (None with
    `eval_data_path: none`, or without either)."""
    named = cfg.eval.eval_data_path
    if named == "none":
        return None
    if named:
        return named
    beside = pipeline_eval_split(cfg.data.data_path)
    return str(beside) if (beside / "meta.json").is_file() else None


def pipeline_eval_split(data_path: str) -> Path:
    """Where `sh data_process.sh` with `eval_size` puts the eval split of `<output_dir>/packed` (or tokenized/):
    `<output_dir>/eval/packed`."""
    return Path(data_path).parent / "eval" / "packed"


# ---------------------------------------------------------------------------------------------- the model config
def model_source(cfg: TrainConfig) -> tuple[str, str]:
    """(the key naming the model, its value): model_path or model_config."""
    model = cfg.model
    return ("model_path", model.model_path) if model.model_path is not None else ("model_config", model.model_config)


def read_model_config(cfg: TrainConfig):
    """transformers' config of the model (a Hub id through its local snapshot): the one read of a start."""
    from transformers import AutoConfig

    key, value = model_source(cfg)
    source = str(pretrained_dir(value, key)) if key == "model_path" else str(value)
    try:
        return AutoConfig.from_pretrained(source)
    except Exception as exc:  # transformers raises several types for a malformed config
        raise ConfigError(f"{key}: cannot read a model config from {source}: {exc}") from None


# ---------------------------------------------------------------------------------------------- resume
def check_resume(cfg: TrainConfig, model_config, world_size: int) -> None:
    """resume=latest or a checkpoint directory: the checkpoint it starts from (the first candidate) against this run,
    from its trainer_state.json, before any weight loads: the same data (unless resume_data_mismatch=allow), global
    batch and step count, model config and LoRA settings. Refused with the trainer's own words (ResumeRefused, a
    ConfigError), which checks the checkpoint it loads again. What is not known yet is left to it: the rows of
    online packing, the processes of sequence_parallel_size auto; so is a checkpoint that cannot be read."""
    import math

    from train.checkpoint import (CheckpointError, ResumeRefused, check_same_model, dataset_identity,
                                  load_trainer_state, model_identity, resume_candidates, resume_refusal)

    ckpt, steps = cfg.checkpoint, cfg.steps
    if ckpt.resume == "none":
        return
    try:
        candidates = resume_candidates(ckpt.resume, ckpt.output_dir, warn=lambda _: None)  # said by the trainer
        state = load_trainer_state(candidates[0]) if candidates else None
    except CheckpointError:
        return
    if not isinstance(state, dict):
        return
    rows = None if cfg.data.online_max_length is not None else int(checked_meta(cfg.data.data_path)["counts"]["rows"])
    sp, layout = cfg.parallel.sequence_parallel_size, None
    if rows is not None and sp != "auto":
        dp = world_size // sp
        rows_per_step = dp * steps.grad_accum * steps.micro_batch_rows
        total = steps.max_steps if steps.max_steps is not None else steps.num_epochs * math.ceil(rows / rows_per_step)
        layout = {"total_steps": total, "rows_per_step": rows_per_step, "dp_size": dp, "sp_size": sp,
                  "grad_accum": steps.grad_accum, "micro_batch_rows": steps.micro_batch_rows,
                  "max_steps": steps.max_steps, "num_epochs": steps.num_epochs}
    data = dataset_identity(cfg.data.data_path, rows) if rows is not None else None
    refusal, _ = resume_refusal(candidates[0], state, layout, data, ckpt.resume_data_mismatch)
    if refusal:
        raise ResumeRefused(refusal)
    try:
        check_same_model(candidates[0], state, model_identity(model_config, cfg.lora), cfg.model)
    except CheckpointError as exc:
        raise ResumeRefused(str(exc)) from None


# ---------------------------------------------------------------------------------------------- the data
def check_data(cfg: TrainConfig, checked: Preflight) -> None:
    """Loss tokens in every dataset; token ids below the model's vocabulary; the shards' tokenizer hash equal to
    the model tokenizer's. Both problems of a dataset are reported together, each with the key that fixes it."""
    text = checked.text_config
    vocab_size = int(text.vocab_size)
    key, value = model_source(cfg)
    for name, path in (("data_path", cfg.data.data_path), ("eval_data_path", checked.eval_path)):
        if path is None:
            continue
        meta = checked_meta(path)
        if not meta["counts"].get("loss_tokens"):
            raise ConfigError(
                f"{name}: {path} has no loss token (every label is -100): training on it would run steps of loss 0 "
                "and export the initial weights. Check the data config (the assistant turns and their labels, "
                "loss_turns) and re-run sh data_process.sh"
            )
        data_tok = meta_tokenizer_path(meta) or "an unrecorded tokenizer"
        problems = []
        max_id = max_token_id(path, meta)
        if max_id >= vocab_size:
            problems.append(
                f"token id {max_id} in {path} does not fit the vocabulary of {key}={value} "
                f"(vocab_size={vocab_size}): the data was tokenized with {data_tok}, for another model. Set "
                "model_path to a pretrained model of that tokenizer (a directory or a Hub id), or model_config to "
                f"a config.json with vocab_size > {max_id} (configs/train/qwen2_5_tiny.yaml does this for Qwen2.5 "
                "tokenizers)"
            )
        if name == "data_path":
            check_export_tokenizer(cfg, meta)
            check_tree_rows(cfg, meta, path)
        mismatch = tokenizer_hash_mismatch(cfg, meta, data_tok)
        if mismatch and (problems or cfg.model.tokenizer_mismatch == "error"):
            problems.append(mismatch + " (tokenizer_mismatch=warn trains anyway: only when both give the same ids)")
        elif mismatch:
            logger.warning(f"{name}: {mismatch}")
        if problems:
            raise ConfigError(f"{name}: " + "; and ".join(problems))
        warn_past_max_positions(cfg, text, name, path)
        check_not_stale(cfg, name, path)


def check_tree_rows(cfg: TrainConfig, meta: dict, path: str) -> None:
    """Stepwise trees under a fixed sequence-parallel degree above 1 (`auto` is checked once the degree is
    chosen, when the trainer opens the data)."""
    from data.shards.dataset import Structure, structure_of

    sp = cfg.parallel.sequence_parallel_size
    if isinstance(sp, int) and sp > 1 and structure_of(meta.get("token_fields") or {}) is Structure.TREE:
        from train.config.sp_rules import TREE_SP_REFUSAL

        raise ConfigError(f"data_path {path}: {TREE_SP_REFUSAL} (sequence_parallel_size={sp})")


def check_not_stale(cfg: TrainConfig, name: str, path: str) -> None:
    """A dataset the data pipeline's report.json lists as stale (`--stages tokenize` alone after pack: packed/ is the
    earlier tokenized data's) is refused, or with stale_data=warn trained with a warning."""
    from data.shards.dataset import stale_stages

    found = stale_stages(path)
    if found is None:
        return
    report, stages = found
    message = (f"{name}: {path} is stale: the data pipeline ran an earlier stage after {stages[0]} wrote it ({report} "
               f"lists {stages[0]} under `stale`), so it does not hold what that run made; re-run sh data_process.sh "
               f"<your data config> --stages {','.join(stages)}")
    if cfg.data.stale_data == "warn":
        logger.warning(message + " (stale_data=warn: training on it as it is)")
        return
    raise ConfigError(message + ", or set stale_data=warn to train on it as it is")


def check_export_tokenizer(cfg: TrainConfig, meta: dict) -> None:
    """The tokenizer final/ is exported with must exist now, not be found missing after the last step (the
    shards' meta.json of older pipelines holds the path as typed, relative to where the data was built)."""
    recorded = meta_tokenizer_path(meta)
    if recorded is None or resolved_tokenizer(cfg, meta)[0] is not None:
        return
    where = "" if Path(recorded).is_absolute() else f" (a relative path, from {os.getcwd()} here)"
    model_path = cfg.model.model_path
    model = f"model_path {model_path} holds no tokenizer files, and " if model_path else ""
    raise ConfigError(
        f"tokenizer_path: not set; {model}the shards' meta.json names the tokenizer {recorded}, which does not "
        f"exist{where}: the model would be exported without its tokenizer. Set tokenizer_path to the tokenizer "
        "the data was tokenized with"
    )


def tokenizer_hash_mismatch(cfg: TrainConfig, meta: dict, data_tok: str) -> str | None:
    tok_path, key = resolved_tokenizer(cfg, meta)
    data_hash = meta_tokenizer_hash(meta)
    if tok_path is None or data_hash is None:
        return None
    model_hash = tokenizer_hash_of(tok_path)
    if model_hash is None or model_hash == data_hash:
        return None
    if cfg.model.model_path is not None:  # its embeddings belong to its own tokenizer's ids
        advice = (f"the model is pretrained, its embeddings belong to the ids of its own tokenizer, so "
                  f"re-tokenize the data with the model's tokenizer: tokenizer_path: {tok_path} in the data config, "
                  "then sh data_process.sh again")
    else:
        advice = "set tokenizer_path to the tokenizer the data was tokenized with"
    return (
        f"the shards were tokenized with {data_tok} (tokenizer hash {data_hash}) but the tokenizer exported with "
        f"the model, {tok_path} (from {key}), has hash {model_hash}: {advice}"
    )


def resolved_tokenizer(cfg: TrainConfig, meta: dict | None = None) -> tuple[str | None, str]:
    """(the tokenizer exported with the model, the key it came from): tokenizer_path, else model_path when it holds
    a tokenizer, else the shards' tokenizer when it exists; (None, "") without one."""
    model = cfg.model
    if model.tokenizer_path:
        return str(pretrained_dir(model.tokenizer_path, "tokenizer_path")), "tokenizer_path"
    if model.model_path:
        model_dir = pretrained_dir(model.model_path, "model_path")
        if any((model_dir / f).is_file() for f in TOKENIZER_FILES):
            return str(model_dir), "model_path"
    meta = meta if meta is not None else checked_meta(cfg.data.data_path)
    tok = meta_tokenizer_path(meta)
    return (tok, "the shards' meta.json") if tok and Path(tok).exists() else (None, "")


def meta_tokenizer_path(meta: dict) -> str | None:
    tok = meta.get("tokenizer")
    return meta.get("tokenizer_path") or (tok.get("path") if isinstance(tok, dict) else None)


def meta_tokenizer_hash(meta: dict) -> str | None:
    tok = meta.get("tokenizer")
    if isinstance(tok, dict) and tok.get("hash"):
        return tok["hash"]
    return meta.get("tokenizer_hash")


def checked_meta(path: str | os.PathLike) -> dict:
    """The dataset's manifest, checked (format, and its own checksum: data.shards.dataset.read_meta); a damaged one
    is a ConfigError of the key naming it."""
    from data.shards.dataset import ShardFormatError, read_meta

    try:
        return read_meta(path)
    except ShardFormatError as exc:
        raise ConfigError(str(exc)) from None


def tokenizer_hash_of(path: str | os.PathLike) -> str | None:
    """The packing pipeline's tokenizer hash of `path` (common.fsutil.tokenizer_hash), None without tokenizer files."""
    from common.fsutil import tokenizer_hash

    try:
        return tokenizer_hash(path)
    except FileNotFoundError:
        return None


def max_token_id(path: str | os.PathLike, meta: dict | None = None) -> int:
    """Largest input id of a packed dataset: from a checksummed manifest, else a chunked scan of the shards (an older
    manifest without its checksum may have been edited)."""
    from data.shards.dataset import PackedDataset, trusted_manifest

    meta = meta if meta is not None else checked_meta(path)
    if trusted_manifest(meta) and isinstance(meta.get("max_token_id"), int):
        return meta["max_token_id"]
    best = -1
    for chunk in PackedDataset(path).token_chunks():
        if len(chunk):
            best = max(best, int(np.max(chunk["input_ids"])))
    return best


def warn_past_max_positions(cfg: TrainConfig, text_config, name: str, path: str) -> None:
    """A warning when the dataset's longest sequence (from the shard index) is longer than the model's
    max_position_embeddings: it would train on positions the model has no embedding / RoPE range for."""
    limit = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return  # recurrent models: no position limit
    from data.shards.dataset import PackedDataset

    lengths = PackedDataset(path, verify="off").seq_column("length")
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > limit:
        key, value = model_source(cfg)
        logger.warning(
            f"{name}: the longest sequence of {path} has {longest:,} tokens, more than max_position_embeddings="
            f"{limit:,} of {key}={value} ({int((lengths > limit).sum()):,} such sequences): positions "
            f"past {limit:,} are outside the model's trained range. Re-pack with max_length <= {limit}, or use a "
            "model with a longer context"
        )
