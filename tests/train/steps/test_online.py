"""Online packing over a tokenized dataset (train/steps/online.py)."""
import numpy as np
import pytest

from data.shards.dataset import IGNORE_INDEX, PackedDataset, ShardWriter
from train.steps.balance import dataset_row_costs, row_cost
from train.steps.online import OnlinePackedDataset, epoch_plan, open_train_dataset

MAX_LEN = 64


def _sequence(rng, uid):
    """A tokenized sequence: input_ids encode (uid, position) so every token is traceable."""
    n = int(rng.integers(3, 40))
    input_ids = uid * 1000 + np.arange(n, dtype=np.int32)
    n_turns = int(rng.integers(0, 3))
    turn_ids = np.zeros(n, dtype=np.int16)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int32)
    for t in range(n_turns):  # turn t+1 trained on a slice of the sequence
        lo = 1 + t * (n // 3)
        hi = min(n, lo + 2)
        turn_ids[lo:hi] = t + 1
        labels[lo:hi] = input_ids[lo:hi]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "category_ids": np.full(n, uid % 3, dtype=np.int16),
        "turn_ids": turn_ids,
    }


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    rng = np.random.default_rng(0)
    out = tmp_path_factory.mktemp("online") / "tokenized"
    seqs = [_sequence(rng, uid) for uid in range(120)]
    with ShardWriter(out, kind="tokenized", max_shard_bytes=2000) as writer:  # several shards
        for uid, seq in enumerate(seqs):
            writer.add_row([seq], record_indices=[uid], uids=[[uid]])
        writer.close({"max_length": 256, "categories": {"0": "a", "1": "b", "2": "c"}})
    return out, seqs


def _sequence_ids(ds):
    """(tokenized row) of every sequence in every packed row, checking tokens and seq_lens on the way."""
    seen = []
    for i in range(len(ds)):
        row = ds[i]
        assert row["input_ids"].shape[0] == row["seq_lens"].sum() == ds.row_n_tokens[i] <= ds.max_length
        start = 0
        for length, rec in zip(row["seq_lens"], row["record_index"]):
            ids = row["input_ids"][start : start + length]
            assert (ids == rec * 1000 + np.arange(length)).all(), "sequence tokens intact and in order"
            start += length
            seen.append(int(rec))
    return seen


def test_every_sequence_once_per_epoch_and_rows_fit(tokenized):
    path, seqs = tokenized
    ds = OnlinePackedDataset(path, MAX_LEN, seed=3)
    assert len(PackedDataset(path).meta["shards"]) > 1
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        seen = _sequence_ids(ds)
        assert sorted(seen) == list(range(len(seqs)))
        assert len(ds) < len(seqs) // 2  # actually packed
        assert ds.meta["counts"]["rows"] == len(ds) and ds.meta["counts"]["sequences"] == len(seqs)
        assert ds.meta["kind"] == "packed" and ds.meta["online"]["epoch"] == epoch


def test_per_row_arrays_match_rows(tokenized):
    path, seqs = tokenized
    ds = OnlinePackedDataset(path, MAX_LEN, seed=3)
    for i in range(len(ds)):
        row = ds[i]
        recs = row["record_index"]
        assert ds.row_n_loss_tokens[i] == np.count_nonzero(row["labels"] != IGNORE_INDEX)
        assert ds.row_n_trained_turns[i] == sum(np.count_nonzero(np.bincount(seqs[r]["turn_ids"])[1:]) for r in recs)
        assert ds.row_n_samples[i] == sum((seqs[r]["labels"] != IGNORE_INDEX).any() for r in recs)
        assert ds.row_n_seqs[i] == len(recs)
        for field in ("labels", "category_ids", "turn_ids"):
            assert (row[field] == np.concatenate([seqs[r][field] for r in recs])).all()
        assert [u.tolist() for u in ds.row_uids(i)] == [[int(r)] for r in recs]
    assert ds.meta["counts"]["loss_tokens"] == sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in seqs)
    assert ds.categories == {0: "a", 1: "b", 2: "c"}
    costs = dataset_row_costs(ds)
    assert np.allclose(costs, [row_cost(ds[i]["seq_lens"]) for i in range(len(ds))])


def test_deterministic_for_a_seed_and_epochs_differ(tokenized):
    path, _ = tokenized
    a = OnlinePackedDataset(path, MAX_LEN, seed=11)
    b = OnlinePackedDataset(path, MAX_LEN, seed=11)
    rows_a = [a.row_members(i).tolist() for i in range(len(a))]
    assert rows_a == [b.row_members(i).tolist() for i in range(len(b))]
    a.set_epoch(1)
    rows_a1 = [a.row_members(i).tolist() for i in range(len(a))]
    assert rows_a1 != rows_a
    assert {frozenset(r) for r in rows_a1} != {frozenset(r) for r in rows_a}, "different packings, not only order"
    a.set_epoch(0)  # resumable: going back to an epoch restores its plan
    assert [a.row_members(i).tolist() for i in range(len(a))] == rows_a


def test_sampler_replans_once_per_epoch(tokenized, monkeypatch):
    from train.steps.sampler import StepSampler

    path, _ = tokenized
    ds = OnlinePackedDataset(path, MAX_LEN, seed=3)
    calls = []
    real = ds.set_epoch
    monkeypatch.setattr(ds, "set_epoch", lambda epoch: (calls.append(epoch), real(epoch)))
    sampler = StepSampler(ds, dp_size=2, dp_rank=0, grad_accum=1, micro_batch_rows=2, seed=3, balance=True)
    total = sampler.total_steps(None, num_epochs=2)
    calls.clear()  # counting steps per epoch visits both epochs
    for step in range(total):
        sampler.plan(step)
    assert calls == [0, 1]  # back to epoch 0 (built for epoch 0, counted epoch 1 last), then to epoch 1
    assert sampler.plan(total - 1).epoch == 1 and calls == [0, 1]


def test_epoch_plan_is_the_pack_core():
    lengths = np.array([5, 9, 3, 9, 7, 1, 4, 4, 8])
    rows = epoch_plan(lengths, 10, seed=2, epoch=1)
    assert sorted(int(i) for r in rows for i in r) == list(range(len(lengths)))
    assert all(lengths[r].sum() <= 10 for r in rows)
    assert [r.tolist() for r in rows] == [r.tolist() for r in epoch_plan(lengths, 10, seed=2, epoch=1)]


def test_errors_and_open_train_dataset(tokenized, tmp_path):
    path, _ = tokenized
    with pytest.raises(ValueError, match=r"row \d+ has \d+ tokens > max_length=8"):
        OnlinePackedDataset(path, 8)
    ds = open_train_dataset(path, seed=1)
    assert isinstance(ds, OnlinePackedDataset) and ds.max_length == 256
    packed = tmp_path / "packed"
    with ShardWriter(packed, kind="packed") as writer:
        writer.add_row([_sequence(np.random.default_rng(1), 1), _sequence(np.random.default_rng(2), 2)])
        writer.close({"max_length": 128})
    assert isinstance(open_train_dataset(packed), PackedDataset)
    with pytest.raises(Exception, match="one sequence per row"):
        OnlinePackedDataset(packed, 128)


def test_trainer_trains_every_sequence_once_per_epoch(tmp_path):
    """data_path at a tokenized dataset + online_max_length: the trainer re-plans per epoch and every tokenized
    sequence goes through exactly one micro-batch per epoch."""
    from tests._train_helpers import save_tiny_model, synthetic_sequence, write_config
    from train.config.sections import load_config
    from train.trainer import Trainer

    rng = np.random.default_rng(5)
    tokenized = tmp_path / "tokenized"
    n_seqs = 23
    with ShardWriter(tokenized, kind="tokenized") as writer:
        for uid in range(n_seqs):
            seq = synthetic_sequence(rng, int(rng.integers(5, 30)), 2, 1)
            writer.add_row([seq], record_indices=[uid], uids=[[uid]])
        writer.close({"max_length": 256, "categories": {"0": "untracked", "1": "math"}})
    config = write_config(tmp_path / "train.yaml", data_path=str(tokenized), output_dir=str(tmp_path / "out"),
                          model_path=str(save_tiny_model(tmp_path / "model")), online_max_length=48,
                          num_epochs=2, micro_batch_rows=2, lr=1e-3, plot=False, tokenizer_mismatch="warn")
    trainer = Trainer(load_config(config))
    assert isinstance(trainer.dataset, OnlinePackedDataset)
    seen = {0: [], 1: []}
    plans = {0: [], 1: []}
    real_micro_batch = trainer._micro_batch

    def recording(plan, rows, filler):
        if not filler:
            for r in rows:
                members = trainer.dataset.row_members(r).tolist()
                seen[plan.epoch] += members
                plans[plan.epoch].append(sorted(members))
        return real_micro_batch(plan, rows, filler)

    trainer._micro_batch = recording
    trainer.train()
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(n_seqs)), f"epoch {epoch}"
    assert sorted(plans[0]) != sorted(plans[1]), "each epoch packs anew"
