"""Pack stage: assign tokenized sequences to fixed-capacity rows (bin packing) and write packed/.

The row planner (`plan_rows`, `RowPlan`, `layout`) is data/shards/rows.py's, shared with the trainer's online
packing.

`run()` plans by partitions: each worker plans `PARTITION_SEQUENCES` consecutive tokenized rows on its own
(`plan_partition`, seeded by (seed, partition index)), keeps the rows that are full enough in a seeded order
(`layout`) and releases its emptiest ones (`released_rows`, a few per partition); the driver re-packs the
released sequences in one global pass (`plan_all`), whose rows come last. Sequences that share a source record
(the copies of an up-sampled record) are put in different copy layers (`copy_layers`), each planned on its own
(`plan_layers`), so no row holds a record twice. The workers then write the output shards (`write_shard`, one task
per shard), which the driver appends in order; then stats.json (with the duplicate rows, `count_duplicates`),
stats.png and the accounting (every tokenized row in exactly one packed row). The result depends on the seed and
the data only, never on the worker count or the engine.
"""
from __future__ import annotations

import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.config import DataConfig, output_config
from data.executor import Executor, LocalExecutor
from data.progress import progress
from data.randomness import (PACK_CHECK_LENGTHS, PACK_CHECK_RECORDS, PACK_CHECK_UIDS, PACK_LAYER, PACK_LEFTOVERS,
                             PACK_PARTITION, PACK_ROW_KEY, PACK_ROW_SEQUENCE, PACK_ROW_UNNAMED, record_keys)
from data.shards.rows import DEFAULT_ALGORITHM, RowPlan, layout, plan_rows
from data.shards.dataset import RESERVED_META_KEYS, PackedDataset, ShardWriter, dump_json, shard_ranges
from data.stats import Counts, add_category_counts, category_counts

RELEASE_BYTES = 16 << 20  # unmap the source's pages after copying this much (page faults map ~2-3x as much)
PARTITION_SEQUENCES = 1 << 20  # tokenized rows planned together by one worker (~1-2 s; fewer leave more waste)
RELEASE_SHARE = 0.05  # at most this share of a partition's rows (its emptiest) goes back to the global pass
RELEASE_MIN_ROOM = 2048  # a row with less room than max_length / this stays where its partition put it
DUPLICATE_BUCKET_BYTES = 64 << 20  # row keys a worker sorts at once when counting duplicate rows, about


# ---------------------------------------------------------------------------------------------- copy layers
def _segment_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums (uint64, mod 2^64) of consecutive segments of `values`, `counts[k]` values each (0 allowed)."""
    total = np.zeros(values.shape[0] + 1, dtype=np.uint64)
    np.cumsum(values, dtype=np.uint64, out=total[1:])
    ends = np.cumsum(counts)
    return total[ends] - total[ends - counts]


def copy_layers(n_uids: np.ndarray, uids: np.ndarray) -> np.ndarray:
    """The copy layer of each sequence (`n_uids[k]` source uids each, `uids` all of them in order): two sequences
    that share a source uid (copies of an up-sampled record, merged conversations that hold one) are in different
    layers, so that planning each layer on its own (`plan_layers`) never puts a record twice in a row. The k-th
    single-record sequence of a record is in layer k; a merged one takes, in order, the lowest layer none of its
    records has. Without a repeated uid every sequence is in layer 0."""
    n_uids = np.asarray(n_uids, dtype=np.int64)
    layers = np.zeros(n_uids.shape[0], dtype=np.int64)
    if not uids.size:
        return layers
    _, inverse, counts = np.unique(uids, return_inverse=True, return_counts=True)
    if counts.max() == 1:
        return layers
    starts = np.cumsum(n_uids) - n_uids
    single = np.flatnonzero(n_uids == 1)
    record = inverse[starts[single]]
    order = np.argsort(record, kind="stable")
    by_record = record[order]
    layers[single[order]] = np.arange(by_record.shape[0]) - np.searchsorted(by_record, by_record)
    repeated = _segment_sums((counts[inverse] > 1).astype(np.uint64), n_uids) > 0
    merged = np.flatnonzero((n_uids > 1) & repeated).tolist()
    taken = np.bincount(record, minlength=counts.shape[0]).tolist()  # layers 0..taken-1: the record's singles
    extra: dict[int, set[int]] = {}  # the layers of the record's merged sequences so far
    inverse, starts, n_uids = inverse.tolist(), starts.tolist(), n_uids.tolist()
    chosen = []
    for k in merged:  # a plain loop: ~3 s per million merged sequences that share a record
        records = inverse[starts[k]:starts[k] + n_uids[k]]
        layer = max([taken[r] for r in records])
        used = [extra.setdefault(r, set()) for r in records]
        while any([layer in u for u in used]):
            layer += 1
        for u in used:
            u.add(layer)
        chosen.append(layer)
    layers[merged] = chosen
    return layers


def layer_seed(seed: int, layer: int) -> int:
    """The seed of copy layer `layer` of a plan seeded `seed` (layer 0: `seed` itself, so data without copies plans
    as it did before layers)."""
    return seed if layer == 0 else int(record_keys(seed, PACK_LAYER, layer))


def plan_layers(lengths: np.ndarray, layers: np.ndarray | None, max_length: int, seed: int, algorithm: str
                ) -> RowPlan:
    """`plan_rows` of each copy layer on its own (`layer_seed`), rows of layer 0 first; `layers` None: one layer."""
    if layers is None or not layers.size or not layers.max():
        return plan_rows(lengths, max_length, seed=seed, algorithm=algorithm)
    order = np.argsort(layers, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(layers))])
    plans = []
    for layer, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        members = order[lo:hi]
        rows = plan_rows(lengths[members], max_length, seed=layer_seed(seed, layer), algorithm=algorithm)
        plans.append(RowPlan(members[rows.members], rows.starts))
    return concat_plans(plans)


def select_uids(n_uids: np.ndarray, uids: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The uid counts and the uids (in order) of sequences `which` (`n_uids`, `uids`: of all sequences)."""
    n_uids = np.asarray(n_uids, dtype=np.int64)
    counts = n_uids[which]
    starts = (np.cumsum(n_uids) - n_uids)[which]
    positions = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    return counts, uids[positions]


# ---------------------------------------------------------------------------------------------- duplicate rows
def row_keys(seqs_per_row: np.ndarray, n_uids: np.ndarray, uids: np.ndarray, record_index: np.ndarray
             ) -> tuple[np.ndarray, int]:
    """(a 64-bit key per row, rows holding a source uid twice) of rows of `seqs_per_row` sequences each, the
    sequences' `n_uids` uids (`uids` in order) and tokenized rows (`record_index`). A row's key hashes the multiset
    of its sequences, each named by its ordered uids (or, without any, by its tokenized row): two rows get equal
    keys exactly when they hold the same records (in any order), but for a 2^-64 collision."""
    n_uids = np.asarray(n_uids, dtype=np.int64)
    position = np.arange(uids.shape[0]) - np.repeat(np.cumsum(n_uids) - n_uids, n_uids)
    named = _segment_sums(record_keys(0, PACK_ROW_SEQUENCE, uids, position + 1), n_uids)
    sequence = np.where(n_uids > 0, named, record_keys(0, PACK_ROW_UNNAMED, record_index))
    keys = _segment_sums(record_keys(0, PACK_ROW_KEY, sequence), seqs_per_row)
    row_of_uid = np.repeat(np.repeat(np.arange(seqs_per_row.shape[0]), seqs_per_row), n_uids)
    order = np.lexsort((uids, row_of_uid))
    row_of_uid, uids = row_of_uid[order], uids[order]
    again = (row_of_uid[1:] == row_of_uid[:-1]) & (uids[1:] == uids[:-1])
    return keys, int(np.unique(row_of_uid[1:][again]).shape[0])


@dataclass(frozen=True)
class KeyBucket:
    """Worker task: the row keys in `[lo, hi)` (hi None: to 2^64) of every sorted key file (`count_duplicates`)."""
    files: tuple[str, ...]
    lo: int
    hi: int | None


def duplicates_in_bucket(task: KeyBucket) -> int:
    """Worker: how many of the bucket's keys repeat an earlier one (keys minus distinct keys)."""
    found = []
    for path in task.files:
        keys = np.load(path, mmap_mode="r")
        a = int(np.searchsorted(keys, np.uint64(task.lo)))
        b = keys.shape[0] if task.hi is None else int(np.searchsorted(keys, np.uint64(task.hi)))
        found.append(np.asarray(keys[a:b]))
    keys = np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.uint64)
    return int(keys.shape[0] - (1 + np.count_nonzero(np.diff(keys)) if keys.shape[0] else 0))


def count_duplicates(executor: Executor, key_files: list[str], rows: int) -> int:
    """Rows whose key (`row_keys`) equals another row's, all but one of each: the workers sort the keys of each
    output shard into a file (`write_shard`); one task per bucket of the key space (~`DUPLICATE_BUCKET_BYTES` of
    keys) counts the repeats in its slice of every file. The driver holds file names and counts only."""
    buckets = max(1, -(-rows * 8 // DUPLICATE_BUCKET_BYTES))
    tasks = [KeyBucket(tuple(key_files), (b << 64) // buckets, None if b == buckets - 1 else ((b + 1) << 64) // buckets)
             for b in range(buckets)]
    return sum(executor.map(duplicates_in_bucket, tasks))


# ---------------------------------------------------------------------------------------------- the stage
def released_rows(rows: RowPlan, lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Which rows of a partition's plan go back to the global pass (a bool per row): the emptiest, at most
    `RELEASE_SHARE` of them, among those with room for the partition's shortest sequence and at least
    max_length / `RELEASE_MIN_ROOM` tokens of room (less cannot move the row count)."""
    room = max_length - rows.sums(lengths)
    candidates = np.flatnonzero(room >= max(int(lengths.min()), max_length // RELEASE_MIN_ROOM))
    keep_at_most = int(np.ceil(len(rows) * RELEASE_SHARE))
    if candidates.size > keep_at_most:
        candidates = candidates[np.argsort(-room[candidates], kind="stable")[:keep_at_most]]
    released = np.zeros(len(rows), dtype=bool)
    released[candidates] = True
    return released


def select_rows(rows: RowPlan, keep: np.ndarray) -> RowPlan:
    """The rows where `keep` is true, in their order."""
    sizes = rows.sizes[keep]
    starts = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    return RowPlan(rows.members[np.repeat(keep, rows.sizes)], starts)


@dataclass(frozen=True)
class Partition:
    """Worker task: plan tokenized rows `[first, end)` on their own (`plan_partition`); `seed` is the
    partition's (`partition_seed`), `plan_path` where its kept rows go."""
    source: PackedDataset  # pickles as its path
    first: int
    end: int
    max_length: int
    algorithm: str
    seed: int
    plan_path: str
    max_shard_bytes: int


@dataclass(frozen=True)
class PlacedRows:
    """Rows saved as a plan file (`save_rows`) in their written order: how many, the counts of their tokens and
    of their sequences, and the `[start, end)` row ranges of the output shards they fill (`shards.shard_ranges`)."""
    plan_path: str
    rows: int
    row_tokens: Counts
    row_sequences: Counts
    shards: list[tuple[int, int]]


@dataclass(frozen=True)
class Overlong:
    """Tokenized rows longer than pack.max_length in a partition: the first (its row and length) and how many."""
    row: int
    length: int
    count: int

    def __add__(self, later: "Overlong") -> "Overlong":
        """The first row of this one, the count of both (`later`: a later partition's)."""
        return Overlong(self.row, self.length, self.count + later.count)


@dataclass(frozen=True)
class SequenceTally:
    """The sequences of part of a dataset, summed so that parts add up and two datasets compare in memory that
    does not grow with them: how many sequences and uids, and 64-bit multiset hashes (sums of `record_keys`
    mod 2^64) of their record indices, of their (record index, length) pairs and of their uids. Equal multisets
    give equal tallies; different ones the same hash with probability 2^-64."""
    sequences: int = 0
    uids: int = 0
    records_hash: int = 0
    lengths_hash: int = 0
    uids_hash: int = 0

    @classmethod
    def of(cls, record_index: np.ndarray, length: np.ndarray, uids: np.ndarray) -> "SequenceTally":
        def hashed(stream: int, index, value=0) -> int:
            return int(np.sum(record_keys(0, stream, index, value), dtype=np.uint64))

        return cls(int(record_index.shape[0]), int(uids.shape[0]), hashed(PACK_CHECK_RECORDS, record_index),
                   hashed(PACK_CHECK_LENGTHS, record_index, length), hashed(PACK_CHECK_UIDS, uids))

    def __add__(self, other: "SequenceTally") -> "SequenceTally":
        mask = (1 << 64) - 1
        return SequenceTally(self.sequences + other.sequences, self.uids + other.uids,
                             (self.records_hash + other.records_hash) & mask,
                             (self.lengths_hash + other.lengths_hash) & mask,
                             (self.uids_hash + other.uids_hash) & mask)


@dataclass(frozen=True)
class PartitionPlan:
    """What `plan_partition` returns: the rows it kept (saved), the sequences of the rows it released for the
    global pass (tokenized row indices, their lengths, their byte sizes, their uid counts and uids), the tally of what it read; or,
    for a partition with rows over pack.max_length, those rows and nothing else."""
    kept: PlacedRows | None
    released: np.ndarray
    released_lengths: np.ndarray
    released_nbytes: np.ndarray
    released_n_uids: np.ndarray
    released_uids: np.ndarray
    read: SequenceTally
    overlong: Overlong | None = None


@dataclass(frozen=True)
class WrittenShard:
    """What `write_shard` returns: the dataset it wrote (one shard), the counts of its sequences' lengths per
    category (a sequence's category is that of its first token), counted while the tokens were in hand, its rows'
    sorted keys (`row_keys`, a .npy file for `count_duplicates`) and how many of its rows hold a record twice."""
    part_dir: str
    seq_lengths: dict[int, Counts]
    keys_path: str
    rows_with_a_record_twice: int


@dataclass(frozen=True)
class RowSpan:
    """Worker task: rows `[first, end)` of a dataset (`tally_rows`), or of a plan file written as one output shard,
    a dataset at `part_dir` (`write_shard`)."""
    source: PackedDataset
    first: int
    end: int
    plan_path: str = ""
    part_dir: str = ""
    max_shard_bytes: int = 0


def save_rows(rows: RowPlan, row_tokens: np.ndarray, plan_path: str, max_shard_bytes: int,
              row_nbytes: np.ndarray) -> PlacedRows:
    """Save `rows` (tokenized row indices, `row_tokens` tokens and `row_nbytes` bytes each: token records and
    images) to `plan_path` (.members.npy, .starts.npy) and cut them into output shards."""
    np.save(f"{plan_path}.members.npy", rows.members)
    np.save(f"{plan_path}.starts.npy", rows.starts)
    return PlacedRows(plan_path, len(rows), Counts.of(row_tokens), Counts.of(rows.sizes),
                      shard_ranges(row_nbytes.tolist(), max_shard_bytes))


def load_rows(plan_path: str, first: int, end: int) -> RowPlan:
    """Rows `[first, end)` of a plan file `save_rows` wrote (memory-mapped)."""
    return RowPlan(np.load(f"{plan_path}.members.npy", mmap_mode="r"),
                   np.load(f"{plan_path}.starts.npy", mmap_mode="r")).slice(first, end)


def partition_seed(seed: int, index: int) -> int:
    """The seed of partition `index` (tie-breaking, row order and in-row order) for the run's `seed`."""
    return int(record_keys(seed, PACK_PARTITION, index))


def leftovers_seed(seed: int) -> int:
    """The seed of the global pass over the released rows' sequences."""
    return int(record_keys(seed, PACK_LEFTOVERS, 0))


def partition_rows(lengths: np.ndarray, max_length: int, seed: int, algorithm: str,
                   layers: np.ndarray | None = None) -> tuple[RowPlan, np.ndarray]:
    """One partition's plan (`plan_layers` over its copy `layers`): the rows it keeps, in seeded order (`layout`),
    and the sequences of the rows it releases (`released_rows`), as indices into `lengths`."""
    rows = plan_layers(lengths, layers, max_length, seed, algorithm)
    released = released_rows(rows, lengths, max_length)
    return layout(select_rows(rows, ~released), seed), select_rows(rows, released).members


def global_pass(loose: np.ndarray, loose_lengths: np.ndarray, max_length: int, seed: int, algorithm: str,
                loose_layers: np.ndarray | None = None) -> tuple[RowPlan, RowPlan]:
    """The rows of the sequences the partitions released (`loose`, with their lengths and copy layers), in seeded
    order (the last rows of packed/): of tokenized row indices, and of positions in `loose` (to sum what is given
    per loose sequence: tokens, bytes)."""
    seed = leftovers_seed(seed)
    rows = layout(plan_layers(loose_lengths, loose_layers, max_length, seed, algorithm), seed)
    return RowPlan(loose[rows.members], rows.starts), rows


def plan_by_partitions(lengths: np.ndarray, max_length: int, seed: int = 0, algorithm: str = DEFAULT_ALGORITHM,
                       partition: int | None = None, n_uids: np.ndarray | None = None,
                       uids: np.ndarray | None = None) -> RowPlan:
    """`run`'s rows over `lengths` in one process (`plan_all` spreads the same over workers): each partition of
    `partition` (default `PARTITION_SEQUENCES`) consecutive sequences planned on its own, then the global pass;
    copies (sequences sharing one of their `n_uids` source `uids`, None: none) in different rows."""
    size = partition or PARTITION_SEQUENCES
    if n_uids is None:
        n_uids, uids = np.zeros(len(lengths), dtype=np.int64), np.zeros(0, dtype=np.int64)
    kept, loose = [], []
    for k, first in enumerate(range(0, len(lengths), size)):
        part_n_uids, part_uids = select_uids(n_uids, uids, np.arange(first, min(first + size, len(lengths))))
        rows, released = partition_rows(lengths[first:first + size], max_length, partition_seed(seed, k), algorithm,
                                        copy_layers(part_n_uids, part_uids))
        kept.append(RowPlan(rows.members + first, rows.starts))
        loose.append(released + first)
    loose = np.concatenate(loose) if loose else np.zeros(0, dtype=np.int64)
    kept.append(global_pass(loose, lengths[loose], max_length, seed, algorithm,
                            copy_layers(*select_uids(n_uids, uids, loose)))[0])
    return concat_plans(kept)


def concat_plans(plans: list[RowPlan]) -> RowPlan:
    """Rows of `plans` one after the other."""
    starts = [np.zeros(1, dtype=np.int64)]
    offset = 0
    for plan in plans:
        starts.append(plan.starts[1:] + offset)
        offset += len(plan.members)
    members = np.concatenate([plan.members for plan in plans]) if plans else np.zeros(0, dtype=np.int64)
    return RowPlan(members, np.concatenate(starts))


def plan_partition(task: Partition) -> PartitionPlan:
    """Worker: the partition's rows (`partition_rows`) over its lengths read from the tokenized index; the kept
    rows saved to `plan_path`, the released sequences returned, with the tally of what it read. It reads the
    index only, never a token page."""
    src = task.source
    seqs, uids = src.row_range_sequences(task.first, task.end)
    if seqs.shape[0] != task.end - task.first:
        n_seqs = src.row_column("n_seqs", task.first, task.end)
        row = task.first + int(np.flatnonzero(n_seqs != 1)[0])
        raise ValueError(f"{src.path}: row {row} holds {int(n_seqs[row - task.first])} sequences; a tokenized "
                         "dataset holds one sequence per row")
    lengths = np.asarray(seqs["length"], dtype=np.int64)
    read = SequenceTally.of(np.arange(task.first, task.end), lengths, uids)
    empty = np.zeros(0, dtype=np.int64)
    over = np.flatnonzero(lengths > task.max_length)
    if over.size:
        return PartitionPlan(None, empty, empty, empty, empty, empty, read,
                             Overlong(task.first + int(over[0]), int(lengths[over[0]]), int(over.size)))
    n_uids = np.asarray(seqs["n_uids"], dtype=np.int64)
    kept, loose = partition_rows(lengths, task.max_length, task.seed, task.algorithm, copy_layers(n_uids, uids))
    nbytes = src.row_nbytes(task.first, task.end)
    placed = save_rows(RowPlan(kept.members + task.first, kept.starts), kept.sums(lengths), task.plan_path,
                       task.max_shard_bytes, kept.sums(nbytes))
    return PartitionPlan(placed, loose + task.first, lengths[loose], nbytes[loose],
                         *select_uids(n_uids, uids, loose), read)


def write_rows(writer: ShardWriter, src: PackedDataset, rows: RowPlan) -> tuple[dict[int, Counts], np.ndarray, int]:
    """Add the packed rows (of tokenized row indices) to `writer`, copying the tokens from `src`; the counts of
    the sequences' lengths per category (that of a sequence's first token), the rows' keys and how many rows hold
    a record twice (`row_keys`)."""
    mapped = 0
    lengths = array.array("q")
    categories = array.array("q")
    seq_uids = []
    for row in rows:
        members = row.tolist()
        tokens = [src.row_tokens(j) for j in members]
        uids = [src.row_uids(j)[0] for j in members]
        seq_uids += uids
        media = [src.row_media(j)[0] for j in members] if src.has_media else None
        writer.add_row(tokens, record_indices=members, uids=uids, media=media)
        lengths.extend(t.shape[0] for t in tokens)
        categories.extend(int(t["category_ids"][0]) for t in tokens)
        mapped += sum(t.nbytes for t in tokens)
        if mapped > RELEASE_BYTES:
            src.release()  # the rows were copied: keep the mapped tokenized data out of our resident set
            mapped = 0
    src.release()
    n_uids = np.array([u.shape[0] for u in seq_uids], dtype=np.int64)
    keys, twice = row_keys(rows.sizes, n_uids, np.concatenate(seq_uids or [np.zeros(0, np.int64)]).astype(np.int64),
                           np.asarray(rows.members, dtype=np.int64))
    return (category_counts(np.frombuffer(lengths, dtype=np.int64), np.frombuffer(categories, dtype=np.int64)),
            keys, twice)


def write_shard(task: RowSpan) -> WrittenShard:
    """Worker: one output shard, rows `[first, end)` of the plan file copied from the tokenized dataset, as a
    dataset of its own at `part_dir` (appended to packed/ by the driver, `ShardWriter.append_dataset`)."""
    src = task.source
    writer = ShardWriter(task.part_dir, token_fields=src.token_fields, max_shard_bytes=task.max_shard_bytes,
                         kind="packed", media=src.has_media)
    with writer:
        seq_lengths, keys, twice = write_rows(writer, src, load_rows(task.plan_path, task.first, task.end))
        writer.close()
    keys_path = f"{task.part_dir}.row_keys.npy"
    np.save(keys_path, np.sort(keys))  # scratch: a retried task rewrites it
    return WrittenShard(task.part_dir, seq_lengths, keys_path, twice)


def tally_rows(task: RowSpan) -> SequenceTally:
    """Worker: the tally of the sequences of rows `[first, end)` of a packed dataset as written (record index:
    the tokenized row each came from)."""
    seqs, uids = task.source.row_range_sequences(task.first, task.end)
    return SequenceTally.of(np.asarray(seqs["record_index"]), np.asarray(seqs["length"]), np.asarray(uids))


def check_accounting(read: SequenceTally, written: SequenceTally) -> dict:
    """Every tokenized row is in exactly one packed row, with the same length and uids (the tallies of the
    tokenized input and of packed/ as written agree). Raises on a mismatch."""
    if (written.sequences, written.records_hash) != (read.sequences, read.records_hash):
        raise AssertionError(f"pack: packed sequences do not cover each of the {read.sequences} tokenized rows "
                             "exactly once")
    if written.lengths_hash != read.lengths_hash:
        raise AssertionError("pack: a packed sequence's length differs from its tokenized row")
    if (written.uids, written.uids_hash) != (read.uids, read.uids_hash):
        raise AssertionError("pack: the multiset of source uids changed while packing")
    return {"uids_in": read.uids, "uids_out": written.uids, "every_record_once": True}


@dataclass
class PackPlan:
    """`plan_all`'s result: the placed rows in written order and the tally of the tokenized rows read."""
    placed: list[PlacedRows]
    read: SequenceTally


def plan_all(executor: Executor, src: PackedDataset, cfg: DataConfig, plans_dir: Path) -> PackPlan:
    """Every partition planned by the workers, then the global pass over the sequences they released: the
    placed rows in written order (the partitions' in partition order, the global pass's last)."""
    cap, algorithm, shard_bytes = cfg.pack_max_length, cfg.pack.algorithm, cfg.pack.shard_size_mb << 20
    tasks = (Partition(src, first, min(first + PARTITION_SEQUENCES, len(src)), cap, algorithm,
                       partition_seed(cfg.seed, k), str(plans_dir / f"partition_{k:06d}"),
                       shard_bytes)
             for k, first in enumerate(range(0, len(src), PARTITION_SEQUENCES)))
    result = PackPlan([], SequenceTally())
    released, released_lengths, released_nbytes, released_n_uids, released_uids, overlong = [], [], [], [], [], []
    for plan in executor.map(plan_partition, tasks):
        result.read += plan.read
        if plan.overlong is not None:
            overlong.append(plan.overlong)
            continue
        result.placed.append(plan.kept)
        released.append(plan.released)
        released_lengths.append(plan.released_lengths)
        released_nbytes.append(plan.released_nbytes)
        released_n_uids.append(plan.released_n_uids)
        released_uids.append(plan.released_uids)
    if overlong:
        every = sum(overlong[1:], overlong[0])
        raise ValueError(
            f"{cfg.tokenized_dir}: row {every.row} has {every.length} tokens > pack.max_length={cap} "
            f"({every.count} such rows); tokenize with max_length <= pack.max_length")
    def joined(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)

    loose, loose_lengths = joined(released), joined(released_lengths)
    rows, in_loose = global_pass(loose, loose_lengths, cap, cfg.seed, algorithm,
                                 copy_layers(joined(released_n_uids), joined(released_uids)))
    result.placed.append(save_rows(rows, in_loose.sums(loose_lengths), str(plans_dir / "global"), shard_bytes,
                                   in_loose.sums(joined(released_nbytes))))
    return result


def run(cfg: DataConfig, executor: Executor | None = None) -> dict:
    """tokenized/ -> packed/ (+ stats.json, stats.png); records and returns the `pack` report section.

    The workers plan partitions of `PARTITION_SEQUENCES` tokenized rows from the index alone (tallying what they
    read), the driver re-packs the rows they released (`plan_all`), the workers write the output shards
    (counting the sequences' lengths per category as they copy them), which the driver appends in order, then
    tally packed/ as written, which must match what was read.
    The driver holds counts and tallies, never a per-sequence array but the released sequences'."""
    from data.report import check_arithmetic, read_report, update_report
    from data.stats import MEDIA_REPORT_KEYS, format_table, media_statistics, pack_statistics, plot_stats

    executor = executor or LocalExecutor(cfg.workers)
    src = PackedDataset(cfg.tokenized_dir)
    if src.kind != "tokenized":
        raise ValueError(f"{cfg.tokenized_dir}: expected a tokenized dataset, found kind {src.kind!r}")
    cap = cfg.pack_max_length
    writer = ShardWriter(
        cfg.packed_dir, token_fields=src.token_fields, max_shard_bytes=cfg.pack.shard_size_mb << 20, kind="packed",
        media=src.has_media)
    with writer, executor.scratch(cfg.packed_dir.parent, "pack-parts") as scratch:
        planned = plan_all(executor, src, cfg, scratch)
        placed = planned.placed
        slices = [RowSpan(src, start, end, rows.plan_path, str(scratch / f"part_{n:05d}"), writer.max_shard_bytes)
                  for n, (rows, (start, end)) in enumerate((rows, cut) for rows in placed for cut in rows.shards)]
        seq_lengths: dict[int, Counts] = {}
        key_files, twice = [], 0
        with progress(total=sum(rows.rows for rows in placed), desc="pack", unit="row") as bar:
            for task, shard in zip(slices, executor.map(write_shard, slices)):
                writer.append_dataset(shard.part_dir)
                add_category_counts(seq_lengths, shard.seq_lengths)
                key_files.append(shard.keys_path)
                twice += shard.rows_with_a_record_twice
                bar.update(task.end - task.first)
        counts = writer.counts
        row_tokens = Counts.total(rows.row_tokens for rows in placed)
        stats = pack_statistics(
            seq_lengths, row_tokens, Counts.total(rows.row_sequences for rows in placed), cap,
            counts["category_tokens"], counts["category_loss_tokens"], src.categories,
        )
        tokenize_section = read_report(cfg.report_path).get("tokenize")
        tokenize_losses = None if tokenize_section is None else {
            "dropped": tokenize_section["dropped"], "truncated": tokenize_section.get("truncated", 0)}
        stats.update(duplicate_rows=count_duplicates(executor, key_files, counts["rows"]),
                     rows_with_a_record_twice=twice, algorithm=cfg.pack.algorithm, seed=cfg.seed,
                     tokenize=tokenize_losses)
        if tokenize_section is not None and "stepwise" in tokenize_section:  # samples, sequences, tokens saved
            stats["stepwise"] = tokenize_section["stepwise"]
        if src.has_media:
            stats.update(media_statistics(counts))
        meta_extra = {k: v for k, v in src.meta.items() if k not in RESERVED_META_KEYS}
        meta_extra.update(
            max_length=cap,
            config=output_config(cfg),
            pack={"algorithm": cfg.pack.algorithm, "seed": cfg.seed},
            source={"path": str(cfg.tokenized_dir), "kind": src.kind, "counts": src.meta["counts"]},
        )
        png = plot_stats(seq_lengths, row_tokens, cap, stats["categories"], tokenize_losses)
        writer.close(meta_extra, extra_files={"stats.json": dump_json(stats) + b"\n", "stats.png": png})
    print(format_table(stats), flush=True)

    packed = PackedDataset(cfg.packed_dir)
    written = SequenceTally()
    for tally in executor.map(tally_rows, [RowSpan(packed, a, b) for a, b in packed.shard_row_ranges()]):
        written += tally
    trace = check_accounting(planned.read, written)
    section = {
        "in": len(src),
        "out": int(packed.meta["counts"]["sequences"]),
        "dropped": {},
        "rows": stats["rows"],
        "tokens": stats["tokens"],
        "loss_tokens": stats["loss_tokens"],
        "max_length": cap,
        "fill": stats["fill"],
        "rows_over_lower_bound": stats["rows_over_lower_bound"],
        "duplicate_rows": stats["duplicate_rows"],
        "rows_with_a_record_twice": stats["rows_with_a_record_twice"],
        **({key: stats[key] for key in MEDIA_REPORT_KEYS if key in stats} if src.has_media else {}),
        "trace": dict(trace, where=f"{cfg.packed_dir}: per-sequence record_index (tokenized row) and uids, "
                                   "compared with the tokenized rows by counts and 64-bit multiset hashes"),
        "output": str(cfg.packed_dir),
    }
    check_arithmetic(section)
    update_report(cfg.report_path, "pack", section)
    return section


if __name__ == "__main__":
    from data.pipeline import cli_main

    cli_main(run, "pack")
