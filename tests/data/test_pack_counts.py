"""What pack's driver holds instead of per-sequence arrays: `Counts` (stats.json and stats.png from counted
lengths, exactly as numpy over the columns), `SequenceTally` (the accounting check from parts that add up), and
the row-range readers of `PackedDataset` the workers use."""
import numpy as np
import orjson
import pytest

from data import pack
from data.pack import SequenceTally
from data.shards.dataset import PackedDataset, ShardWriter
from data.stats import Counts, add_category_counts, category_counts
from tests.data.test_pack_roundtrip import config, write_tokenized
from tests.shards.test_format import make_sequence, write_rows


def numpy_summary(column):
    column = np.asarray(column, dtype=np.int64)
    if not column.size:
        return {"min": 0, "mean": 0.0, "median": 0.0, "max": 0}
    return {"min": int(column.min()), "mean": float(column.mean()), "median": float(np.median(column)),
            "max": int(column.max())}


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 1001])
def test_counts_summary_is_numpy_over_the_column_however_it_is_split(n):
    rng = np.random.default_rng(n)
    column = rng.integers(1, 131_073, n) if n % 2 else rng.integers(1, 40, n)  # many distinct values / few
    cuts = np.sort(rng.integers(0, n + 1, 5))
    parts = [Counts.of(part) for part in np.split(column, cuts)]
    total = Counts.total(parts)
    assert total.summary() == numpy_summary(column)  # exactly: the same floats
    assert total.n == n and total.sum == int(column.sum())
    np.testing.assert_array_equal(total.values, np.unique(column))
    assert (total.counts > 0).all()
    assert (Counts.of([]) + total).summary() == total.summary()


def test_category_counts_add_up_per_category():
    rng = np.random.default_rng(1)
    lengths, cats = rng.integers(1, 500, 3000), rng.integers(0, 5, 3000)
    total: dict[int, Counts] = {}
    for a, b in ((0, 1000), (1000, 1001), (1001, 3000)):
        add_category_counts(total, category_counts(lengths[a:b], cats[a:b]))
    assert sorted(total) == sorted(set(cats.tolist()))
    for cid, counts in total.items():
        assert counts.summary() == numpy_summary(lengths[cats == cid])


def test_stats_json_is_numpy_over_the_written_dataset(tmp_path, monkeypatch):
    """Partitions of 64 rows over a tokenized dataset of many shards, 2 workers: every figure of stats.json that
    summarizes a column equals numpy over packed/'s own index."""
    monkeypatch.setattr(pack, "PARTITION_SEQUENCES", 64)
    write_tokenized(tmp_path / "tokenized", n=400)
    cfg = config(tmp_path)
    cfg.num_workers = 2
    pack.run(cfg)
    stats = orjson.loads((cfg.packed_dir / "stats.json").read_bytes())
    ds = PackedDataset(cfg.packed_dir)
    src = PackedDataset(cfg.tokenized_dir)
    assert src.meta["counts"]["shards"] > 3
    lengths = ds.seq_column("length")
    first_categories = np.array([src.row_tokens(i)["category_ids"][0] for i in range(len(src))])
    categories = first_categories[ds.seq_column("record_index")]
    assert stats["sequence_length"] == numpy_summary(lengths)
    assert stats["row_tokens"] == numpy_summary(ds.row_n_tokens)
    assert stats["sequences_per_row"] == numpy_summary(ds.row_n_seqs)
    for cid, entry in stats["categories"].items():
        assert entry["sequence_length"] == numpy_summary(lengths[categories == int(cid)])
    assert stats["rows"] == len(ds) and stats["tokens"] == int(lengths.sum())


def test_sequence_tally_adds_up_over_any_split_and_sees_one_change():
    rng = np.random.default_rng(2)
    index, length, uids = rng.permutation(500), rng.integers(1, 100, 500), rng.integers(0, 10**9, 700)
    whole = SequenceTally.of(index, length, uids)
    parts = SequenceTally()
    for (a, b), part_uids in zip(((0, 123), (123, 124), (124, 500)), np.split(uids, [200, 201])):
        parts += SequenceTally.of(index[a:b], length[a:b], part_uids)
    assert parts == whole
    changed_length = length.copy()
    changed_length[7] += 1
    repeated = index.copy()
    repeated[3] = repeated[4]
    changed = [SequenceTally.of(index, changed_length, uids), SequenceTally.of(repeated, length, uids),
               SequenceTally.of(index, length, np.append(uids[1:], uids[0] + 1))]
    assert changed[0].records_hash == whole.records_hash and changed[0].lengths_hash != whole.lengths_hash
    assert changed[1].records_hash != whole.records_hash
    assert changed[2].uids == whole.uids and changed[2].uids_hash != whole.uids_hash


def test_overlong_rows_over_several_partitions_are_counted_and_the_first_named(tmp_path, monkeypatch):
    monkeypatch.setattr(pack, "PARTITION_SEQUENCES", 16)
    lengths = [len(seq["input_ids"]) for seq, _ in write_tokenized(tmp_path / "tokenized", n=200, max_length=256)]
    over = [i for i, n in enumerate(lengths) if n > 100]
    assert len(over) > 2 and over[0] < 16 < over[-1]
    with pytest.raises(ValueError, match=rf"row {over[0]} has {lengths[over[0]]} tokens > pack.max_length=100 "
                                         rf"\({len(over)} such rows\)"):
        pack.run(config(tmp_path, max_length=100))


def test_a_tokenized_row_of_two_sequences_is_refused_naming_it(tmp_path):
    rng = np.random.default_rng(3)
    writer = ShardWriter(tmp_path / "tokenized", kind="tokenized", max_shard_bytes=2000)
    for i in range(30):
        seqs = [make_sequence(rng, 20) for _ in range(2 if i == 17 else 1)]
        writer.add_row(seqs, record_indices=list(range(len(seqs))), uids=[[i]] * len(seqs))
    writer.close({"categories": {}})
    with pytest.raises(ValueError, match="row 17 holds 2 sequences; a tokenized dataset holds one sequence per row"):
        pack.run(config(tmp_path))


@pytest.mark.parametrize("max_shard_bytes", [300, 1 << 20])
def test_row_range_readers_are_slices_of_the_whole_columns(tmp_path, max_shard_bytes):
    rng = np.random.default_rng(4)
    rows = [[make_sequence(rng, int(rng.integers(5, 60)), category=1 + r % 3) for _ in range(int(rng.integers(1, 4)))]
            for r in range(40)]
    write_rows(tmp_path / "ds", rows, max_shard_bytes=max_shard_bytes)
    ds = PackedDataset(tmp_path / "ds")
    assert (ds.meta["counts"]["shards"] > 5) == (max_shard_bytes == 300)
    assert ds.shard_row_ranges()[0][0] == 0 and ds.shard_row_ranges()[-1][1] == len(ds)
    seq_of_row = np.concatenate([[0], np.cumsum(ds.row_n_seqs)])
    uid_of_seq = np.concatenate([[0], np.cumsum(ds.seq_column("n_uids"))])
    for start, end in ((0, 40), (3, 17), (16, 16), (39, 40), (25, 99)):
        np.testing.assert_array_equal(ds.row_column("n_tokens", start, end), ds.row_n_tokens[start:end])
        seqs, uids = ds.row_range_sequences(start, end)
        a, b = seq_of_row[min(start, 40)], seq_of_row[min(end, 40)]
        np.testing.assert_array_equal(seqs, ds.seq_index[a:b])
        np.testing.assert_array_equal(uids, ds.all_uids[uid_of_seq[a]:uid_of_seq[b]])
