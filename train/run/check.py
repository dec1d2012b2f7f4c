"""The start-up self-check on the user's data: the packed path vs the model's own unpacked eager forward on a few
sequences of the first rows (with their images, videos and audios), same weights (train/model/self_check.py
compares); training stops before step 1 when they differ (a family or feature PackSFT does not reproduce). Stepwise
trees add a branching tree of the data through the structured kernels vs transformers on each root-to-leaf path."""
from __future__ import annotations

import time

import torch

from data.shards.dataset import Structure
from train.model.media import SELF_CHECK_MAX_TOKENS
from train.model.patches.rope import switch_points as rope_switch_points
from train.model.self_check import (SelfCheckError, compare_packed_with_reference, compare_tree_with_reference,
                                    self_check_sequences, self_check_tree)
from train.steps.batch import make_batch, step_totals


def run_self_check(model, plan, dataset, media_loader, autocast_bf16: bool, console) -> None:
    """The check of `model` (a PackedCausalLM, before its engine exists) as `plan` (the StartupPlan) runs it;
    SelfCheckError when the packed path differs."""
    switch_points = rope_switch_points(model.lm.config.get_text_config())
    seqs, media = self_check_sequences(dataset, switch_points=switch_points), None
    if model.media is not None:  # whole sequences of the first rows, each with its media
        seqs, media = [], []
        for row in range(min(len(dataset), 8)):
            if len(seqs) < 4:  # the row's own totals (its weights are not used)
                batch = make_batch([dataset[row]], step_totals(dataset, [row]), "token",
                                   structure=plan.data.structure, media=media_loader)
                more, their = model.media.sequences(batch, 4 - len(seqs), SELF_CHECK_MAX_TOKENS)
                seqs, media = seqs + more, media + their
    if len(seqs) < 2:
        console("self-check skipped: " + (
            "the data has no sequence of 2 tokens or more" if model.media is None else
            f"the first {min(len(dataset), 8)} rows hold fewer than 2 sequences of 2 to "
            f"{SELF_CHECK_MAX_TOKENS:,} tokens, which it checks whole (media are never cut; a "
            "longer sequence's eager reference forward would hold its full attention and logits)"))
        return
    start = time.perf_counter()
    model.to(plan.attention.mesh.device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if autocast_bf16 else None
    result = compare_packed_with_reference(model, seqs, plan.attention.packed, gradient_probe=True,
                                           autocast=autocast, media=media)
    if not result.ok:
        raise SelfCheckError(
            f"start-up self-check failed for model family {plan.family!r}: on {len(seqs)} sequences of the data, "
            f"the packed path differs from the model's own unpacked forward: {result.describe()}. PackSFT does "
            "not reproduce this model on packed rows; do not train it packed (self_check=false skips this check "
            "at your own risk)"
        )
    tree = ""
    cut = self_check_tree(dataset) if plan.data.structure is Structure.TREE else None
    if cut is not None:  # a branching tree through the structured kernels vs transformers on its paths
        checked = compare_tree_with_reference(model, *cut, plan.attention.train, gradient_probe=True,
                                              autocast=autocast)
        if not checked.ok:
            raise SelfCheckError(
                f"start-up self-check failed for model family {plan.family!r}: on a prefix tree of the data "
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
    with_media = sum(items is not None for items in media or ())
    console(f"self-check: packed = unpacked on {len(seqs)} sequences"
            + (f" ({with_media} with media: the towers, their features and positions)"
               if media is not None else "") + " (loss difference "
            f"{result.loss_error:.1e}, gradient difference {result.grad_error:.1e}{rope}{tree}) in "
            f"{time.perf_counter() - start:.2f} s")
