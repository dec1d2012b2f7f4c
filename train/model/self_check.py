"""Packed vs unpacked: does a model train the same on a packed row as on each of its sequences alone?

`compare_packed_with_reference(model, sequences, kernels)` runs the same weights twice:
- reference: the model's own `*ForCausalLM.forward` on each sequence alone, with transformers' eager attention
  (its own masks, windows, softcaps, sinks and logit transforms), cross-entropy of every next token;
- packed: the sequences concatenated into one row through `train.model.packed.PackedCausalLM` (PackSFT's attention
  as `kernels` run it, recurrent-layer restarts and chunked loss head), with the same token-mean weights;
and returns the relative loss difference and the worst per-parameter gradient difference.

Used by the conformance suite on tiny configs of every family (full gradients) and by the trainer's start-up
self-check on the user's real model (`gradient_probe=True`: each parameter's gradient is compared through its dot
product with a seeded random direction, so no second copy of the gradients is kept), on a few sequences of the data
(`self_check_sequences`).
"""
from __future__ import annotations

import itertools
import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import ConfigError, pretrained_dir
from common.errors import PackSFTError
from train.attention.function import AttentionContext, LayerKernels

# Relative tolerances of a correct packed path against the eager reference. In fp32 a gradient's error is measured
# per parameter, against the larger of its own magnitude and 1e-3 of the largest gradient of the model: parameters
# whose true gradient is zero (e.g. the key bias, which softmax ignores) carry only rounding noise. In half precision
# both paths round differently at every matmul, and a parameter whose gradient is small next to that noise (the
# query projections of deep layers at random init: attention there is near uniform) can differ by more than the
# tolerance with nothing wrong (seen on an H200: a Qwen2.5-1.5B shape, 0.11 at layer 19's q_proj, loss equal to
# 3e-5). There the gradients are judged together: the norm of the whole difference over the norm of the whole
# gradient. A packed path that is structurally wrong (a leaking mask, wrong positions) moves that by O(1).
TOLERANCES = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 1e-1),
    torch.float16: (1e-2, 5e-2),
}
GRAD_FLOOR = 1e-3


class SelfCheckError(PackSFTError, RuntimeError):
    """The packed path does not reproduce the model's own unpacked forward (the trainer's start-up self-check)."""

    label = "self-check failed"


@dataclass(frozen=True)
class PackedCheck:
    loss_packed: float
    loss_reference: float
    loss_error: float  # |packed - reference| / |reference|
    grad_error: float  # fp32: the worst per-parameter relative difference; half precision: all parameters together
    worst_parameter: str | None  # the parameter of the largest per-parameter relative difference
    dtype: torch.dtype
    worst_parameter_error: float = 0.0

    @property
    def tolerances(self) -> tuple[float, float]:
        return TOLERANCES.get(self.dtype, TOLERANCES[torch.bfloat16])

    @property
    def ok(self) -> bool:
        loss_tol, grad_tol = self.tolerances
        return self.loss_error <= loss_tol and self.grad_error <= grad_tol

    @property
    def per_parameter(self) -> bool:
        return self.dtype == torch.float32

    def describe(self) -> str:
        loss_tol, grad_tol = self.tolerances
        loss = (f"loss packed {self.loss_packed:.6g} vs unpacked {self.loss_reference:.6g} (relative difference "
                f"{self.loss_error:.1e}, tolerance {loss_tol:.0e})")
        if self.per_parameter:
            return (f"{loss}; worst gradient difference {self.grad_error:.1e} (tolerance {grad_tol:.0e}) at "
                    f"{self.worst_parameter}")
        return (f"{loss}; gradient difference of all parameters together {self.grad_error:.1e} (tolerance "
                f"{grad_tol:.0e}; largest of one parameter {self.worst_parameter_error:.1e} at {self.worst_parameter})")


def _trainable(lm: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in lm.named_parameters() if p.requires_grad]


def _gradient_summary(params, probe: bool, seed: int) -> dict[str, tuple]:
    """Per parameter: the gradient itself, or (with `probe`) its dot product with a seeded random direction and
    its norm. Gradients are cleared afterwards."""
    out = {}
    for index, (name, p) in enumerate(params):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if probe:
            gen = torch.Generator(device=grad.device).manual_seed(seed + index)
            direction = torch.randn(grad.shape, generator=gen, device=grad.device, dtype=torch.float32)
            g = grad.float()
            out[name] = (float((g * direction).sum()), float(g.norm()))
        else:
            out[name] = (grad.detach().float().clone(),)
        p.grad = None
    return out


def _gradient_errors(packed: dict, reference: dict, probe: bool) -> tuple[float, str | None, float]:
    """(worst per-parameter relative difference, its parameter, relative difference of all parameters together)."""
    if probe:  # |<g_p - g_r, r>| ~ ||g_p - g_r|| for a standard normal direction r
        scale = max((norm for _, norm in reference.values()), default=0.0)
        diffs = {name: abs(packed[name][0] - dot) for name, (dot, _) in reference.items()}
        norms = {name: norm for name, (_, norm) in reference.items()}
    else:
        scale = max((float(g.abs().max()) for (g,) in reference.values() if g.numel()), default=0.0)
        diffs = {name: float((packed[name][0] - g).abs().max()) for name, (g,) in reference.items() if g.numel()}
        norms = {name: float(g.abs().max()) for name, (g,) in reference.items() if g.numel()}
    if not diffs:
        return 0.0, None, 0.0
    errors = {name: diffs[name] / max(norms[name], GRAD_FLOOR * scale, 1e-30) for name in diffs}
    name = max(errors, key=errors.get)
    if probe:
        together = math.sqrt(sum(d * d for d in diffs.values())) / max(math.sqrt(sum(n * n for n in norms.values())),
                                                                      1e-30)
    else:
        together = math.sqrt(sum(float((packed[n][0] - g).float().square().sum()) for n, (g,) in reference.items())) \
            / max(math.sqrt(sum(float(g.float().square().sum()) for (g,) in reference.values())), 1e-30)
    return errors[name], name, together


def compare_packed_with_reference(model, sequences: list[torch.Tensor], kernels: LayerKernels, *,
                                  gradient_probe: bool = False, seed: int = 1234,
                                  autocast: torch.autocast | None = None, media: list | None = None) -> PackedCheck:
    """`model`: a `train.model.packed.PackedCausalLM` (weights on their device); `sequences`: 1-D token id tensors
    (at least 2 tokens each); `kernels`: what the packed run's layers run (the attention plan's packed kernels);
    `media` (a model with a media path): each sequence's `MediaBatch` or None, run through the towers packed and
    given to the composite's own forward per sequence as its processor gives them (media tokens are never targets).
    Gradients of the model are left cleared."""
    if not sequences or any(s.numel() < 2 for s in sequences):
        raise ValueError("the packed/unpacked comparison needs sequences of at least 2 tokens")
    lm = model.lm
    params = _trainable(lm)
    device = params[0][1].device if params else torch.device("cpu")
    dtype = next(lm.parameters()).dtype
    if autocast is not None and autocast.fast_dtype is not None:
        dtype = autocast.fast_dtype
    sequences = [s.to(device=device, dtype=torch.long) for s in sequences]
    guard = autocast if autocast is not None else nullcontext()
    for _, p in params:
        p.grad = None
    was_training = model.training
    model.eval()  # no dropout: both runs must see the same function (gradients are still computed)
    try:
        return _compare(model, lm, params, sequences, device, dtype, guard, gradient_probe, seed, kernels,
                        media or [None] * len(sequences))
    finally:
        model.train(was_training)


def _targets(model, seq: torch.Tensor) -> torch.Tensor:
    """The next token of every token of `seq` (-100 after the last, and where the next is a media token)."""
    targets = torch.cat([seq[1:], torch.full((1,), -100, dtype=torch.long, device=seq.device)])
    if model.media is not None:
        for token in model.media.token_ids.values():
            targets = targets.masked_fill(targets == token, -100)
    return targets


def _compare(model, lm, params, sequences, device, dtype, guard, gradient_probe, seed, kernels,
             media) -> PackedCheck:
    n_targets = sum(int((_targets(model, s) != -100).sum()) for s in sequences)
    with model.unpacked(), guard:
        total = None
        # shortest first: transformers' dynamic-NTK rope keeps the frequencies of the longest length it has seen,
        # so in this order each sequence gets those of its own length, as alone in a fresh model (train/model/patches/rope.py)
        for k in sorted(range(len(sequences)), key=lambda k: len(sequences[k])):
            seq, extra = sequences[k], {}
            if media[k] is not None:  # the composite's own media path: its towers, placement and positions
                model.media.reset_positions(lm)
                extra = {key: value.to(device) if torch.is_tensor(value) else value for key, value in
                         model.media.forward_inputs(seq.cpu(), media[k].items, media[k].audio_in_video_of(0)).items()}
            logits = lm(input_ids=seq[None], use_cache=False, **extra).logits[0].float()
            ce = F.cross_entropy(logits, _targets(model, seq), reduction="sum") / n_targets
            total = ce if total is None else total + ce
    total.backward()
    loss_reference = float(total.detach())
    reference = _gradient_summary(params, gradient_probe, seed)

    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(s.numel(), device=device) for s in sequences])
    targets = torch.cat([_targets(model, s) for s in sequences])
    weights = (targets != -100).float() / n_targets
    cu = torch.tensor([0] + [int(x) for x in torch.tensor([s.numel() for s in sequences]).cumsum(0)],
                      dtype=torch.int32)
    attn = AttentionContext.for_micro_batch(cu, device, kernels)
    row = None
    if any(m is not None for m in media):
        from train.model.media_batch import MediaBatch

        present = MediaBatch([item for m in media if m is not None for item in m.items],
                             [m is not None and m.audio_in_video_of(0) for m in media])
        row = model.media.prepare(lm, ids.cpu(), cu, present)
    with guard:
        loss = model(ids[None], positions[None], targets, weights, torch.zeros_like(targets), attn,
                     media=row)[0]  # LM loss
    loss.backward()
    loss_packed = float(loss.detach())
    packed = _gradient_summary(params, gradient_probe, seed)

    loss_error = abs(loss_packed - loss_reference) / max(abs(loss_reference), 1e-30)
    worst_error, worst, together = _gradient_errors(packed, reference, gradient_probe)
    if not (math.isfinite(loss_packed) and math.isfinite(loss_reference)):
        loss_error = math.inf
    grad_error = worst_error if dtype == torch.float32 else together
    return PackedCheck(loss_packed, loss_reference, loss_error, grad_error, worst, dtype, worst_error)


# ---------------------------------------------------------------------------------------------- stepwise trees
def self_check_tree(dataset, chain_tokens: int = 16, max_children: int = 3) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids, tree spans) of a small tree cut from the first tree of the first rows with a branch point (data
    with `tree_spans`, data/shards/prefix_tree.py): the last `chain_tokens` tokens up to that branch point, then up to
    `max_children` of its branches, `chain_tokens` tokens down each. None: no tree there branches."""
    from data.shards.dataset import Structure
    from data.shards.prefix_tree import tree_parents

    if dataset.structure is not Structure.TREE:
        return None
    for r in range(min(len(dataset), 8)):
        row = dataset[r]
        bounds = np.concatenate([[0], np.cumsum(np.asarray(row["seq_lens"], dtype=np.int64))])
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            ids, spans = np.asarray(row["input_ids"][lo:hi]), np.asarray(row["tree_spans"][lo:hi])
            parents = tree_parents(spans)
            children = np.bincount(parents[parents >= 0], minlength=len(parents))
            branching = np.flatnonzero(children >= 2)
            if not len(branching):
                continue
            b = int(branching[0])  # the first branch point: tokens 0..b are one chain
            nodes = list(range(max(0, b - chain_tokens + 1), b + 1))
            for kid in np.flatnonzero(parents == b)[:max_children]:
                x = int(kid)
                for _ in range(chain_tokens):
                    nodes.append(x)
                    if x + 1 >= len(parents) or parents[x + 1] != x:
                        break
                    x += 1
            index = {node: j for j, node in enumerate(nodes)}
            sub_parent = [index.get(int(parents[node]), -1) for node in nodes]
            size = np.ones(len(nodes), dtype=np.int64)
            for j in range(len(nodes) - 1, 0, -1):
                if sub_parent[j] >= 0:
                    size[sub_parent[j]] += size[j]
            return ids[nodes].astype(np.int64), size
    return None


def compare_tree_with_reference(model, ids: np.ndarray, spans: np.ndarray, kernels: LayerKernels, *,
                                gradient_probe: bool = False, seed: int = 1234,
                                autocast: torch.autocast | None = None) -> PackedCheck:
    """A tree row through `kernels` (the structured kernels: each token sees its ancestors) vs the model's own
    unpacked forward of each root-to-leaf path: every tree token predicts its first child, once (from the first
    path through it in the reference). Loss and gradients as `compare_packed_with_reference`."""
    from data.shards.prefix_tree import tree_parents, tree_positions

    lm = model.lm
    params = _trainable(lm)
    device = params[0][1].device if params else torch.device("cpu")
    dtype = autocast.fast_dtype if autocast is not None and autocast.fast_dtype is not None else \
        next(lm.parameters()).dtype
    guard = autocast if autocast is not None else nullcontext()
    parents = tree_parents(spans)
    n = len(ids)
    targets = np.full(n, -100, dtype=np.int64)
    follows = parents[1:] == np.arange(n - 1)  # the flat next token is the first child
    targets[:-1][follows] = ids[1:][follows]
    n_targets = int((targets != -100).sum())
    if n_targets == 0:
        raise ValueError("the tree self-check needs a tree with at least one parent-child pair")
    has_child = np.zeros(n, dtype=bool)
    has_child[parents[parents >= 0]] = True
    ids_t = torch.from_numpy(ids).to(device)
    for _, p in params:
        p.grad = None
    was_training = model.training
    model.eval()
    try:
        with model.unpacked(), guard:
            total, seen = None, set()
            for leaf in np.flatnonzero(~has_child):
                path, x = [], int(leaf)
                while x >= 0:
                    path.append(x)
                    x = int(parents[x])
                path.reverse()
                pick = [i for i, node in enumerate(path[:-1]) if node not in seen]
                seen.update(path[i] for i in pick)
                if not pick:
                    continue
                logits = lm(input_ids=ids_t[path][None], use_cache=False).logits[0].float()
                nxt = torch.tensor([path[i + 1] for i in pick], device=device)
                ce = F.cross_entropy(logits[pick], ids_t[nxt], reduction="sum") / n_targets
                total = ce if total is None else total + ce
        total.backward()
        loss_reference = float(total.detach())
        reference = _gradient_summary(params, gradient_probe, seed)

        zeros = torch.zeros(n, dtype=torch.int64, device=device)
        attn = AttentionContext.for_micro_batch(torch.tensor([0, n], dtype=torch.int32), device, kernels,
                                                seq_ids=zeros, block_ids=zeros, path_ids=zeros,
                                                tree_spans=torch.from_numpy(np.asarray(spans, np.int64)).to(device))
        positions = torch.from_numpy(tree_positions(spans)).to(device)
        targets_t = torch.from_numpy(targets).to(device)
        weights = (targets_t != -100).float() / n_targets
        with guard:
            loss = model(ids_t[None], positions[None], targets_t, weights, torch.zeros_like(targets_t), attn)[0]
        loss.backward()
        loss_packed = float(loss.detach())
        packed = _gradient_summary(params, gradient_probe, seed)
    finally:
        model.train(was_training)
    loss_error = abs(loss_packed - loss_reference) / max(abs(loss_reference), 1e-30)
    worst_error, worst, together = _gradient_errors(packed, reference, gradient_probe)
    if not (math.isfinite(loss_packed) and math.isfinite(loss_reference)):
        loss_error = math.inf
    grad_error = worst_error if dtype == torch.float32 else together
    return PackedCheck(loss_packed, loss_reference, loss_error, grad_error, worst, dtype, worst_error)


# ---------------------------------------------------------------------------------------------- loaded weights
FINITE_CHUNK = 1 << 24  # elements per isfinite pass: a bounded temporary, whatever the tensor's size


def non_finite_tensors(model: torch.nn.Module) -> list[tuple[str, int, int, int]]:
    """(name, NaN count, infinite count, elements) of every floating-point parameter or buffer of `model` holding a
    non-finite value: one pass over the weights (ZeRO-3: this rank's partitions, `ds_tensor`)."""
    found = []
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        tensor = getattr(tensor, "ds_tensor", tensor).detach()
        if not tensor.is_floating_point():
            continue
        flat = tensor.reshape(-1)
        if all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(FINITE_CHUNK)):
            continue
        found.append((name, int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum()), flat.numel()))
    return found


def check_finite_weights(model: torch.nn.Module, model_path: str | os.PathLike) -> None:
    """Right after the weights of `model_path` load: a NaN or inf among them stops the run with a ConfigError
    naming the tensor and the file holding it (every rank raises together), before the start-up self-check
    would blame packing for the non-finite losses they give."""
    found = non_finite_tensors(model)
    partitioned = any(hasattr(p, "ds_tensor") for p in model.parameters())
    if partitioned and dist.is_initialized() and dist.get_world_size() > 1:  # ZeRO-3: each rank saw its partitions
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, found)
        totals: dict[str, list[int]] = {}
        for name, *counts in itertools.chain.from_iterable(gathered):
            totals[name] = [a + b for a, b in zip(totals.get(name, [0, 0, 0]), counts)]
        found = [(name, *counts) for name, counts in totals.items()]
    if not found:  # unpartitioned, every rank loaded the whole model and found the same
        return
    directory = pretrained_dir(str(model_path), "model_path")
    name, nan, inf, numel = found[0]
    file, key = weights_file_of(directory, name)
    more = f"; {len(found) - 1} more tensor(s) too: {', '.join(n for n, *_ in found[1:6])}" if len(found) > 1 else ""
    raise ConfigError(
        f"model_path: {file}: tensor {key!r} holds {nan} NaN and {inf} infinite value{'' if inf == 1 else 's'} (of "
        f"{numel:,}){more}. The model's weights are broken before any training (a failed download or conversion, "
        "or a run that diverged): re-download or re-export the model; PackSFT does not train from them"
    )


def check_complete_weights(missing: list[str], model: torch.nn.Module, model_path: str | os.PathLike) -> None:
    """Right after the weights of `model_path` load: a weight the checkpoint lacks (transformers' `missing_keys`:
    tied weights and the keys a model declares optional are not among them) stops the run with a ConfigError naming
    how many and the first few, instead of training from transformers' random initialisation of them (a composite
    whose tower files are gone would train and export a random tower). Random init is `model_config`'s."""
    if not missing:
        return
    names = sorted(missing)
    total = len(model.state_dict())
    shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
    raise ConfigError(
        f"model_path: {model_path}: the checkpoint lacks {len(names)} of the model's {total} weights ({shown}); "
        "transformers would initialise them at random and the run would train (and export) them from there. Use a "
        "checkpoint holding every weight its config.json describes (a complete download or export), or set "
        "model_config instead of model_path to train the whole model from random initialisation"
    )


def weights_file_of(directory: Path, name: str) -> tuple[Path, str]:
    """The weights file of a pretrained directory holding parameter `name`, and its key there (a key may carry a
    prefix the loaded model's name does not, or the reverse); the directory itself when no file names it."""

    def matches(key: str) -> bool:
        return key == name or key.endswith("." + name) or name.endswith("." + key)

    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (directory / index).is_file():
            weight_map = json.loads((directory / index).read_text())["weight_map"]
            for key in sorted(weight_map, key=lambda k: k != name):
                if matches(key):
                    return directory / weight_map[key], key
    if (directory / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(directory / "model.safetensors"), "pt") as weights:
            for key in sorted(weights.keys(), key=lambda k: k != name):
                if matches(key):
                    return directory / "model.safetensors", key
    return directory, name


# ---------------------------------------------------------------------------------------------- the data's sequences
def self_check_sequences(dataset, n_sequences: int = 4, max_tokens: int = 64,
                         switch_points: list[int] = ()) -> list[torch.Tensor]:
    """Up to `n_sequences` packed sequences of the first rows of `dataset` (train/steps/online.py's), each cut to
    `max_tokens` (at least two sequences: a lone one is split in two, which is still two sequences to keep apart).

    `switch_points`: the lengths at which the model's rope changes its frequencies (train/model/patches/rope.py). Then the
    sequences are cut to the smallest one (the short side) and the last is replaced by the data's first sequence
    longer than the largest one, cut just past it (the long side, at the least attention cost)."""
    if switch_points:
        max_tokens = min(max_tokens, switch_points[0])
    seqs: list[torch.Tensor] = []
    for r in range(min(len(dataset), 8)):
        seqs += [seq[:max_tokens] for seq in _row_sequences(dataset, r) if seq.numel() >= 2]
        if len(seqs) >= n_sequences:
            break
    seqs = seqs[:n_sequences]
    if switch_points and (long := _first_sequence_longer_than(dataset, switch_points[-1])) is not None:
        seqs = [*seqs[: n_sequences - 1], long[: switch_points[-1] + 1]]
    if len(seqs) == 1 and seqs[0].numel() >= 4:
        half = seqs[0].numel() // 2
        seqs = [seqs[0][:half], seqs[0][half:]]
    return seqs


def _row_sequences(dataset, r: int) -> list[torch.Tensor]:
    row = dataset[r]
    ids = torch.from_numpy(np.asarray(row["input_ids"], dtype=np.int64))
    return list(ids.split([int(n) for n in row["seq_lens"]]))


def _first_sequence_longer_than(dataset, tokens: int) -> torch.Tensor | None:
    """The data's first sequence of more than `tokens` tokens (found in the sequence index), or None."""
    lengths = np.asarray(dataset.seq_index["length"])
    longer = np.flatnonzero(lengths > tokens)
    if longer.size == 0:
        return None
    row_ends = np.cumsum(np.asarray(dataset.row_n_seqs, dtype=np.int64))
    row = int(np.searchsorted(row_ends, longer[0], side="right"))
    first_of_row = int(row_ends[row - 1]) if row else 0
    return _row_sequences(dataset, row)[int(longer[0]) - first_of_row]
