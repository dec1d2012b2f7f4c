"""Non-finite training: the `nonfinite` policy of an optimizer step, and the check of the weights before an export.

Why: a diverging run (lr far too high) turned its loss nan at step 2 and went on for every later step without a
word, pruned the finite checkpoints and exported a `final/` whose every tensor was nan. The step's loss and
gradient norm are the same on every rank (both all-reduced), so every rank takes the same decision.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from common.errors import PackSFTError

SKIPPED = "nonfinite"  # the `skipped` value of a step record whose update nonfinite=skip_step skipped


class NonFiniteError(PackSFTError, RuntimeError):
    """A step's loss or gradient is inf or nan and `nonfinite` is `stop`: the message names the step, what was
    non-finite, the last (finite) checkpoint and what to do."""

    label = "training stopped"


def nonfinite_problem(loss: float, grad_norm: float | None = None) -> str | None:
    """What is not finite in a step ("the loss is nan", "the gradient norm is inf", both), None when nothing."""
    parts = []
    if not math.isfinite(loss):
        parts.append(f"the loss is {loss}")
    if grad_norm is not None and not math.isfinite(grad_norm):
        parts.append(f"the gradient norm is {grad_norm}")
    return " and ".join(parts) or None


def gradient_norm(grads: Iterable[torch.Tensor], chunk: int = 1 << 24) -> float:
    """The L2 norm of all `grads` together, accumulated in float64 over chunks of `chunk` elements (memory: one
    float64 chunk). torch's fp32 norm on CPU was 1.5e-5 off the exact value over the 10M-element gradient of a
    152K-token embedding (configs/model/tiny_qwen2_5_vl.json); DeepSpeed's ZeRO norm was exact."""
    squares = [torch.linalg.vector_norm(flat[start:start + chunk], dtype=torch.float64).square()
               for flat in (grad.detach().reshape(-1) for grad in grads)
               for start in range(0, flat.numel(), chunk)]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0  # one device sync


def stop_message(step: int, problem: str, lr: float, last_checkpoint) -> str:
    where = (f"the last checkpoint, {last_checkpoint}, holds finite weights" if last_checkpoint is not None else
             "no checkpoint was saved before it")
    return (f"step {step}: {problem} (lr {lr:.3g}): stopped there (nonfinite=stop); nothing of that step was saved "
            f"or exported, and {where}. Lower lr (or max_grad_norm), then continue with resume=latest (or start "
            "over), or set nonfinite=skip_step to skip the update of such steps and train on")


def nonfinite_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], int]:
    """(names of the floating-point tensors holding inf or nan, number of tensors looked at)."""
    bad, total = [], 0
    for name, tensor in named_tensors:
        total += 1
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    return bad, total
