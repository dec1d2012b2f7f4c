"""tokenized/ -> pack.run -> packed/: the same sequences (tokens, labels, categories, turns, uids), full rows,
a consistent report, byte-identical output for a seed."""
import math
from collections import Counter

import numpy as np
import orjson
import pytest

from data.config import DataConfig, MergeConfig, PackConfig
from data.pack import run
from data.shards.dataset import IGNORE_INDEX, PackedDataset, ShardWriter
from tests.shards.test_format import make_sequence

CATEGORIES = {0: "untracked", 1: "math", 2: "code", 3: "chat"}


def write_tokenized(out_dir, n=300, max_length=256, seed=0, structure=False):
    """A synthetic tokenized dataset: n sequences of assorted lengths, one per row, uids 10*i (+ merged pairs)."""
    rng = np.random.default_rng(seed)
    fields = ["input_ids", "labels", "category_ids", "turn_ids"] + (["block_ids", "path_ids"] if structure else [])
    w = ShardWriter(out_dir, token_fields=fields, max_shard_bytes=20_000, kind="tokenized")
    seqs = []
    for i in range(n):
        length = int(min(max_length, max(1, rng.lognormal(np.log(max_length / 8), 1.0))))
        seq = make_sequence(rng, length, n_turns=int(rng.integers(0, 3)), category=int(rng.integers(0, 4)),
                            structure=structure)
        uids = [10 * i] if i % 7 else [10 * i, 10 * i + 1]
        w.add_row([seq], record_indices=[i], uids=[uids])
        seqs.append((seq, uids))
    w.close({"tokenizer_path": "/tok", "tokenizer_hash": "abc", "max_length": max_length,
             "categories": CATEGORIES})
    return seqs


def config(tmp_path, **pack):
    return DataConfig(inputs=[], output_dir=str(tmp_path), tokenizer_path="/tok", max_length=256, seed=11,
                      num_workers=1, merge=MergeConfig(), pack=PackConfig(shard_size_mb=1, **pack))


def seq_key(fields):
    return tuple(tuple(np.asarray(fields[k]).tolist()) for k in sorted(fields))


@pytest.mark.parametrize("algorithm", ["exact_fill", "best_fit", "first_fit"])
def test_round_trip(tmp_path, capsys, algorithm):
    seqs = write_tokenized(tmp_path / "tokenized")
    cfg = config(tmp_path, algorithm=algorithm)
    section = run(cfg)
    out = capsys.readouterr().out
    assert "rows / lower bound" in out and "math" in out

    ds = PackedDataset(cfg.packed_dir, verify=True)
    assert ds.kind == "packed"
    assert ds.meta["max_length"] == 256 and ds.meta["tokenizer_hash"] == "abc"
    assert ds.categories == CATEGORIES
    got = Counter()
    got_uids = []
    trace_uids, trace_rows = ds.uid_rows()
    trace = {}
    for u, r in zip(trace_uids.tolist(), trace_rows.tolist()):
        trace.setdefault(u, []).append(r)
    for i in range(len(ds)):
        row = ds[i]
        assert row["seq_lens"].sum() == len(row["input_ids"]) == ds.row_n_tokens[i] <= 256
        bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        uids = ds.row_uids(i)
        for k, rec in enumerate(row["record_index"]):
            piece = {f: row[f][bounds[k]:bounds[k + 1]] for f in ("input_ids", "labels", "category_ids", "turn_ids")}
            src_seq, src_uids = seqs[rec]
            assert seq_key(piece) == seq_key(src_seq)  # record_index points at the right tokenized row
            assert uids[k].tolist() == src_uids
            assert all(trace[u] == [i] for u in src_uids)  # the uid -> row trace
            got[seq_key(piece)] += 1
            got_uids.extend(uids[k].tolist())
        assert ds.row_n_loss_tokens[i] == int((row["labels"] != IGNORE_INDEX).sum())
    assert got == Counter(seq_key(s) for s, _ in seqs)  # the same multiset of sequences
    assert sorted(got_uids) == sorted(u for _, us in seqs for u in us)

    stats = orjson.loads((cfg.packed_dir / "stats.json").read_bytes())
    total = sum(len(s["input_ids"]) for s, _ in seqs)
    assert stats["tokens"] == total and stats["sequences"] == len(seqs) == section["out"] == section["in"]
    assert stats["lower_bound_rows"] == math.ceil(total / 256)
    assert stats["rows"] == len(ds) == section["rows"]
    assert stats["padding_tokens"] == len(ds) * 256 - total
    assert stats["rows_over_lower_bound"] <= 1.05
    n_seqs = np.asarray(ds.row_n_seqs)
    assert stats["sequences_per_row"]["min"] == n_seqs.min() and stats["sequences_per_row"]["max"] == n_seqs.max()
    assert stats["sequences_per_row"]["mean"] == pytest.approx(len(seqs) / len(ds))
    assert stats["fill"] == pytest.approx(total / (len(ds) * 256))
    loss_by_cat = Counter()
    tok_by_cat = Counter()
    for s, _ in seqs:
        for c, lab in zip(s["category_ids"].tolist(), s["labels"].tolist()):
            tok_by_cat[c] += 1
            loss_by_cat[c] += lab != IGNORE_INDEX
    assert {int(c): v["tokens"] for c, v in stats["categories"].items()} == dict(tok_by_cat)
    assert {int(c): v["loss_tokens"] for c, v in stats["categories"].items()} == dict(loss_by_cat)
    assert stats["categories"]["1"]["name"] == "math"
    assert (cfg.packed_dir / "stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = orjson.loads(cfg.report_path.read_bytes())
    assert report["pack"]["trace"]["uids_in"] == report["pack"]["trace"]["uids_out"] == len(got_uids)


def test_byte_identical_for_a_seed(tmp_path):
    write_tokenized(tmp_path / "tokenized", n=120)
    cfg = config(tmp_path)
    run(cfg)
    first = {p.name: p.read_bytes() for p in cfg.packed_dir.iterdir()}
    run(cfg)
    second = {p.name: p.read_bytes() for p in cfg.packed_dir.iterdir()}
    assert first == second
    cfg.seed = 12
    run(cfg)
    assert (cfg.packed_dir / "shard_00000.tokens.bin").read_bytes() != first["shard_00000.tokens.bin"]


def test_structure_fields_survive(tmp_path):
    seqs = write_tokenized(tmp_path / "tokenized", n=40, structure=True)
    cfg = config(tmp_path)
    run(cfg)
    ds = PackedDataset(cfg.packed_dir)
    row = ds[0]
    start = 0
    for k, rec in enumerate(row["record_index"]):
        end = start + row["seq_lens"][k]
        np.testing.assert_array_equal(row["path_ids"][start:end], seqs[rec][0]["path_ids"])
        np.testing.assert_array_equal(row["block_ids"][start:end], seqs[rec][0]["block_ids"])
        start = end


def test_overlong_is_an_error(tmp_path):
    write_tokenized(tmp_path / "tokenized", n=50, max_length=256)
    cfg = config(tmp_path, max_length=64)
    with pytest.raises(ValueError, match=r"tokens > pack.max_length=64"):
        run(cfg)
    assert not cfg.packed_dir.exists()


def test_packed_input_is_rejected(tmp_path):
    write_tokenized(tmp_path / "tokenized", n=20)
    cfg = config(tmp_path)
    run(cfg)
    cfg.output_dir = str(tmp_path / "again")
    (tmp_path / "again").mkdir()
    (cfg.out / "tokenized").symlink_to(tmp_path / "packed")
    with pytest.raises(ValueError, match="expected a tokenized dataset"):
        run(cfg)


def test_empty_tokenized_dataset(tmp_path):
    ShardWriter(tmp_path / "tokenized", kind="tokenized").close({"categories": {}})
    section = run(config(tmp_path))
    assert (section["in"], section["out"], section["rows"]) == (0, 0, 0)
    assert len(PackedDataset(tmp_path / "packed")) == 0


@pytest.mark.parametrize("fault", ["row_written_twice", "row_left_out", "sequence_swapped"])
def test_accounting_catches_a_writer_that_loses_or_repeats_a_sequence(tmp_path, monkeypatch, fault):
    """pack.run checks what was written against the tokenized input: each row once, with its length and uids."""
    from data import pack

    write_tokenized(tmp_path / "tokenized")
    real = pack.write_rows

    def faulty_write(writer, src, rows):
        lengths = np.asarray(src.row_n_tokens)
        if fault == "row_written_twice":
            rows = pack.RowPlan(np.concatenate([rows.members, rows.row(0)]),
                                np.append(rows.starts, rows.starts[-1] + len(rows.row(0))))
        elif fault == "row_left_out":
            rows = rows.slice(1, len(rows))
        else:  # the first sequence written in place of another of a different length
            members = rows.members.copy()
            other = int(np.flatnonzero(lengths[members] != lengths[members[0]])[0])
            members[other] = members[0]
            rows = pack.RowPlan(members, rows.starts)
        return real(writer, src, rows)

    monkeypatch.setattr(pack, "write_rows", faulty_write)  # the shard writer's (num_workers=1: in this process)
    with pytest.raises(AssertionError, match="exactly once"):
        run(config(tmp_path))


def test_accounting_catches_a_wrong_length(tmp_path, monkeypatch):
    from data import pack

    write_tokenized(tmp_path / "tokenized")
    real = PackedDataset.row_range_sequences

    def shifted(self, start, end):
        seqs, uids = real(self, start, end)
        if self.kind == "packed":
            seqs = seqs.copy()
            seqs["length"][0] += 1
        return seqs, uids

    monkeypatch.setattr(PackedDataset, "row_range_sequences", shifted)
    with pytest.raises(AssertionError, match="length differs"):
        pack.run(config(tmp_path))
