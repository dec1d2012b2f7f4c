"""The row planner: which sequences share a fixed-capacity row, the core the pack stage (data/pack.py) and the
trainer's online packing (train/steps/online.py) both run.

`plan_rows()` is the pure core: exact fill (the default), best-fit decreasing or first-fit decreasing over a
set of lengths. Exact fill builds one row at a time from the counts of each length: the longest sequence left,
then the longest that still leaves room for the shortest, until one sequence or a pair fills the row exactly
(`_exact_fill`); where that leaves more rows than best fit would, best fit's plan is used. Best fit finds the
tightest row with a two-level bitset over room values (a few operations on small Python ints per item), first
fit descends a max segment tree over rows (O(log rows) per item): about 1-2 CPU seconds per million lengths
each (benchmarks/results/pack.md). The result is a `RowPlan`: flat arrays, 16 bytes a sequence; `plan()` gives
the same rows as lists; `layout()` puts a plan's rows and their sequences in a seeded order.
"""
from __future__ import annotations

import array
import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("exact_fill", "best_fit", "first_fit")
DEFAULT_ALGORITHM = "exact_fill"
PLAN_CHUNK = 1 << 16  # lengths handed to the planning loop as Python ints at a time (bounds its memory)


@dataclass(frozen=True)
class RowPlan:
    """Rows of item indices as flat arrays: row r holds `members[starts[r]:starts[r + 1]]` (never empty)."""

    members: np.ndarray  # int64, the items of row 0, then of row 1, ...
    starts: np.ndarray  # int64 [rows + 1], starts[0] = 0, starts[-1] = len(members)

    def __len__(self) -> int:
        return self.starts.shape[0] - 1

    def __iter__(self) -> Iterator[np.ndarray]:
        members = self.members
        bounds = self.starts.tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            yield members[lo:hi]

    def row(self, r: int) -> np.ndarray:
        return self.members[self.starts[r]:self.starts[r + 1]]

    def slice(self, first: int, end: int) -> "RowPlan":
        """Rows first..end-1 as a plan of their own (what one writer task needs)."""
        lo, hi = int(self.starts[first]), int(self.starts[end])
        return RowPlan(self.members[lo:hi], self.starts[first:end + 1] - lo)

    @property
    def sizes(self) -> np.ndarray:
        """Items per row."""
        return np.diff(self.starts)

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per row, the sum of `values` over its items (e.g. tokens per row from the items' lengths)."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(np.asarray(values, dtype=np.int64)[self.members], self.starts[:-1])

    def tolist(self) -> list[list[int]]:
        return [row.tolist() for row in self]

    @classmethod
    def from_assignment(cls, items: np.ndarray, row_of: np.ndarray, n_rows: int) -> "RowPlan":
        """`items[k]` goes to row `row_of[k]`; within a row, items keep their order in `items`."""
        members = items[np.argsort(row_of, kind="stable")]
        starts = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(row_of, minlength=n_rows), out=starts[1:])
        return cls(members, starts)


# ---------------------------------------------------------------------------------------------- planning
def _decreasing_order(lengths: np.ndarray, seed: int) -> np.ndarray:
    """Indices by decreasing length; equal lengths in a seeded random order (the only use of the seed)."""
    perm = np.random.default_rng(seed).permutation(lengths.shape[0])
    return perm[np.argsort(-lengths[perm], kind="stable")]


def _check_lengths(lengths, max_length: int) -> np.ndarray:
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length <= 0:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr <= 0) | (arr > max_length))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"length[{i}] = {int(arr[i])} is outside 1..max_length={max_length} ({bad.size} such lengths); "
            "overlong sequences are handled by the tokenize stage"
        )
    return arr


def plan_rows(lengths, max_length: int, seed: int = 0, algorithm: str = DEFAULT_ALGORITHM) -> RowPlan:
    """Group item indices into rows of total length <= max_length, each index exactly once.

    `exact_fill` fills one row at a time (`_exact_fill`) and, where that gives more rows than the lower bound
    ceil(sum / max_length) and more than best fit, takes best fit's plan. `best_fit` and `first_fit` place the
    items in decreasing length, each into the open row with the least room that still fits it (best) or into
    the oldest such row (first); a new row is opened when none fits. Rows are numbered in the order they are
    opened (filled), and a row's items are in decreasing length. Equal lengths are taken in a seeded order: the
    result is a deterministic function of (lengths, max_length, seed, algorithm).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    arr = _check_lengths(lengths, max_length)
    if arr.size == 0:
        return RowPlan(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    order = _decreasing_order(arr, seed)
    sizes = arr[order]
    cap = int(max_length)
    if algorithm == "exact_fill":
        row_of, n_rows = _exact_fill(sizes, cap)
        if n_rows > -(-int(sizes.sum()) // cap):
            best = _best_fit(sizes, cap)
            if best[1] < n_rows:
                row_of, n_rows = best
    else:
        row_of, n_rows = (_best_fit if algorithm == "best_fit" else _first_fit)(sizes, cap)
    return RowPlan.from_assignment(order, row_of, n_rows)


def plan(lengths, max_length: int, seed: int = 0, algorithm: str = DEFAULT_ALGORITHM) -> list[list[int]]:
    """`plan_rows` as a list of rows, each a list of item indices."""
    return plan_rows(lengths, max_length, seed, algorithm).tolist()


def _chunks_as_ints(sizes: np.ndarray) -> Iterator[int]:
    """The sizes as Python ints, converted `PLAN_CHUNK` at a time (not all at once: 36 bytes each)."""
    for lo in range(0, sizes.shape[0], PLAN_CHUNK):
        yield from sizes[lo:lo + PLAN_CHUNK].tolist()


def _exact_fill(sizes: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """Rows one at a time over `sizes` in decreasing order: (the row of each item, the number of rows).

    A row starts with the longest item left. While it has room r: an item of length r, else the most even
    pair of lengths summing to r (one vectorised pass over the lengths left), closes it exactly; else it takes
    the longest item that leaves room for the shortest one left (or, if none, the longest that fits). Items of
    equal length are taken in their order in `sizes`. Best fit's waste sits in rows whose room is smaller
    than any item left; aiming every row at an exact sum leaves that room in the last rows only, which on real
    length distributions is the lower bound (benchmarks/results/pack.md).
    """
    counts_by_length = np.bincount(sizes, minlength=cap + 1)
    available = counts_by_length > 0  # as a bool array, for the pair search
    next_item = (np.cumsum(counts_by_length[::-1])[::-1] - counts_by_length).tolist()  # first index of a length
    counts = counts_by_length.tolist()
    lengths_left = np.flatnonzero(available).tolist()  # ascending, each once
    row_of = array.array("q", bytes(8 * sizes.shape[0]))
    row = 0

    def take(length: int) -> None:
        i = next_item[length]
        next_item[length] = i + 1
        row_of[i] = row
        counts[length] -= 1
        if not counts[length]:
            available[length] = False
            del lengths_left[bisect.bisect_left(lengths_left, length)]

    while lengths_left:
        first = lengths_left[-1]
        take(first)
        room = cap - first
        while lengths_left and room >= lengths_left[0]:
            shortest = lengths_left[0]
            if counts[room]:
                take(room)
                break
            # a in shortest..top pairs with room - a in room - top..room - shortest (a = room / 2 needs two items)
            top = room >> 1 if room & 1 or counts[room >> 1] > 1 else (room >> 1) - 1
            if shortest <= top and room <= 2 * lengths_left[-1]:
                pairs = np.flatnonzero(available[shortest:top + 1] & available[room - top:room - shortest + 1][::-1])
                if pairs.size:
                    a = shortest + int(pairs[-1])
                    take(a)
                    take(room - a)
                    break
            k = bisect.bisect_right(lengths_left, room - shortest) - 1
            length = lengths_left[k] if k >= 0 else lengths_left[bisect.bisect_right(lengths_left, room) - 1]
            take(length)
            room -= length
        row += 1
    return np.frombuffer(row_of, dtype=np.int64), row


def _best_fit(sizes: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """Best fit of `sizes` in the given order: (the row of each item, the number of rows).

    `buckets[r]` is a stack of the rows with exactly r tokens of room. The non-empty buckets are a bitset in
    two levels: `words[w]` holds bits r = 64w..64w+63 and bit w of `summary` says words[w] is non-zero, so
    "smallest r >= s with a row" is two shifts and a lowest-set-bit on small Python ints.
    """
    n_words = (cap >> 6) + 1
    words = [0] * n_words
    summary = 0
    buckets: list[list[int] | None] = [None] * (cap + 1)
    row_of = array.array("q")
    assign = row_of.append
    n_rows = 0
    half = cap // 2
    for s in _chunks_as_ints(sizes):
        r = -1
        if s <= half:  # in decreasing order nothing larger than half the room can share a row
            w = s >> 6
            word = words[w] >> (s & 63)
            if word:
                r = s + (word & -word).bit_length() - 1
            else:
                hi = summary >> (w + 1)
                if hi:
                    w = w + (hi & -hi).bit_length()
                    word = words[w]
                    r = (w << 6) + (word & -word).bit_length() - 1
        if r < 0:
            b = n_rows
            n_rows += 1
            left = cap - s
        else:
            stack = buckets[r]
            b = stack.pop()
            if not stack:
                w = r >> 6
                words[w] &= ~(1 << (r & 63))
                if not words[w]:
                    summary &= ~(1 << w)
            left = r - s
        assign(b)
        if left:
            stack = buckets[left]
            if stack:
                stack.append(b)
            else:
                buckets[left] = [b]
                w = left >> 6
                if not words[w]:
                    summary |= 1 << w
                words[w] |= 1 << (left & 63)
    return np.frombuffer(row_of, dtype=np.int64), n_rows


def _first_fit(sizes: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """First fit of `sizes` in the given order over a max segment tree of the rows' remaining room (leaves in
    row order): (the row of each item, the number of rows)."""
    size = 1024
    tree = [0] * (2 * size)  # tree[1] is the root; leaves at size..2*size-1; unopened rows have room 0
    row_of = array.array("q")
    assign = row_of.append
    n_rows = 0
    for s in _chunks_as_ints(sizes):
        if tree[1] >= s:
            i = 1
            while i < size:
                i <<= 1
                if tree[i] < s:
                    i += 1
            b = i - size
            tree[i] -= s
        else:
            b = n_rows
            n_rows += 1
            if b == size:  # grow: double the leaves and rebuild the inner nodes
                leaves = tree[size:] + [0] * size
                size *= 2
                tree = [0] * size + leaves
                for j in range(size - 1, 0, -1):
                    tree[j] = max(tree[2 * j], tree[2 * j + 1])
            i = size + b
            tree[i] = cap - s
        assign(b)
        i >>= 1
        while i:
            a, c = tree[2 * i], tree[2 * i + 1]
            m = a if a > c else c
            if tree[i] == m:
                break
            tree[i] = m
            i >>= 1
    return np.frombuffer(row_of, dtype=np.int64), n_rows


def layout(rows: RowPlan, seed: int) -> RowPlan:
    """The rows in seeded random order, the sequences inside each row in seeded random order too (a stream
    distinct from `plan_rows`' tie-breaking one)."""
    rng = np.random.default_rng([seed, 1])
    order = rng.permutation(len(rows))
    sizes = rows.sizes
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(sizes[order], out=starts[1:])
    members = np.empty_like(rows.members)
    bounds = rows.starts.tolist()
    at = 0
    for b in order.tolist():
        lo, hi = bounds[b], bounds[b + 1]
        n = hi - lo
        members[at:at + n] = rows.members[lo:hi] if n == 1 else rows.members[lo:hi][rng.permutation(n)]
        at += n
    return RowPlan(members, starts)
