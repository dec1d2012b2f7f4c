"""The indexed token dataset format: round trip, O(1) access across shards, and clear errors on bad files."""
import mmap
import os
import pickle

import numpy as np
import orjson
import pytest

from common.fsutil import tokenizer_hash
from data.shards.dataset import (
    FORMAT_VERSION,
    IGNORE_INDEX,
    PackedDataset,
    ShardFormatError,
    ShardWriter,
)
from tests.conftest import tokenizer_dir


def make_sequence(rng, n, n_turns=2, category=1, structure=False):
    """A synthetic tokenized sequence: untrained prompt tokens, then `n_turns` trained spans."""
    ids = rng.integers(0, 150_000, n, dtype=np.int64)
    turn_ids = np.zeros(n, dtype=np.int16)
    bounds = np.linspace(n // 3, n, n_turns + 1).astype(int)
    for k in range(n_turns):
        turn_ids[bounds[k] : bounds[k + 1]] = k + 1 if bounds[k + 1] > bounds[k] else 0
    labels = np.where(turn_ids > 0, ids, IGNORE_INDEX)
    seq = {
        "input_ids": ids,
        "labels": labels,
        "category_ids": np.full(n, category, dtype=np.int16),
        "turn_ids": turn_ids,
    }
    if structure:
        seq["block_ids"] = rng.integers(0, 5, n).astype(np.int16)
        seq["path_ids"] = rng.integers(0, 3, n).astype(np.int16)
    return seq


def write_rows(path, rows, **kwargs):
    """rows: list of lists of sequences; record_index = running sequence number; uids = [1000 + it]."""
    meta_extra = kwargs.pop("meta_extra", {"categories": {1: "math", 2: "code"}, "max_length": 4096})
    w = ShardWriter(path, **kwargs)
    k = 0
    for seqs in rows:
        w.add_row(seqs, record_indices=list(range(k, k + len(seqs))), uids=[[1000 + k + j] for j in range(len(seqs))])
        k += len(seqs)
    return w.close(meta_extra)


@pytest.fixture
def rows():
    rng = np.random.default_rng(0)
    out = []
    for r in range(23):
        out.append([make_sequence(rng, int(rng.integers(5, 60)), n_turns=int(rng.integers(0, 3)), category=1 + r % 2)
                    for _ in range(int(rng.integers(1, 4)))])
    return out


def test_round_trip_small_shards(tmp_path, rows):
    meta = write_rows(tmp_path / "ds", rows, max_shard_bytes=300)
    assert meta["counts"]["shards"] > 5  # tiny shards: rows cross many shard boundaries
    ds = PackedDataset(tmp_path / "ds", verify=True)
    assert len(ds) == len(rows) == meta["counts"]["rows"]
    assert ds.categories == {1: "math", 2: "code"}
    assert ds.meta["max_length"] == 4096
    k = 0
    # random order exercises the shard lookup from any position
    order = np.random.default_rng(1).permutation(len(rows))
    starts = np.cumsum([0] + [len(r) for r in rows])
    for i in order:
        seqs = rows[i]
        got = ds[int(i)]
        for name in ("input_ids", "labels", "category_ids", "turn_ids"):
            np.testing.assert_array_equal(got[name], np.concatenate([s[name] for s in seqs]))
        assert "block_ids" not in got
        np.testing.assert_array_equal(got["seq_lens"], [len(s["input_ids"]) for s in seqs])
        np.testing.assert_array_equal(got["record_index"], np.arange(starts[i], starts[i] + len(seqs)))
        assert [u.tolist() for u in ds.row_uids(int(i))] == [[1000 + starts[i] + j] for j in range(len(seqs))]
        n_loss = sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in seqs)
        n_turns = sum(len(set(s["turn_ids"].tolist()) - {0}) for s in seqs)
        n_samples = sum(int((s["labels"] != IGNORE_INDEX).any()) for s in seqs)
        assert ds.row_n_tokens[i] == got["seq_lens"].sum() == len(got["input_ids"])
        assert (ds.row_n_loss_tokens[i], ds.row_n_trained_turns[i], ds.row_n_samples[i]) == (n_loss, n_turns, n_samples)
        k += len(seqs)
    assert ds[-1]["input_ids"].tolist() == ds[len(ds) - 1]["input_ids"].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert meta["counts"]["sequences"] == k == len(ds.seq_index)
    assert meta["counts"]["loss_tokens"] == int(ds.row_n_loss_tokens.sum())
    # a pickled dataset (DataLoader worker) carries no token data and reopens the same files
    blob = pickle.dumps(ds)
    assert len(blob) < 1000
    np.testing.assert_array_equal(pickle.loads(blob)[5]["input_ids"], ds[5]["input_ids"])


def test_single_shard_row_arrays_are_memmapped(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    ds = PackedDataset(tmp_path / "ds")
    assert ds.meta["counts"]["shards"] == 1
    assert isinstance(root_buffer(ds.row_n_tokens), mmap.mmap)
    assert isinstance(root_buffer(ds.row_tokens(0)), mmap.mmap)
    # rows read (and their pages released) twice give the same data; views survive release()
    view = ds.row_tokens(3)
    before = view["input_ids"].copy()
    ds.release()
    np.testing.assert_array_equal(view["input_ids"], before)
    first = [ds[i]["input_ids"].copy() for i in range(len(ds))]
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i]["input_ids"], first[i])
        np.testing.assert_array_equal(ds[i]["input_ids"], np.concatenate([s["input_ids"] for s in rows[i]]))


def root_buffer(arr):
    while isinstance(arr, np.ndarray) and arr.base is not None:
        arr = arr.base
    return arr.obj if isinstance(arr, memoryview) else arr


def test_structure_fields_and_kind(tmp_path):
    rng = np.random.default_rng(3)
    rows = [[make_sequence(rng, 30, structure=True)] for _ in range(4)]
    meta = write_rows(tmp_path / "ds", rows, token_fields=["input_ids", "labels", "category_ids", "turn_ids",
                                                            "block_ids", "path_ids"], kind="tokenized")
    assert list(meta["token_fields"]) == ["input_ids", "labels", "category_ids", "turn_ids", "block_ids", "path_ids"]
    ds = PackedDataset(tmp_path / "ds")
    assert ds.kind == "tokenized"
    np.testing.assert_array_equal(ds[2]["path_ids"], rows[2][0]["path_ids"])
    np.testing.assert_array_equal(ds[2]["block_ids"], rows[2][0]["block_ids"])


def test_writer_rejects_bad_rows(tmp_path):
    rng = np.random.default_rng(0)
    w = ShardWriter(tmp_path / "ds")
    good = make_sequence(rng, 10)
    with pytest.raises(ValueError, match="at least one sequence"):
        w.add_row([])
    with pytest.raises(ValueError, match="missing token field"):
        w.add_row([{k: v for k, v in good.items() if k != "turn_ids"}])
    with pytest.raises(ValueError, match="labels has 9 tokens"):
        w.add_row([dict(good, labels=good["labels"][:9])])
    with pytest.raises(ValueError, match="category_ids value out of int16 range"):
        w.add_row([dict(good, category_ids=np.full(10, 40_000))])
    with pytest.raises(ValueError, match="empty sequence"):
        w.add_row([{k: v[:0] for k, v in good.items()}])
    with pytest.raises(ValueError, match="not in this dataset's token_fields"):
        w.add_row([dict(good, block_ids=np.zeros(10))])
    with pytest.raises(ValueError, match="reserved"):
        w.close({"counts": 1})
    assert not (tmp_path / "ds").exists()
    assert os.listdir(tmp_path) == []  # the temp dir is gone too


def test_writer_is_atomic(tmp_path, rows):
    write_rows(tmp_path / "ds", rows[:3])
    w = ShardWriter(tmp_path / "ds")
    w.add_row(rows[5])
    assert len(PackedDataset(tmp_path / "ds")) == 3  # nothing visible before close
    w.close({})
    assert len(PackedDataset(tmp_path / "ds")) == 1
    assert sorted(os.listdir(tmp_path)) == ["ds"]
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "other") as w2:
            w2.add_row(rows[0])
            raise RuntimeError("stage failed")
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_kill_between_the_two_renames_loses_no_output(tmp_path, rows, monkeypatch):
    write_rows(tmp_path / "ds", rows[:3])
    real_replace = os.replace

    def killed_after_first_rename(src, dst):
        real_replace(src, dst)
        if ".old-" in str(dst):
            raise KeyboardInterrupt("killed between the renames")

    w = ShardWriter(tmp_path / "ds")
    w.add_row(rows[5])
    monkeypatch.setattr(os, "replace", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        w.close({})
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (tmp_path / "ds").exists()
    with pytest.raises(ShardFormatError, match=r"ds: missing, but .*\.ds\.old-.* holds the previous output"):
        PackedDataset(tmp_path / "ds")
    with pytest.raises(RuntimeError):  # the next run puts the previous output back first, then fails
        with ShardWriter(tmp_path / "ds") as w2:
            raise RuntimeError("stage failed")
    assert len(PackedDataset(tmp_path / "ds")) == 3
    assert [p for p in os.listdir(tmp_path) if ".old-" in p] == []


def test_empty_dataset(tmp_path):
    meta = ShardWriter(tmp_path / "ds").close({})
    assert meta["counts"]["rows"] == 0
    ds = PackedDataset(tmp_path / "ds")
    assert len(ds) == 0 and ds.row_n_tokens.shape == (0,)


# ---------------------------------------------------------------------------------------------- bad files
def _meta(path):
    return orjson.loads((path / "meta.json").read_bytes())


def test_truncated_shard(tmp_path, rows):
    write_rows(tmp_path / "ds", rows, max_shard_bytes=300)
    f = tmp_path / "ds" / "shard_00002.tokens.bin"
    os.truncate(f, f.stat().st_size - 4)
    with pytest.raises(ShardFormatError, match=r"shard_00002\.tokens\.bin: size .* \(truncated"):
        PackedDataset(tmp_path / "ds")


def test_missing_shard(tmp_path, rows):
    write_rows(tmp_path / "ds", rows, max_shard_bytes=300)
    (tmp_path / "ds" / "shard_00001.seqs.npy").unlink()
    with pytest.raises(ShardFormatError, match=r"shard_00001\.seqs\.npy: shard file missing"):
        PackedDataset(tmp_path / "ds")


def test_corrupt_token_shard_needs_verify(tmp_path, rows):
    write_rows(tmp_path / "ds", rows, max_shard_bytes=300)
    f = tmp_path / "ds" / "shard_00003.tokens.bin"
    data = bytearray(f.read_bytes())
    data[5] ^= 0xFF  # same size, different bytes
    f.write_bytes(bytes(data))
    PackedDataset(tmp_path / "ds")  # sizes match: the cheap open does not read token data (rows are checked on read)
    with pytest.raises(ShardFormatError, match=r"shard_00003\.tokens\.bin: checksum mismatch"):
        PackedDataset(tmp_path / "ds", verify=True)


def test_corrupt_index_checked_at_open(tmp_path, rows):
    write_rows(tmp_path / "ds", rows, max_shard_bytes=300)
    f = tmp_path / "ds" / "shard_00000.rows.npy"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match=r"shard_00000\.rows\.npy: checksum mismatch"):
        PackedDataset(tmp_path / "ds")


def test_checksum_mismatch_in_manifest(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    meta = _meta(tmp_path / "ds")
    meta["shards"][0]["files"]["tokens"]["blake2b"] = "0" * 64
    (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps(meta))
    with pytest.raises(ShardFormatError, match="checksum mismatch"):
        PackedDataset(tmp_path / "ds", verify=True)


def test_version_mismatch(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    meta = _meta(tmp_path / "ds")
    meta["format_version"] = FORMAT_VERSION + 1
    (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps(meta))
    with pytest.raises(ShardFormatError, match=f"format_version {FORMAT_VERSION + 1} is not supported"):
        PackedDataset(tmp_path / "ds")


def test_older_format_version_says_what_to_do(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    meta = _meta(tmp_path / "ds")
    meta["format_version"] = 1
    (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps(meta))
    with pytest.raises(ShardFormatError, match=r"format_version 1 was written by an older PackSFT .* per-row "
                       r"checksums.*--stages tokenize,pack"):
        PackedDataset(tmp_path / "ds")


def test_unknown_row_checksum_algorithm(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    meta = _meta(tmp_path / "ds")
    assert meta["row_checksum"] == "crc32"
    meta["row_checksum"] = "xxh3"
    (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps(meta))
    with pytest.raises(ShardFormatError, match="row_checksum 'xxh3' is not supported"):
        PackedDataset(tmp_path / "ds")


def _flip_token_field(path, row, field, token=1):
    """Flip one bit of `field` of token `token` of row `row` in place (one-shard dataset)."""
    ds = PackedDataset(path, verify="off")
    assert row < len(ds._rows[0])
    rec = ds._rows[0][row]
    byte = (int(rec["token_offset"]) + token) * ds.dtype.itemsize + ds.dtype.fields[field][1]
    f = path / "shard_00000.tokens.bin"
    data = bytearray(f.read_bytes())
    data[byte] ^= 0x01
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("field", ["input_ids", "labels", "turn_ids"])
def test_one_flipped_byte_stops_the_read_of_its_row(tmp_path, rows, field):
    write_rows(tmp_path / "ds", rows)
    _flip_token_field(tmp_path / "ds", 2, field)
    ds = PackedDataset(tmp_path / "ds")  # default verify="rows": the open stays cheap
    ds[0], ds[1], ds[3]  # the other rows read fine
    expected = (r"shard_00000\.tokens\.bin: row 2 \(row 2 of the shard\) is corrupt: crc32 of its \d+ token records "
                r"is 0x[0-9a-f]{8}, the index says 0x[0-9a-f]{8}; .*re-create .* --stages pack")
    for read in (lambda: ds[2], lambda: ds.gather([0, 2]), lambda: ds.row_tokens(2)):
        with pytest.raises(ShardFormatError, match=expected):
            read()
    copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets
    with pytest.raises(ShardFormatError, match=expected):
        copy[2]
    unchecked = PackedDataset(tmp_path / "ds", verify="off")
    assert unchecked[2]["input_ids"].shape[0] == ds.row_n_tokens[2]
    with pytest.raises(ShardFormatError, match="checksum mismatch"):
        PackedDataset(tmp_path / "ds", verify="full")


def test_corrupt_row_stops_a_dataloader_worker(tmp_path, rows):
    torch = pytest.importorskip("torch")
    write_rows(tmp_path / "ds", rows)
    _flip_token_field(tmp_path / "ds", 4, "labels")
    loader = torch.utils.data.DataLoader(PackedDataset(tmp_path / "ds"), batch_size=None, num_workers=1,
                                         collate_fn=lambda row: row)
    with pytest.raises(ShardFormatError, match=r"row 4 \(row 4 of the shard\) is corrupt"):
        for _ in loader:
            pass


def test_tokenized_corruption_names_tokenize_and_pack(tmp_path, rows):
    write_rows(tmp_path / "ds", [r[:1] for r in rows], kind="tokenized")
    _flip_token_field(tmp_path / "ds", 0, "input_ids", token=0)
    with pytest.raises(ShardFormatError, match="--stages tokenize,pack"):
        PackedDataset(tmp_path / "ds")[0]


def test_verify_mode_is_checked(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    with pytest.raises(ValueError, match=r"verify must be one of \('full', 'rows', 'off'\), got 'yes'"):
        PackedDataset(tmp_path / "ds", verify="yes")


def test_manifest_does_not_parse(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    (tmp_path / "ds" / "meta.json").write_bytes(b'{"format": "packsft-indexed", ')
    with pytest.raises(ShardFormatError, match=r"meta\.json: manifest does not parse"):
        PackedDataset(tmp_path / "ds")
    with pytest.raises(ShardFormatError, match=r"meta\.json: missing"):
        PackedDataset(tmp_path / "nothing_here")


def test_tokenizer_hash(tmp_path):
    qwen = tokenizer_hash(tokenizer_dir("qwen2_5_instruct"))
    assert qwen == tokenizer_hash(tokenizer_dir("qwen2_5_instruct"))
    assert qwen != tokenizer_hash(tokenizer_dir("qwen3"))
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer_hash(tmp_path)


def test_counts_per_category_and_rejected_row_leaves_no_trace(tmp_path):
    rng = np.random.default_rng(5)
    a, b = make_sequence(rng, 20, category=3), make_sequence(rng, 9, category=0)
    w = ShardWriter(tmp_path / "ds")
    w.add_row([a, b])
    bad = dict(make_sequence(rng, 7), turn_ids=np.full(7, -1))
    with pytest.raises(ValueError, match="row 1 sequence 1: negative turn_ids"):
        w.add_row([make_sequence(rng, 5), bad], uids=[[1], [2]])
    meta = w.close({})
    assert meta["counts"]["rows"] == 1 and meta["counts"]["sequences"] == 2 and meta["counts"]["uids"] == 0
    loss = {c: int(((s["labels"] != IGNORE_INDEX) & (s["category_ids"] == c)).sum()) for s, c in ((a, 3), (b, 0))}
    assert meta["counts"]["category_tokens"] == {"0": 9, "3": 20}
    assert meta["counts"]["category_loss_tokens"] == {"0": loss[0], "3": loss[3]}
    ds = PackedDataset(tmp_path / "ds", verify=True)
    assert ds[0]["record_index"].tolist() == [-1, -1]  # not given: unknown
    assert [u.tolist() for u in ds.row_uids(0)] == [[], []]
    assert len(ds.seq_index) == 2 and ds.all_uids.shape == (0,)


def test_structured_sequences_are_converted(tmp_path):
    """A structured array (e.g. a row slice of another dataset) with other integer widths is accepted."""
    rng = np.random.default_rng(2)
    seq = make_sequence(rng, 12)
    wide = np.zeros(12, dtype=[("turn_ids", "<i8"), ("input_ids", "<i8"), ("labels", "<i8"), ("category_ids", "<u1")])
    for name in wide.dtype.names:
        wide[name] = seq[name]
    w = ShardWriter(tmp_path / "ds")
    w.add_row([wide, seq])
    w.close({})
    row = PackedDataset(tmp_path / "ds")[0]
    for name in ("input_ids", "labels", "category_ids", "turn_ids"):
        np.testing.assert_array_equal(row[name], np.concatenate([seq[name], seq[name]]))
    w = ShardWriter(tmp_path / "ds2")
    with pytest.raises(ValueError, match="missing token field"):
        w.add_row([wide[["input_ids", "labels"]]])
    w.abort()


def test_malformed_manifest_entries(tmp_path, rows):
    write_rows(tmp_path / "ds", rows)
    meta = _meta(tmp_path / "ds")
    del meta["shards"][0]["files"]["seqs"]
    (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps(meta))
    with pytest.raises(ShardFormatError, match=r"shards\[0\] is malformed"):
        PackedDataset(tmp_path / "ds")
    meta = _meta(tmp_path / "ds")
    meta["token_fields"]["input_ids"] = "<i8"
    (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps(meta))
    with pytest.raises(ShardFormatError, match="token_fields"):
        PackedDataset(tmp_path / "ds")


def test_gather_concatenates_rows(tmp_path, rows):
    meta = write_rows(tmp_path / "ds", rows, max_shard_bytes=300)
    ds = PackedDataset(tmp_path / "ds")
    assert meta["max_token_id"] == max(int(s["input_ids"].max()) for r in rows for s in r)
    pick = [7, 0, 22, 7]  # across shards, repeated
    got = ds.gather(pick)
    for name in ("input_ids", "labels", "category_ids", "turn_ids"):
        np.testing.assert_array_equal(got[name], np.concatenate([ds[i][name] for i in pick]))
        assert got[name].dtype == ds[0][name].dtype
    np.testing.assert_array_equal(got["seq_lens"], np.concatenate([ds[i]["seq_lens"] for i in pick]))
    np.testing.assert_array_equal(got["record_index"], np.concatenate([ds[i]["record_index"] for i in pick]))
    empty = ds.gather([])
    assert empty["input_ids"].shape == (0,) and empty["input_ids"].dtype == np.int32


@pytest.mark.parametrize("max_shard_bytes", [300, 1 << 20])
def test_seq_column_is_that_field_of_the_index(tmp_path, rows, max_shard_bytes):
    write_rows(tmp_path / "ds", rows, max_shard_bytes=max_shard_bytes)
    ds = PackedDataset(tmp_path / "ds")
    index = ds.seq_index
    assert len(index) == sum(len(r) for r in rows)
    for name in index.dtype.names:
        column = ds.seq_column(name)
        assert column.dtype == np.int64 and column.ndim == 1
        np.testing.assert_array_equal(column, index[name])


def test_manifest_checksum_covers_every_key(tmp_path, rows):
    """meta.json records the checksum of its own content; any edit (a count, max_token_id) is refused, a reformat
    of the same content is not."""
    from data.shards.dataset import MANIFEST_CHECKSUM, manifest_checksum

    written = write_rows(tmp_path / "ds", rows)
    assert written[MANIFEST_CHECKSUM] == manifest_checksum(written) == _meta(tmp_path / "ds")[MANIFEST_CHECKSUM]
    (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps(written))  # other whitespace, same content
    assert len(PackedDataset(tmp_path / "ds")) == len(rows)
    for edit in ({"max_token_id": written["max_token_id"] - 1}, {"counts": {**written["counts"], "loss_tokens": 0}}):
        (tmp_path / "ds" / "meta.json").write_bytes(orjson.dumps({**written, **edit}))
        with pytest.raises(ShardFormatError, match=r"meta\.json: manifest checksum mismatch"):
            PackedDataset(tmp_path / "ds")
