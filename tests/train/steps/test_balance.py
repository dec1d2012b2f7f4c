"""Karmarkar-Karp partitioning and per-step dp balancing (train/steps/balance.py)."""
import itertools
import random

import numpy as np
import pytest

from train.steps.balance import balance_step, imbalance, karmarkar_karp, row_cost


def _check_partition(parts, n, k, equal_size):
    assert len(parts) == k
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n)), "every index exactly once"
    if equal_size:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= (0 if n % k == 0 else 1)


def _best_max(costs, k):
    """Exhaustive optimum of the largest part total (tiny inputs only)."""
    best = float("inf")
    for labels in itertools.product(range(k), repeat=len(costs)):
        totals = [0.0] * k
        for c, lab in zip(costs, labels):
            totals[lab] += c
        best = min(best, max(totals))
    return best


@pytest.mark.parametrize("equal_size", [True, False])
@pytest.mark.parametrize("n,k", [(0, 3), (1, 1), (5, 2), (12, 4), (13, 4), (3, 8), (64, 8)])
def test_every_index_once_and_equal_sizes(n, k, equal_size):
    rng = random.Random(n * 31 + k)
    costs = [rng.random() * 100 for _ in range(n)]
    parts = karmarkar_karp(costs, k, equal_size=equal_size)
    _check_partition(parts, n, k, equal_size)
    for p in parts:
        assert p == sorted(p)


def test_deterministic_with_ties():
    costs = [5.0] * 9 + [1.0] * 7 + [3.0] * 8
    first = karmarkar_karp(costs, 4)
    for _ in range(3):
        assert karmarkar_karp(list(costs), 4) == first
    _check_partition(first, len(costs), 4, True)
    totals = sorted(sum(costs[i] for i in p) for p in first)
    assert totals[-1] - totals[0] <= 2.0  # optimal: a 6-item total is 4a+2b+6, even, so 19 each is impossible


def test_textbook_instance():
    # Karmarkar-Karp on {8,7,6,5,4} into 2 sets: differences 8-7=1, 6-5=1, then 4,1,1 -> 3,1 -> 2.
    costs = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(costs, 2, equal_size=False)
    totals = sorted(sum(costs[i] for i in p) for p in parts)
    assert totals == [14, 16]


def test_near_optimal_on_small_random_instances():
    rng = random.Random(0)
    for _ in range(20):
        n, k = rng.randint(4, 8), rng.choice([2, 3])
        costs = [float(rng.randint(1, 50)) for _ in range(n)]
        parts = karmarkar_karp(costs, k, equal_size=False)
        kk_max = max(sum(costs[i] for i in p) for p in parts)
        assert kk_max <= 1.25 * _best_max(costs, k)


def test_balances_uniform_costs_tightly():
    rng = np.random.default_rng(1)
    costs = rng.uniform(1, 2, size=256).tolist()
    parts = karmarkar_karp(costs, 8)
    assert imbalance([sum(costs[i] for i in p) for p in parts]) < 1.001


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="k must be"):
        karmarkar_karp([1.0], 0)
    with pytest.raises(ValueError, match=r"costs\[1\]"):
        karmarkar_karp([1.0, float("nan")], 2)
    with pytest.raises(ValueError, match=r"costs\[0\]"):
        karmarkar_karp([-1.0], 2)


def test_row_cost():
    assert row_cost([3, 4]) == 25.0
    assert row_cost(np.array([3, 4], dtype=np.int32), linear=2.0) == 25.0 + 14.0
    assert row_cost([70000, 70000]) == 2 * 70000.0**2  # no int32 overflow


def test_balance_step_beats_contiguous_and_is_resumable():
    # A long-CoT-like step: a few rows are one huge sequence, most are many short ones.
    rng = np.random.default_rng(7)
    dp, per_rank = 4, 4
    seq_lens_per_row = []
    for r in range(dp * per_rank):
        if r < 4:  # the heavy rows come first, so a contiguous split gives them all to rank 0
            seq_lens_per_row.append([16000])
        else:
            seq_lens_per_row.append(list(rng.integers(200, 2000, size=12)))
    costs = [row_cost(s) for s in seq_lens_per_row]
    row_ids = [100 + 3 * r for r in range(dp * per_rank)]  # global dataset indices of the step's rows
    ranks = balance_step(row_ids, costs, dp)
    assert sorted(r for rank in ranks for r in rank) == sorted(row_ids)
    assert [len(rank) for rank in ranks] == [per_rank] * dp
    cost_of = dict(zip(row_ids, costs))
    after = imbalance([sum(cost_of[r] for r in rank) for rank in ranks])
    before = imbalance([sum(costs[i * per_rank : (i + 1) * per_rank]) for i in range(dp)])
    assert before > 3.0 and after < 1.05
    for rank in ranks:  # heaviest first within a rank
        assert [cost_of[r] for r in rank] == sorted((cost_of[r] for r in rank), reverse=True)
    # The result depends only on the step's rows: recomputing (a resumed run) gives the same assignment.
    assert balance_step(list(row_ids), np.asarray(costs), dp) == ranks


def test_balance_step_uneven_last_step_and_errors():
    ranks = balance_step([5, 6, 7, 8, 9], [1, 2, 3, 4, 5], 2)
    assert sorted(len(r) for r in ranks) == [2, 3]
    assert sorted(sum(ranks, [])) == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="aligned with row_indices"):
        balance_step([1, 2, 3], [1.0, 2.0], 2)
    with pytest.raises(ValueError, match="dp_size"):
        balance_step([1], [1.0], 0)


def test_micro_steps_hold_cost_sorted_groups():
    """Equal-size KK gives each rank one row of every group of dp consecutive rows in cost order, and rows come
    heaviest first: micro-step i across ranks is exactly the i-th heaviest group (minimal sum of slowest rows)."""
    rng = np.random.default_rng(3)
    dp, per_rank = 4, 5
    costs = rng.permutation(np.arange(1, dp * per_rank + 1) ** 2).astype(float)  # distinct costs
    rows = list(range(1000, 1000 + dp * per_rank))
    ranks = balance_step(rows, costs, dp)
    cost_of = dict(zip(rows, costs))
    groups = np.sort(costs)[::-1].reshape(per_rank, dp)
    for i in range(per_rank):
        assert sorted(cost_of[rank[i]] for rank in ranks) == sorted(groups[i])
