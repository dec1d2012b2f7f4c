"""DeepSpeed's JSON, built in code from TrainConfig (a template file may supply defaults; nothing is written to disk).

Gradient scaling contract (see train/engines/deepspeed_engine.py): the engine calls `engine.backward(loss,
scale_wrt_gas=False)`, so DeepSpeed does not divide by gradient_accumulation_steps; it still averages gradients over
its data-parallel world (all ranks, dp x sp), which the trainer undoes by multiplying the local loss by the world size
(the engine's `backward_scale`).
"""
from __future__ import annotations

import copy
from pathlib import Path

import orjson

from common.config import ConfigError
from train.config.sections import TrainConfig


def _merge(base: dict, extra: dict) -> dict:
    """Recursive dict merge: keys of `extra` win, nested sections merged."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_deepspeed_config(cfg: TrainConfig) -> dict:
    ds = cfg.deepspeed
    if ds.stage is None:
        raise ValueError("build_deepspeed_config: deepspeed.stage is null (no DeepSpeed)")
    base = orjson.loads(Path(ds.template).read_bytes()) if ds.template else {}
    # offload: on when the YAML flag or the template says so (a template's offload settings are kept as written)
    base_zero = base.get("zero_optimization") or {}
    zero: dict = {"stage": ds.stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": _pin_memory()}
    elif not _offloads(base_zero.get("offload_optimizer")):
        zero["offload_optimizer"] = {"device": "none"}
    if ds.stage == 3:
        if ds.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": _pin_memory()}
        elif not _offloads(base_zero.get("offload_param")):
            zero["offload_param"] = {"device": "none"}
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    elif _offloads(base_zero.get("offload_param")):
        raise ConfigError(f"deepspeed.template {ds.template} offloads parameters, which needs deepspeed.stage 3, "
                          f"got {ds.stage}")
    built = {
        # the micro-batch is one varlen sequence (batch dimension 1); DeepSpeed derives train_batch_size
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.steps.grad_accum,
        "gradient_clipping": cfg.optim.max_grad_norm,
        "bf16": {"enabled": cfg.model.bf16},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        # the optimizer is torch's AdamW given by the trainer, except with optimizer offload (DeepSpeedCPUAdam)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if _offloads(zero.get("offload_optimizer") or base_zero.get("offload_optimizer")):
        built["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": cfg.optim.lr,
                "betas": [cfg.optim.adam_beta1, cfg.optim.adam_beta2],
                "eps": cfg.optim.adam_eps,
                "weight_decay": cfg.optim.weight_decay,
            },
        }
    # template values are defaults; what the config decides (stage, gas, clipping, precision) wins
    for key in ("train_batch_size",):
        base.pop(key, None)
    merged = _merge(base, built)
    return _merge(merged, ds.overrides)


def _offloads(section: dict | None) -> bool:
    return bool(section) and section.get("device", "none") not in (None, "none")


def offloads_optimizer(ds_config: dict) -> bool:
    """Whether the built config offloads the optimizer states: DeepSpeed then builds its own (CPU) optimizer from
    the config's `optimizer` section instead of the trainer's torch AdamW."""
    return _offloads((ds_config.get("zero_optimization") or {}).get("offload_optimizer"))


def _pin_memory() -> bool:
    import torch

    return torch.cuda.is_available()


def skip_unused_cpu_comm_op() -> None:
    """On DeepSpeed's CPU accelerator, skip the shared-memory all-reduce its communication backend compiles when it
    starts (a JIT C++ build: 27 s on a 2-core VM, about 2 minutes measured on another, again for every new checkout
    or environment path), which only `inference_all_reduce` uses: training never calls it, and that call falls back
    to the process group's all_reduce without it. DeepSpeed decides from its table of compatible ops (`deepspeed.ops.__compatible_ops__`,
    probed once per process and kept so that edits persist); the op is marked incompatible there. Other
    accelerators have no such op: nothing changes."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    builder = accelerator.create_op_builder("ShareMemCommBuilder") if accelerator.device_name() == "cpu" else None
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
