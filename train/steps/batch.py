"""Micro-batches of packed rows with the exact per-token loss weights of the whole optimizer step.

The step loss of every reduction is linear in the per-token cross-entropies:

    loss_step = sum over micro-batches, dp ranks (and sp shards) of sum_t weights[t] * ce[t]

so it is exact under any split of the step's rows into micro-batches and ranks, provided each token's weight
already holds the step's normalizer. `step_totals` reads those normalizers from the shards' per-row counts
(before any forward pass, no communication); `make_batch` turns a micro-batch's rows into tensors.

    token:  w = 1 / N_step                               (N_step: loss tokens of the step)
    turn:   w = 1 / (n_tokens_of_that_turn * Turns_step)  (every trained turn weighs the same)
    sample: w = 1 / (n_loss_tokens_of_that_seq * Samples_step)

Rows are whole (a packed sequence never spans two micro-batches), so per-turn and per-sequence token counts
are computed locally from the row; only the step totals come from the shard metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from data.shards.dataset import Structure
from train.model.media_batch import MediaBatch

IGNORE_INDEX = -100
REDUCTIONS = ("token", "turn", "sample")


@dataclass(frozen=True)
class StepTotals:
    """Normalizers of one whole optimizer step: all micro-batches of all dp ranks (rows counted once, not per
    sp rank: the ranks of one sp group share their rows)."""

    n_loss_tokens: int
    n_trained_turns: int
    n_samples: int

    def normalizer(self, reduction: str) -> int:
        """The denominator of `reduction` for this step: loss tokens, trained turns or samples."""
        check_reduction(reduction)
        return {"token": self.n_loss_tokens, "turn": self.n_trained_turns, "sample": self.n_samples}[reduction]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch (T tokens, S packed sequences), what `make_batch` builds from rows of the shards.

    Per token: `input_ids` / `position_ids` [1, T] (positions restart at 0 per sequence; Parallel-R1's rule, or a
    tree's depths, for structured data), `seq_ids` [T] (sequence index in the micro-batch), `targets` [T] (the next
    label, -100 where nothing is predicted), `weights` [T] float32 (exact step weights, 0 where the target is -100),
    `target_categories` [T] (the category of the predicted label token, 0 where ignored); `block_ids` / `path_ids`
    [T] for structured data (zeros for a tree), `tree_spans` [T] for stepwise trees (data/shards/prefix_tree.py),
    None otherwise.
    Per row: `cu_seqlens` [S + 1] int32 and `max_seqlen` (None on a rank's part of a sequence-parallel row, whose
    SPContext holds the bounds), this micro-batch's counts (summed over a step they equal its `StepTotals`), the
    `structure` of its data, and `media` (a MediaBatch of the rows' images, videos and audios in token order;
    None: none)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    target_categories: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None
    n_loss_tokens: int
    n_trained_turns: int
    n_samples: int
    structure: Structure = Structure.NONE
    media: MediaBatch | None = None
    block_ids: torch.Tensor | None = None
    path_ids: torch.Tensor | None = None
    tree_spans: torch.Tensor | None = None

    def as_filler(self) -> "MicroBatch":
        """The same rows contributing nothing: a rank with no row left in a step runs them for the collectives."""
        return replace(self, targets=torch.full_like(self.targets, IGNORE_INDEX),
                       weights=torch.zeros_like(self.weights))

    def row_fields(self) -> dict[str, Any]:
        """The whole row as sequence parallelism shards it (train/attention/sequence_parallel.py `shard_batch`): every
        per-token tensor (the structure's ids included) and the row's bounds."""
        fields = {name: getattr(self, name) for name in TOKEN_FIELDS}
        if self.structure is Structure.PARALLEL_THINKING:
            fields.update(block_ids=self.block_ids, path_ids=self.path_ids)
        return {**fields, "cu_seqlens": self.cu_seqlens, "max_seqlen": self.max_seqlen}

    def local(self, fields: Mapping[str, Any]) -> "MicroBatch":
        """This rank's part of the row: `fields`, the sliced per-token tensors `shard_batch` returns."""
        return replace(self, **{name: fields[name] for name in TOKEN_FIELDS}, cu_seqlens=None, max_seqlen=None,
                       block_ids=fields.get("block_ids"), path_ids=fields.get("path_ids"))


TOKEN_FIELDS = ("input_ids", "position_ids", "seq_ids", "targets", "weights", "target_categories")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"loss reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _row_column(rows_meta: Any, name: str) -> np.ndarray:
    col = rows_meta[name] if isinstance(rows_meta, Mapping) else getattr(rows_meta, name)
    return np.asarray(col)


def step_totals(rows_meta: Any, row_indices: Sequence[int] | np.ndarray) -> StepTotals:
    """Totals over the rows `row_indices` of the step (every micro-batch of every dp rank, each row once).

    `rows_meta`: a `data.shards.dataset.PackedDataset` or any object / mapping with the per-row arrays
    `row_n_loss_tokens`, `row_n_trained_turns`, `row_n_samples`.
    """
    idx = np.asarray(row_indices, dtype=np.int64).reshape(-1)
    return StepTotals(
        n_loss_tokens=int(_row_column(rows_meta, "row_n_loss_tokens")[idx].sum(dtype=np.int64)),
        n_trained_turns=int(_row_column(rows_meta, "row_n_trained_turns")[idx].sum(dtype=np.int64)),
        n_samples=int(_row_column(rows_meta, "row_n_samples")[idx].sum(dtype=np.int64)),
    )


def _concat(rows: Sequence[Mapping[str, np.ndarray]], key: str, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(r[key]).reshape(-1) for r in rows]).astype(dtype, copy=False)


def shift_targets(labels: np.ndarray, seq_starts: np.ndarray) -> np.ndarray:
    """target[t] = labels[t+1] when t+1 belongs to the same sequence, else -100 (labels: HF convention, not
    shifted). `seq_starts`: index of the first token of every sequence (ascending, starting at 0)."""
    targets = np.full(labels.shape[0], IGNORE_INDEX, dtype=np.int64)
    targets[:-1] = labels[1:]
    targets[seq_starts[1:] - 1] = IGNORE_INDEX  # the last token of a sequence predicts nothing
    if labels.shape[0]:
        targets[-1] = IGNORE_INDEX
    return targets


def make_batch(
    rows: Sequence[Mapping[str, np.ndarray]],
    totals: StepTotals,
    reduction: str,
    structure: Structure = Structure.NONE,
    media: Callable[[list], list] | None = None,
) -> MicroBatch:
    """The `MicroBatch` of `rows` (dicts from `PackedDataset[i]`) concatenated into one varlen sequence, with the
    exact weights of the step whose totals are `totals` (its `reduction`). `structure`: the data's (`PackedDataset
    .structure`): Parallel-R1 positions and ids, or a stepwise tree's depths and spans (with reduction `sample` a
    sample of a tree is a trained turn). The micro-batch's `media`, a `MediaBatch` (train/model/media_batch.py) of the
    rows' media items in the order of their tokens (None for rows without media), come from the loader `media` (the
    rows' `media`, each packed sequence's stored items, through data.shards.media.MediaLoader: each item's processor
    output alone; an image store of format 2 too).
    """
    check_reduction(reduction)
    if not rows:
        raise ValueError("make_batch needs at least one row")
    input_ids = _concat(rows, "input_ids", np.int64)
    labels = _concat(rows, "labels", np.int64)
    categories = _concat(rows, "category_ids", np.int64)
    turn_ids = _concat(rows, "turn_ids", np.int64)
    seq_lens = _concat(rows, "seq_lens", np.int64)
    n_tok = input_ids.shape[0]
    for key, arr in (("labels", labels), ("category_ids", categories), ("turn_ids", turn_ids)):
        if arr.shape[0] != n_tok:
            raise ValueError(f"make_batch: {key} has {arr.shape[0]} tokens, input_ids has {n_tok}")
    if seq_lens.sum() != n_tok or (seq_lens <= 0).any():
        raise ValueError(f"make_batch: seq_lens {seq_lens.tolist()} do not split the {n_tok} tokens")

    cu = np.zeros(seq_lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=cu[1:])
    starts = cu[:-1]
    seq_ids = np.repeat(np.arange(seq_lens.shape[0], dtype=np.int64), seq_lens)
    untrainable = labels[starts] != IGNORE_INDEX
    if untrainable.any():
        k = int(np.flatnonzero(untrainable)[0])
        raise ValueError(
            f"make_batch: sequence {k} of the micro-batch has a loss label on its first token; no token predicts "
            "it, so the shard's loss-token counts (and the step normalizers) would not match the shifted targets"
        )

    targets = shift_targets(labels, starts)
    valid = targets != IGNORE_INDEX
    # Category and turn of a target are those of the label token it predicts (position t+1).
    target_categories = np.zeros(n_tok, dtype=np.int64)
    target_turns = np.zeros(n_tok, dtype=np.int64)
    target_categories[:-1] = categories[1:]
    target_turns[:-1] = turn_ids[1:]
    target_categories[~valid] = 0
    target_turns[~valid] = 0

    seq_loss = np.bincount(seq_ids[valid], minlength=seq_lens.shape[0])
    n_loss = int(valid.sum())
    n_samples = int(np.count_nonzero(seq_loss))
    tree = structure is Structure.TREE  # stepwise trees: a sample is a trained turn (prefix_tree.py)
    # Turns never merge across sequences: key = (sequence, turn id).
    if valid.any() and (target_turns[valid] <= 0).any():
        bad = int(np.flatnonzero(valid & (target_turns <= 0))[0])
        turn_problem = f"loss token at position {bad + 1} has turn id {int(turn_ids[bad + 1])}"
    else:
        turn_problem = None
    max_turn = int(turn_ids.max(initial=0)) + 1
    turn_key = seq_ids * max_turn + target_turns
    turn_tokens = np.bincount(turn_key[valid], minlength=seq_lens.shape[0] * max_turn)
    n_turns = int(np.count_nonzero(turn_tokens.reshape(seq_lens.shape[0], max_turn)[:, 1:]))
    if turn_problem is None:
        # the shards count the distinct non-zero turn ids of each sequence; every one must own loss tokens
        stored = int(np.unique((seq_ids * max_turn + turn_ids)[turn_ids > 0]).shape[0])
        if stored != n_turns:
            turn_problem = f"{stored} turns carry turn ids but {n_turns} have loss tokens"
    if tree:
        n_samples = n_turns

    weights = np.zeros(n_tok, dtype=np.float64)
    if n_loss:
        if reduction == "token":
            weights[valid] = 1.0 / _positive(totals.n_loss_tokens, "n_loss_tokens", n_loss)
        elif reduction == "sample":
            denom = _positive(totals.n_samples, "n_samples", n_samples)
            if tree:  # each trained turn of a tree is one sample of the `stepwise: samples` expansion
                if turn_problem is not None:
                    raise ValueError(f"make_batch: a stepwise tree needs every loss token in a trained turn: "
                                     f"{turn_problem}")
                weights[valid] = 1.0 / (turn_tokens[turn_key[valid]] * float(denom))
            else:
                weights[valid] = 1.0 / (seq_loss[seq_ids[valid]] * float(denom))
        else:
            if turn_problem is not None:
                raise ValueError(f"make_batch: reduction 'turn' needs every loss token in a trained turn: {turn_problem}")
            denom = _positive(totals.n_trained_turns, "n_trained_turns", n_turns)
            weights[valid] = 1.0 / (turn_tokens[turn_key[valid]] * float(denom))

    if tree:  # prefix trees: no Parallel-R1 blocks; positions are depths, the mask follows the spans
        block_ids = np.zeros(n_tok, dtype=np.int64)
        path_ids = np.zeros(n_tok, dtype=np.int64)
        tree_spans = _concat(rows, "tree_spans", np.int64)
        from data.shards.prefix_tree import check_flat_labels, tree_positions  # lazy: optional mode

        positions = np.zeros(n_tok, dtype=np.int64)
        for k in range(seq_lens.shape[0]):
            sl = slice(int(cu[k]), int(cu[k + 1]))
            positions[sl] = tree_positions(tree_spans[sl])
            check_flat_labels(labels[sl], tree_spans[sl])
    elif structure is Structure.PARALLEL_THINKING:
        block_ids = _concat(rows, "block_ids", np.int64)
        path_ids = _concat(rows, "path_ids", np.int64)
        from data.shards.parallel_thinking import position_ids as structure_position_ids  # lazy: optional mode

        positions = np.concatenate(
            [
                np.asarray(structure_position_ids(block_ids[cu[k] : cu[k + 1]], path_ids[cu[k] : cu[k + 1]]))
                .reshape(-1)
                .astype(np.int64)
                for k in range(seq_lens.shape[0])
            ]
        )
        if positions.shape[0] != n_tok:
            raise ValueError(f"make_batch: structure position ids have {positions.shape[0]} tokens, expected {n_tok}")
    else:
        positions = np.arange(n_tok, dtype=np.int64) - np.repeat(starts, seq_lens)

    structured = structure is not Structure.NONE  # the structured kernels read block / path ids (trees: zeros)
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids).unsqueeze(0),
        position_ids=torch.from_numpy(positions).unsqueeze(0),
        seq_ids=torch.from_numpy(seq_ids),
        targets=torch.from_numpy(targets),
        weights=torch.from_numpy(weights.astype(np.float32)),
        target_categories=torch.from_numpy(target_categories),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=int(seq_lens.max()),
        n_loss_tokens=n_loss,
        n_trained_turns=n_turns,
        n_samples=n_samples,
        structure=structure,
        media=_media_batch(rows, media),
        block_ids=torch.from_numpy(block_ids) if structured else None,
        path_ids=torch.from_numpy(path_ids) if structured else None,
        tree_spans=torch.from_numpy(tree_spans) if tree else None,
    )


def _media_batch(rows: Sequence[Mapping[str, Any]], loader) -> MediaBatch | None:
    sequences = [stored for row in rows for stored in row.get("media", ())]  # per packed sequence, in row order
    if not any(sequences):
        return None
    if loader is None:
        raise ValueError("make_batch: the rows hold media but no media loader was given (media=)")
    return MediaBatch.of_sequences(loader(sequences))


def _positive(total: int, name: str, local: int) -> int:
    if total < local or total <= 0:
        raise ValueError(
            f"make_batch: step total {name}={total} is smaller than this micro-batch's {local}; the totals must "
            "cover every row of the optimizer step"
        )
    return total
