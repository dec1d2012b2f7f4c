"""A varlen kernel of train/attention/varlen_kernels.py called by name, for the tests that compare kernels and paths."""
from __future__ import annotations

import torch

from train.attention.varlen_kernels import KERNELS, NO_FEATURES, AttentionFeatures
from train.row import Row


def varlen_attention(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Row, scale: float | None,
    features: AttentionFeatures = NO_FEATURES, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel `name` on q [Tq, H, D], k/v [Tk, Hkv, D] -> [Tq, H, D] with the layer's `features` (and its sinks [H]
    when features.has_sinks); raises with its reasons if it cannot run."""
    if features.has_sinks != (sinks is not None):
        raise ValueError(f"features.has_sinks={features.has_sinks} but sinks {'absent' if sinks is None else 'given'}")
    kernel = KERNELS[name]
    if reasons := kernel.reasons(q, features):
        raise RuntimeError(f"attention kernel {name!r} cannot run here: " + "; ".join(reasons))
    return kernel.fn(q, k, v, bounds, scale, features, sinks)
