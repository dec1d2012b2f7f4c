"""What every engine's optimizer is built from: the learning-rate schedule and the parameter groups (weight decay)."""
from __future__ import annotations

import math


def lr_lambda_factory(total_steps: int, warmup_steps: int, schedule: str, min_ratio: float):
    """lr multiplier of optimizer step s (0-based): linear warmup to 1 over `warmup_steps`, then cosine or
    linear decay to `min_ratio` at the last step (constant: stays at 1)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps - 1)
        progress = min(1.0, (step - warmup_steps) / span)
        if schedule == "cosine":
            return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)

    return factor


def param_groups(model, weight_decay: float) -> list[dict]:
    """The trainable parameters in two groups: matrices decay by `weight_decay`, biases and norms (fewer than 2
    dimensions, or "norm" in the name) do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))  # ZeRO-3 (zero.Init) partitions are flat: use the full shape
        (no_decay if ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
