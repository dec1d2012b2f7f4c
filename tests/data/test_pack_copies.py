"""Up-sampled copies of a record in the pack stage (data/pack.py): the planner puts the copies of a record in
different rows (copy layers), for one plan and by partitions, byte-identical for any worker count; stats.json and
report.json count duplicate rows and rows holding a record twice exactly, as an independent count over packed/
does."""
from __future__ import annotations

import orjson
import pytest

from data import pipeline
from data.report import read_report
from tests.conftest import ROOT


def _row_records(ds) -> list[list[tuple[int, ...]]]:
    """Each packed row's sequences, each as its tuple of source uids."""
    return [[tuple(u.tolist()) for u in ds.row_uids(i)] for i in range(len(ds))]


def _count_repeats(rows) -> tuple[int, int]:
    """(rows repeating another row's records in any order, all but one of each; rows holding a uid twice)."""
    from collections import Counter

    same = Counter(tuple(sorted(row)) for row in rows)
    twice = sum(1 for row in rows if len([u for seq in row for u in seq]) != len({u for seq in row for u in seq}))
    return sum(n - 1 for n in same.values()), twice


@pytest.mark.parametrize("probability", [0.0, 0.3])
def test_up_sampled_copies_never_share_a_row_and_repeated_rows_are_counted(tmp_path, monkeypatch, probability):
    """sample_rate 3: exact fill, picking by length, packed the copies of a record beside each other (a third of
    the rows held a record twice). Copies are now planned in different layers: no row holds a record twice, and
    stats.json counts duplicate rows and rows with a record twice as an independent count over packed/ does."""
    from data.config import load_config
    from data.shards.dataset import PackedDataset

    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    cfg = load_config("configs/data/example.json", [f"output_dir={out}", f"ratio_path={tmp_path / 'ratios.json'}",
                                                     "num_workers=1", f"merge.probability={probability}"])
    cfg.stages = ["preprocess"]
    pipeline.run_pipeline(cfg)
    ratios = orjson.loads((tmp_path / "ratios.json").read_bytes())
    for entry in ratios["categories"]:
        entry["sample_rate"] = 3
    (tmp_path / "ratios.json").write_bytes(orjson.dumps(ratios))
    cfg.stages = ["sample", "merge", "tokenize", "pack"]
    pipeline.run_pipeline(cfg)

    rows = _row_records(PackedDataset(out / "packed"))
    duplicates, twice = _count_repeats(rows)
    stats = orjson.loads((out / "packed" / "stats.json").read_bytes())
    section = read_report(out / "report.json")["pack"]
    assert twice == 0
    assert (stats["duplicate_rows"], stats["rows_with_a_record_twice"]) == (duplicates, twice)
    assert (section["duplicate_rows"], section["rows_with_a_record_twice"]) == (duplicates, twice)
    assert stats["rows"] <= stats["lower_bound_rows"] + 3  # a partly filled row per copy layer at most
    records = read_report(out / "report.json")["preprocess"]["out"]
    assert sorted(u for row in rows for seq in row for u in seq) == sorted(list(range(records)) * 3)  # all packed


def _tokenized(out_dir, sequences):
    """A tokenized dataset of (length, uids) sequences, one per row."""
    import numpy as np

    from data.shards.dataset import ShardWriter
    from tests.shards.test_format import make_sequence

    rng = np.random.default_rng(0)
    writer = ShardWriter(out_dir, max_shard_bytes=4_000, kind="tokenized")
    for i, (length, uids) in enumerate(sequences):
        writer.add_row([make_sequence(rng, length)], record_indices=[i], uids=[uids])
    writer.close({"tokenizer_path": "/tok", "tokenizer_hash": "abc", "max_length": 256,
                  "categories": {0: "untracked", 1: "math"}})


def test_duplicate_rows_and_rows_with_a_record_twice_are_counted_exactly(tmp_path, capsys):
    """Records that fill a row alone, three copies each, repeat their row (2 duplicates each); a merged sequence
    that holds one record twice is a row with a record twice; sequences without uids are never duplicates."""
    from data import pack
    from data.shards.dataset import PackedDataset
    from tests.data.test_pack_roundtrip import config

    _tokenized(tmp_path / "tokenized", [(200, [i]) for i in range(5)] * 3 + [(100, [7, 7]), (100, []), (100, [])])
    section = pack.run(config(tmp_path))
    stats = orjson.loads((tmp_path / "packed" / "stats.json").read_bytes())
    assert (stats["rows"], stats["duplicate_rows"], stats["rows_with_a_record_twice"]) == (17, 10, 1)
    assert (section["duplicate_rows"], section["rows_with_a_record_twice"]) == (10, 1)
    out = capsys.readouterr().out
    assert f"{'duplicate rows':<28}{10:>16,}" in out and f"{'rows with a record twice':<28}{1:>16,}" in out
    assert _count_repeats([r for r in _row_records(PackedDataset(tmp_path / "packed")) if any(r)]) == (10, 1)


@pytest.mark.parametrize("partition", [None, 128])
def test_the_planner_puts_the_copies_of_a_record_in_different_rows(partition):
    """Equal lengths (copies) are what exact fill puts together: without the records' uids the plan holds records
    twice; with them it never does, places every sequence once and stays at the lower bound but for a row or two
    per copy layer."""
    import numpy as np

    from data import pack

    rng = np.random.default_rng(5)
    records = rng.integers(20, 400, 300)
    order = rng.permutation(900)  # sampled.jsonl's shuffled order of 3 copies of each record
    uids = np.tile(np.arange(300), 3)[order]
    lengths = records[uids]
    blind = pack.plan_by_partitions(lengths, 1024, seed=1, partition=partition).tolist()
    assert _count_repeats([[(int(uids[j]),) for j in row] for row in blind])[1] > 0
    rows = pack.plan_by_partitions(lengths, 1024, seed=1, partition=partition, n_uids=np.ones(900, np.int64),
                                   uids=uids).tolist()
    assert sorted(j for row in rows for j in row) == list(range(900))
    assert all(lengths[row].sum() <= 1024 for row in rows)
    assert _count_repeats([[(int(uids[j]),) for j in row] for row in rows])[1] == 0
    assert len(rows) <= -(-int(lengths.sum()) // 1024) + 3 * (1 if partition is None else 2)
    assert rows == pack.plan_by_partitions(lengths, 1024, seed=1, partition=partition, n_uids=np.ones(900, np.int64),
                                           uids=uids).tolist()


def test_copy_layers_separate_every_pair_of_sequences_that_share_a_record():
    import numpy as np

    from data.pack import copy_layers

    sequences = [[5], [5], [5, 6], [7], [6, 7, 8], [], [7, 5], [9], [9, 9], [6], [5]]
    n_uids = np.array([len(seq) for seq in sequences])
    uids = np.array([u for seq in sequences for u in seq])
    layers = copy_layers(n_uids, uids)
    starts = np.cumsum(n_uids) - n_uids
    sets = [set(uids[a:a + n].tolist()) for a, n in zip(starts, n_uids)]
    for i in range(len(sets)):
        for j in range(i):
            if sets[i] & sets[j]:
                assert layers[i] != layers[j], (i, j)
    assert copy_layers(np.array([1, 1, 2]), np.array([1, 2, 3, 4])).tolist() == [0, 0, 0]  # no copies: one layer


def test_packed_copies_are_byte_identical_for_any_worker_count(tmp_path, monkeypatch):
    import numpy as np

    from data import pack
    from tests.data.test_pack_roundtrip import config

    monkeypatch.setattr(pack, "PARTITION_SEQUENCES", 16)  # several partitions and a global pass
    rng = np.random.default_rng(2)
    records = [(int(n), [i]) for i, n in enumerate(rng.integers(10, 120, 40))]
    merged = [(int(rng.integers(30, 200)), rng.choice(40, 2, replace=False).tolist()) for _ in range(10)]
    sequences = [records[i] for i in rng.permutation(np.tile(np.arange(40), 3))] + merged
    _tokenized(tmp_path / "tokenized", sequences)
    outputs = []
    for workers in (1, 2):
        cfg = config(tmp_path)
        cfg.num_workers = workers
        pack.run(cfg)
        outputs.append({p.name: p.read_bytes() for p in cfg.packed_dir.iterdir()})
    assert outputs[0] == outputs[1]
    from data.shards.dataset import PackedDataset

    assert _count_repeats(_row_records(PackedDataset(tmp_path / "packed")))[1] == 0
