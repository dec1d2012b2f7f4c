"""Balanced assignment of an optimizer step's packed rows to data-parallel ranks.

Packed rows hold about the same number of tokens, yet their attention cost (sum of seq_len**2 over the
sequences packed in a row) can differ by orders of magnitude: one 32K-token sequence costs 1024x the
attention of 32 sequences of 1K tokens. With a contiguous split of the step's rows the slowest rank sets
the pace of every step. `balance_step` splits the step's rows so that the estimated cost per rank is even,
using the largest differencing method of Karmarkar and Karp (the partitioning RL2 and verl use for their
micro-batches). Everything here is a pure function of its inputs: the assignment depends only on the rows
of the step (which the seeded sampler fixes), so it is deterministic and resumable from any step.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

__all__ = ["karmarkar_karp", "row_cost", "dataset_row_costs", "balance_step", "imbalance"]

_NO_INDEX = 1 << 62  # sort key of an empty subset (after every real index)


class _Subset:
    __slots__ = ("total", "items", "first")

    def __init__(self, total: float, items: list[int]):
        self.total = total
        self.items = items
        self.first = min(items) if items else _NO_INDEX


def _key_desc(subset: _Subset) -> tuple[float, int]:
    """Heaviest first; equal totals ordered by their smallest index, so ties are broken deterministically."""
    return (-subset.total, subset.first)


def _merge(a: list[_Subset], b: list[_Subset]) -> list[_Subset]:
    """Differencing step: the heaviest subset of `a` takes the lightest of `b`, and so on down."""
    merged = [
        _Subset(x.total + y.total, x.items + y.items) for x, y in zip(a, reversed(b))
    ]
    merged.sort(key=_key_desc)
    return merged


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Partition indices 0..len(costs)-1 into k parts of near-equal total cost (largest differencing method).

    Each index appears in exactly one part. With `equal_size`, parts get the same number of items (when
    len(costs) is not a multiple of k, sizes differ by at most one: the shortfall is filled with zero-cost
    placeholders that are removed from the result). Deterministic: ties are broken by index. Each part is
    returned in ascending index order, parts ordered by their smallest index (empty parts last).
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    costs = [float(c) for c in costs]
    for i, c in enumerate(costs):
        if not np.isfinite(c) or c < 0:
            raise ValueError(f"karmarkar_karp: costs[{i}]={c} is not a finite non-negative number")
    n = len(costs)
    if n == 0:
        return [[] for _ in range(k)]

    padded = list(costs)
    if equal_size and n % k:
        padded += [0.0] * (k - n % k)  # placeholders, indices >= n
    order = sorted(range(len(padded)), key=lambda i: (padded[i], i))

    # A heap of partial solutions ("states"): k subsets each, keyed by their spread (max - min total).
    heap: list[tuple[float, int, list[_Subset]]] = []
    if equal_size:
        groups = [order[i : i + k] for i in range(0, len(order), k)]
        states = [sorted((_Subset(padded[i], [i]) for i in g), key=_key_desc) for g in groups]
    else:
        states = [[_Subset(padded[i], [i])] + [_Subset(0.0, []) for _ in range(k - 1)] for i in order]
    for seq, state in enumerate(states):
        heapq.heappush(heap, (-(state[0].total - state[-1].total), seq, state))
    seq = len(states)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b)
        heapq.heappush(heap, (-(merged[0].total - merged[-1].total), seq, merged))
        seq += 1

    parts = [sorted(i for i in subset.items if i < n) for subset in heap[0][2]]
    parts.sort(key=lambda p: p[0] if p else _NO_INDEX)
    return parts


def row_cost(seq_lens: Sequence[int] | np.ndarray, linear: float = 0.0) -> float:
    """Estimated compute cost of one packed row: sum of seq_len**2 (attention) + linear * sum of seq_len.

    `linear` weighs the per-token work against attention. Per layer, causal attention over a sequence of
    length s costs about d * s**2 multiply-adds (QK^T and AV, each halved by the mask) and the projections
    plus a gated MLP about (4 d**2 + 3 d m) * s, so in units of seq_len**2, linear ~ 4 d + 3 m (hidden size d,
    MLP size m). The default 0 balances attention only: the part that differs between rows of equal token
    count.
    """
    lens = np.asarray(seq_lens, dtype=np.float64)
    return float(np.dot(lens, lens) + linear * lens.sum())


def dataset_row_costs(dataset, linear: float = 0.0) -> np.ndarray:
    """`row_cost` of every row of a PackedDataset / OnlinePackedDataset, from the sequence index only.

    Reads `seq_index["length"]` and `row_n_seqs` (no token data); other dataset-like objects fall back to
    each row's `seq_lens`.
    """
    if hasattr(dataset, "seq_index") and hasattr(dataset, "row_n_seqs"):
        lens = np.asarray(dataset.seq_index["length"], dtype=np.float64)
        n_seqs = np.asarray(dataset.row_n_seqs, dtype=np.int64)
        if n_seqs.size == 0:
            return np.zeros(0, dtype=np.float64)
        if (n_seqs <= 0).any() or int(n_seqs.sum()) != lens.shape[0]:
            raise ValueError("dataset_row_costs: row_n_seqs does not match the sequence index")
        starts = np.zeros(n_seqs.shape[0], dtype=np.int64)
        np.cumsum(n_seqs[:-1], out=starts[1:])
        return np.add.reduceat(lens * lens + linear * lens, starts)
    return np.array([row_cost(dataset[i]["seq_lens"], linear) for i in range(len(dataset))], dtype=np.float64)


def balance_step(
    row_indices: Sequence[int], costs: Sequence[float] | np.ndarray, dp_size: int
) -> list[list[int]]:
    """Assign one optimizer step's rows to `dp_size` ranks with balanced total cost.

    `costs[j]` is the cost of row `row_indices[j]` (e.g. `row_cost` of its seq_lens). Returns, per dp rank,
    the row indices it processes; every rank gets the same number of rows (at most one fewer when the step's
    row count is not a multiple of dp_size). Within a rank the rows come heaviest first (ties by position in
    the step), so the i-th micro-batches of all ranks are of similar cost too. Parts are handed to ranks in
    a fixed order, so the result depends only on (row_indices, costs, dp_size).
    """
    rows = [int(r) for r in row_indices]
    cost_list = [float(c) for c in np.asarray(costs, dtype=np.float64).reshape(-1)]
    if len(cost_list) != len(rows):
        raise ValueError(
            f"balance_step: costs has {len(cost_list)} entries but the step has {len(rows)} rows; "
            "pass the costs of the step's rows, aligned with row_indices"
        )
    if dp_size < 1:
        raise ValueError(f"balance_step: dp_size must be >= 1, got {dp_size}")
    parts = karmarkar_karp(cost_list, dp_size, equal_size=True)
    return [[rows[j] for j in sorted(part, key=lambda j: (-cost_list[j], j))] for part in parts]


def imbalance(per_rank_costs: Sequence[float]) -> float:
    """max/mean of the per-rank costs (1.0 is perfect balance; 1.0 for an all-zero step)."""
    arr = np.asarray(per_rank_costs, dtype=np.float64)
    mean = arr.mean() if arr.size else 0.0
    return float(arr.max() / mean) if mean > 0 else 1.0
