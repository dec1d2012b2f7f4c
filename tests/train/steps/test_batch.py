"""train.steps.batch: shifted targets, restarting positions, and the exact step weights of each reduction."""
import sys
import types

import numpy as np
import pytest
import torch

from train.steps.batch import IGNORE_INDEX, StepTotals, make_batch, shift_targets, step_totals
from data.shards.dataset import Structure

REDUCTIONS = ("token", "turn", "sample")


def conversation(segments, rng, first_token=1):
    """One sequence from segments (n_tokens, trained, category): trained segments are the turns 1, 2, ..."""
    ids, labels, cats, turns = [], [], [], []
    turn = 0
    for n, trained, cat in segments:
        seg = rng.integers(2, 1000, size=n)
        ids.append(seg)
        cats.append(np.full(n, cat))
        if trained:
            turn += 1
            labels.append(seg)
            turns.append(np.full(n, turn))
        else:
            labels.append(np.full(n, IGNORE_INDEX))
            turns.append(np.zeros(n, dtype=np.int64))
    return {
        "input_ids": np.concatenate(ids).astype(np.int32),
        "labels": np.concatenate(labels).astype(np.int32),
        "category_ids": np.concatenate(cats).astype(np.int16),
        "turn_ids": np.concatenate(turns).astype(np.int16),
    }


def row_of(seqs):
    row = {k: np.concatenate([s[k] for s in seqs]) for k in seqs[0]}
    row["seq_lens"] = np.array([len(s["input_ids"]) for s in seqs])
    return row


class RowsMeta:
    """Per-row counts as the shards define them (labels != -100, distinct non-zero turn ids, samples)."""

    def __init__(self, rows_seqs):
        self.row_n_loss_tokens = np.array([sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in r) for r in rows_seqs])
        self.row_n_trained_turns = np.array([sum(len(set(s["turn_ids"].tolist()) - {0}) for s in r) for r in rows_seqs])
        self.row_n_samples = np.array([sum(int((s["labels"] != IGNORE_INDEX).any()) for s in r) for r in rows_seqs])


def reference_step_loss(samples_ce, reduction):
    """The reduction's definition, sample by sample: samples_ce = list of (per-token ce, per-token turn id)."""
    if reduction == "token":
        return np.concatenate([ce for ce, _ in samples_ce]).sum() / sum(len(ce) for ce, _ in samples_ce)
    if reduction == "sample":
        means = [ce.mean() for ce, _ in samples_ce if len(ce)]
        return float(np.mean(means))
    turn_means = [ce[turns == k].mean() for ce, turns in samples_ce for k in np.unique(turns)]
    return float(np.mean(turn_means))


@pytest.fixture
def step_rows():
    """Four rows (one with no loss token) of multi-turn sequences; several sequences reuse turn id 1."""
    rng = np.random.default_rng(0)
    rows_seqs = [
        [conversation([(3, False, 1), (4, True, 1), (2, False, 1), (6, True, 1)], rng),
         conversation([(2, False, 2), (5, True, 2)], rng)],
        [conversation([(5, False, 0)], rng),  # a sequence without loss tokens inside a row
         conversation([(1, False, 3), (9, True, 3), (3, False, 3), (1, True, 2)], rng)],
        [conversation([(4, False, 1)], rng), conversation([(2, False, 2)], rng)],  # a row with no loss token
        [conversation([(2, False, 1), (3, True, 1)], rng)],
    ]
    return rows_seqs


def test_step_totals_reads_per_row_arrays(step_rows):
    meta = RowsMeta(step_rows)
    totals = step_totals(meta, [0, 1, 2, 3])
    assert totals == StepTotals(n_loss_tokens=4 + 6 + 5 + 9 + 1 + 3, n_trained_turns=6, n_samples=4)
    assert step_totals(meta, np.array([1])) == StepTotals(10, 2, 1)
    as_mapping = {k: getattr(meta, k) for k in ("row_n_loss_tokens", "row_n_trained_turns", "row_n_samples")}
    assert step_totals(as_mapping, [0, 3]) == step_totals(meta, [0, 3])
    assert totals.normalizer("turn") == 6
    with pytest.raises(ValueError, match="reduction"):
        totals.normalizer("mean")


def test_targets_positions_and_boundaries():
    labels = np.array([-100, 5, 6, -100, 8, -100, 10, 11, 12])
    seq_lens = np.array([3, 2, 4])
    row = {
        "input_ids": np.arange(9), "labels": labels, "category_ids": np.array([0, 1, 1, 0, 2, 0, 3, 3, 4]),
        "turn_ids": np.array([0, 1, 1, 0, 1, 0, 1, 1, 2]), "seq_lens": seq_lens,
    }
    b = make_batch([row], StepTotals(6, 4, 3), "token")
    # labels[1:], with -100 at the last token of every sequence
    assert b.targets.tolist() == [5, 6, -100, 8, -100, 10, 11, 12, -100]
    assert b.target_categories.tolist() == [1, 1, 0, 2, 0, 3, 3, 4, 0]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert b.max_seqlen == 4
    assert b.seq_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert b.input_ids.shape == (1, 9) and b.input_ids.dtype == torch.int64
    assert b.weights.dtype == torch.float32
    assert torch.equal(b.weights > 0, b.targets != IGNORE_INDEX)
    assert (b.n_loss_tokens, b.n_trained_turns, b.n_samples) == (6, 4, 3)
    assert shift_targets(np.array([1, 2, 3]), np.array([0, 1])).tolist() == [-100, 3, -100]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("split", [[[0, 1, 2, 3]], [[0], [1], [2], [3]], [[2, 0], [3, 1]]])
def test_step_weights_exact_under_any_split(step_rows, reduction, split):
    meta = RowsMeta(step_rows)
    totals = step_totals(meta, [i for mb in split for i in mb])
    rng = np.random.default_rng(1)
    # one fixed random "cross-entropy" per label token of every sequence, whatever the split
    ce_of = {(r, s): rng.random(len(seq["labels"])) for r, row in enumerate(step_rows) for s, seq in enumerate(row)}
    weight_sum, step_loss, counts = 0.0, 0.0, np.zeros(3, dtype=np.int64)
    for mb in split:
        b = make_batch([row_of(step_rows[r]) for r in mb], totals, reduction)
        # ce of target t = ce of the label token t+1 it predicts
        token_ce = np.concatenate([ce_of[(r, s)] for r in mb for s in range(len(step_rows[r]))])
        target_ce = np.zeros_like(token_ce)
        target_ce[:-1] = token_ce[1:]
        w = b.weights.double().numpy()
        assert np.all(np.isfinite(w)) and np.all(w[b.targets.numpy() == IGNORE_INDEX] == 0)
        weight_sum += w.sum()
        step_loss += (w * target_ce).sum()
        counts += [b.n_loss_tokens, b.n_trained_turns, b.n_samples]
    samples = []
    for r, row in enumerate(step_rows):
        for s, seq in enumerate(row):
            trained = seq["labels"] != IGNORE_INDEX
            if trained.any():
                samples.append((ce_of[(r, s)][trained], seq["turn_ids"][trained]))
    assert weight_sum == pytest.approx(1.0, rel=1e-6)
    assert step_loss == pytest.approx(reference_step_loss(samples, reduction), rel=1e-6)
    assert counts.tolist() == [totals.n_loss_tokens, totals.n_trained_turns, totals.n_samples]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_micro_batch_without_loss_tokens_has_zero_weights(step_rows, reduction):
    totals = step_totals(RowsMeta(step_rows), [0, 1, 2, 3])
    b = make_batch([row_of(step_rows[2])], totals, reduction)
    assert b.n_loss_tokens == 0
    assert torch.count_nonzero(b.weights) == 0 and torch.isfinite(b.weights).all()
    assert (b.targets == IGNORE_INDEX).all()


def test_turns_of_different_sequences_never_merge():
    rng = np.random.default_rng(2)
    a = conversation([(1, False, 0), (2, True, 0)], rng)  # turn 1: 2 tokens
    b = conversation([(1, False, 0), (6, True, 0)], rng)  # also turn id 1: 6 tokens
    batch = make_batch([row_of([a, b])], StepTotals(8, 2, 2), "turn")
    w = batch.weights.numpy()
    assert np.allclose(w[w > 0], [1 / 4] * 2 + [1 / 12] * 6)


def test_label_on_first_token_is_an_error():
    rng = np.random.default_rng(3)
    seq = conversation([(3, True, 0)], rng)
    with pytest.raises(ValueError, match="first token"):
        make_batch([row_of([seq])], StepTotals(3, 1, 1), "token")


def test_totals_must_cover_the_micro_batch(step_rows):
    with pytest.raises(ValueError, match="step total"):
        make_batch([row_of(step_rows[0])], StepTotals(3, 1, 1), "token")
    with pytest.raises(ValueError, match="reduction"):
        make_batch([row_of(step_rows[0])], StepTotals(30, 6, 4), "mean")


def test_turn_reduction_rejects_loss_tokens_outside_turns():
    rng = np.random.default_rng(4)
    seq = conversation([(1, False, 0), (3, True, 0)], rng)
    seq["turn_ids"][:] = 0
    with pytest.raises(ValueError, match="turn"):
        make_batch([row_of([seq])], StepTotals(3, 1, 1), "turn")
    assert make_batch([row_of([seq])], StepTotals(3, 1, 1), "token").n_loss_tokens == 3


def test_structure_mode_positions_per_sequence(monkeypatch):
    calls = []

    def fake_position_ids(block_ids, path_ids):
        calls.append((block_ids.tolist(), path_ids.tolist()))
        return np.asarray(block_ids) * 10 + np.asarray(path_ids)

    monkeypatch.setitem(sys.modules, "data.shards.parallel_thinking", types.SimpleNamespace(position_ids=fake_position_ids))
    rng = np.random.default_rng(5)
    seqs = [conversation([(1, False, 0), (2, True, 0)], rng), conversation([(1, False, 0), (1, True, 0)], rng)]
    row = row_of(seqs)
    row["block_ids"] = np.array([0, 1, 1, 0, 2], dtype=np.int16)
    row["path_ids"] = np.array([0, 0, 1, 0, 1], dtype=np.int16)
    b = make_batch([row], StepTotals(3, 2, 2), "sample", structure=Structure.PARALLEL_THINKING)
    assert calls == [([0, 1, 1], [0, 0, 1]), ([0, 2], [0, 1])]
    assert b.position_ids.tolist() == [[0, 10, 11, 0, 21]]
    assert b.block_ids.tolist() == [0, 1, 1, 0, 2] and b.path_ids.tolist() == [0, 0, 1, 0, 1]


def test_with_packed_dataset(tmp_path, step_rows):
    """Round trip through the real shard format: the stored per-row counts give weights summing to 1."""
    shards = pytest.importorskip("data.shards.dataset")
    writer = shards.ShardWriter(tmp_path / "packed")
    for row in step_rows:
        writer.add_row(row)
    writer.close()
    ds = shards.PackedDataset(tmp_path / "packed")
    for reduction in REDUCTIONS:
        totals = step_totals(ds, range(len(ds)))
        total = sum(float(make_batch([ds[i]], totals, reduction).weights.double().sum()) for i in range(len(ds)))
        assert total == pytest.approx(1.0, rel=1e-6)
