"""Online packing: train straight from tokenized/ (one sequence per row) without an offline pack stage.

`OnlinePackedDataset` plans rows with the pack stage's own core and layout (`data.shards.rows.plan_rows`, `layout`) once
per epoch, seeded with seed + epoch, and then serves rows exactly like `data.shards.dataset.PackedDataset` does for packed/: `len`,
`ds[i]` (input_ids, labels, category_ids, turn_ids, optional block_ids/path_ids, seq_lens, record_index)
and the per-row normalizer arrays, so the trainer cannot tell the two apart. Planning needs only the
per-row lengths (memory-mapped index), so it costs about a second per million sequences and no token I/O.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from data.shards.rows import ALGORITHMS, DEFAULT_ALGORITHM, RowPlan, layout, plan_rows
from data.shards.dataset import SEQ_DTYPE, PackedDataset, ShardFormatError, read_meta

__all__ = ["OnlinePackedDataset", "epoch_plan", "open_train_dataset"]


def epoch_plan(
    lengths: np.ndarray, max_length: int, seed: int, epoch: int = 0, algorithm: str = DEFAULT_ALGORITHM
) -> RowPlan:
    """The rows of one epoch: the pack stage's planner over all lengths at once, seeded with seed + epoch
    (`plan_rows`, then `layout`: rows and the sequences inside each row in a seeded random order). Pure and
    deterministic."""
    epoch_seed = int(seed) + int(epoch)
    return layout(plan_rows(lengths, max_length, seed=epoch_seed, algorithm=algorithm), epoch_seed)


class OnlinePackedDataset:
    """Packed rows planned on the fly over a tokenized dataset; `set_epoch(e)` re-plans for epoch e.

    Call `set_epoch` before building the epoch's sampler (with persistent DataLoader workers, the workers
    keep the plan they were started with: re-create them per epoch).
    """

    def __init__(
        self,
        tokenized_dir: str | os.PathLike,
        max_length: int,
        seed: int = 0,
        algorithm: str = DEFAULT_ALGORITHM,
        epoch: int = 0,
        verify: str = "rows",
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length <= 0:
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
        self.source = PackedDataset(tokenized_dir, verify=verify)
        self.path = Path(tokenized_dir)
        self.max_length = int(max_length)
        self.seed = int(seed)
        self.algorithm = algorithm
        src = self.source
        multi = np.flatnonzero(np.asarray(src.row_n_seqs) != 1)
        if multi.size:
            raise ShardFormatError(
                f"{self.path}: row {int(multi[0])} holds {int(src.row_n_seqs[multi[0]])} sequences; online packing "
                f"needs a tokenized dataset (one sequence per row, meta kind 'tokenized', this one is {src.kind!r})"
            )
        self._lengths = np.asarray(src.row_n_tokens, dtype=np.int64)
        over = np.flatnonzero(self._lengths > self.max_length)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"{self.path}: row {i} has {int(self._lengths[i])} tokens > max_length={self.max_length} "
                f"({over.size} such rows); tokenize with max_length <= {self.max_length} or raise max_length"
            )
        self.token_fields = src.token_fields
        self.structure = src.structure
        self.dtype = src.dtype
        self.kind = "packed"
        self.set_epoch(epoch)

    # ------------------------------------------------------------------ planning
    def set_epoch(self, epoch: int) -> None:
        """Re-plan the rows for `epoch` (deterministic in (seed, epoch))."""
        self.epoch = int(epoch)
        rows = epoch_plan(self._lengths, self.max_length, self.seed, self.epoch, self.algorithm)
        self._offsets, self._members = rows.starts, rows.members
        src = self.source
        self.row_n_tokens = rows.sums(src.row_n_tokens)
        self.row_n_seqs = rows.sizes
        self.row_n_loss_tokens = rows.sums(src.row_n_loss_tokens)
        self.row_n_trained_turns = rows.sums(src.row_n_trained_turns)
        self.row_n_samples = rows.sums(src.row_n_samples)
        self.meta = self._make_meta()

    def _make_meta(self) -> dict:
        meta = {k: v for k, v in self.source.meta.items() if k != "shards"}
        meta["kind"] = "packed"
        meta["max_length"] = self.max_length
        meta["counts"] = dict(
            self.source.meta["counts"],
            rows=len(self),
            sequences=int(self._members.shape[0]),
            tokens=int(self.row_n_tokens.sum()),
            loss_tokens=int(self.row_n_loss_tokens.sum()),
            trained_turns=int(self.row_n_trained_turns.sum()),
            samples=int(self.row_n_samples.sum()),
        )
        meta["online"] = {
            "source": str(self.path),
            "seed": self.seed,
            "epoch": self.epoch,
            "algorithm": self.algorithm,
        }
        return meta

    # ------------------------------------------------------------------ access (same as PackedDataset)
    def __len__(self) -> int:
        return int(self._offsets.shape[0] - 1)

    @property
    def categories(self) -> dict[int, str]:
        return self.source.categories

    def row_members(self, i: int) -> np.ndarray:
        """Indices (rows of the tokenized dataset) of the sequences packed into row `i`, in order."""
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for a dataset of {n} rows")
        return self._members[self._offsets[i] : self._offsets[i + 1]]

    def row_tokens(self, i: int) -> np.ndarray:
        members = self.row_members(i)
        return np.concatenate([self.source.row_tokens(int(m)) for m in members])

    def row_sequences(self, i: int) -> np.ndarray:
        """Per-sequence index records (SEQ_DTYPE); record_index is the row of the tokenized dataset."""
        members = self.row_members(i)
        out = np.empty(members.shape[0], dtype=SEQ_DTYPE)
        for k, m in enumerate(members):
            out[k] = self.source.row_sequences(int(m))[0]
        out["record_index"] = members
        return out

    def row_uids(self, i: int) -> list[np.ndarray]:
        return [self.source.row_uids(int(m))[0] for m in self.row_members(i)]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        members = self.row_members(i)
        out = self.source.gather(members)  # one copy per field, pages released after the copy
        out["record_index"] = members.copy()
        return out

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    @property
    def seq_index(self) -> np.ndarray:
        """Per-sequence index records in row order (record_index: row of the tokenized dataset)."""
        out = np.array(self.source.seq_index[self._members], dtype=SEQ_DTYPE)
        out["record_index"] = self._members
        return out

    def __repr__(self) -> str:
        return (
            f"OnlinePackedDataset({str(self.path)!r}, max_length={self.max_length}, seed={self.seed}, "
            f"epoch={self.epoch}, rows={len(self)})"
        )


def open_train_dataset(
    path: str | os.PathLike, max_length: int | None = None, seed: int = 0, algorithm: str = DEFAULT_ALGORITHM,
    verify: str = "rows",
):
    """A packed/ directory as a PackedDataset; a tokenized/ directory as an OnlinePackedDataset.

    For tokenized data `max_length` is the row capacity (default: the `max_length` in its meta.json).
    `verify` is PackedDataset's (data.shards.dataset.VERIFY_MODES): the trainer's `verify_data`.
    """
    meta = read_meta(path)
    if meta["kind"] != "tokenized":
        return PackedDataset(path, verify=verify)
    if max_length is None:
        max_length = meta.get("max_length")
        if max_length is None:
            raise ValueError(f"{path}: tokenized data without max_length in meta.json; pass max_length")
    return OnlinePackedDataset(path, int(max_length), seed=seed, algorithm=algorithm, verify=verify)
