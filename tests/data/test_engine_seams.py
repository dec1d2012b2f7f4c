"""What the Ray engine relies on, checked without Ray: shard cuts and shards written elsewhere give the bytes of
one writer, and the engine keys are validated and stay out of meta.json."""
import importlib.util

import numpy as np
import pytest

from common.config import ConfigError
from data.config import DataConfig, InputSpec, output_config
from data.shards.dataset import PackedDataset, ShardCutter, ShardWriter, shard_ranges
from tests.shards.test_format import make_sequence


def _rows(n_rows=31, seed=3):
    rng = np.random.default_rng(seed)
    return [[make_sequence(rng, int(rng.integers(5, 90)), n_turns=int(rng.integers(0, 3)), category=1 + r % 3)
             for _ in range(int(rng.integers(1, 4)))] for r in range(n_rows)]


def _add(writer, rows, first_record=0):
    k = first_record
    for seqs in rows:
        writer.add_row(seqs, record_indices=list(range(k, k + len(seqs))), uids=[[500 + k + j] for j in range(len(seqs))])
        k += len(seqs)
    return k


def _tree(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("max_shard_bytes", [1, 700, 2000, 1 << 30])
def test_shard_ranges_are_the_cuts_of_the_writer(tmp_path, max_shard_bytes):
    rows = _rows()
    writer = ShardWriter(tmp_path / "one", max_shard_bytes=max_shard_bytes)
    _add(writer, rows)
    meta = writer.close()
    itemsize = writer.dtype.itemsize
    nbytes = [sum(len(s["input_ids"]) for s in seqs) * itemsize for seqs in rows]
    ranges = shard_ranges(nbytes, max_shard_bytes)
    assert [end - start for start, end in ranges] == [s["rows"] for s in meta["shards"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(rows)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert shard_ranges([], max_shard_bytes) == []


@pytest.mark.parametrize("max_shard_bytes", [700, 3000])
def test_shards_written_as_parts_are_byte_identical_to_one_writer(tmp_path, max_shard_bytes):
    rows = _rows()
    extra = {"categories": {1: "a", 2: "b", 3: "c"}, "max_length": 4096}
    one = ShardWriter(tmp_path / "one", max_shard_bytes=max_shard_bytes)
    _add(one, rows)
    one.close(extra)

    nbytes = [sum(len(s["input_ids"]) for s in seqs) * one.dtype.itemsize for seqs in rows]
    ranges = shard_ranges(nbytes, max_shard_bytes)
    assert len(ranges) > 2
    assembled = ShardWriter(tmp_path / "assembled", max_shard_bytes=max_shard_bytes)
    record = 0
    for k, (start, end) in enumerate(ranges):  # each part as another process would write it
        part = ShardWriter(tmp_path / f"part_{k}", max_shard_bytes=max_shard_bytes)
        record = _add(part, rows[start:end], record)
        part.close()
        assembled.append_dataset(tmp_path / f"part_{k}")
        assert not (tmp_path / f"part_{k}").exists()
    assembled.close(extra)
    assert _tree(tmp_path / "assembled") == _tree(tmp_path / "one")


def test_shard_cutter_fed_in_batches_cuts_as_the_writer():
    """`ShardCutter` over rows given in batches (sizes, or a total with sizes asked only when needed) cuts where
    `add_row` does (a step a row), rows larger than a shard included."""
    def one_by_one(sizes, max_shard_bytes):
        cuts, size = [], 0
        for i, n in enumerate(sizes):
            if size > 0 and size + n > max_shard_bytes:
                cuts.append(i)
                size = 0
            size += n
        return cuts

    rng = np.random.default_rng(0)
    for _ in range(2000):
        sizes = rng.integers(1, 120, int(rng.integers(1, 40))).tolist()
        max_shard_bytes = int(rng.integers(1, 300))
        cutter, cuts, pos = ShardCutter(max_shard_bytes), [], 0
        while pos < len(sizes):
            batch = sizes[pos:pos + int(rng.integers(1, 8))]
            if rng.random() < 0.5:
                cuts += [pos + c for c in cutter.cut(batch)]
            else:
                cuts += [pos + c for c in cutter.cut_lazily(sum(batch), lambda: batch)]
            pos += len(batch)
        assert cuts == one_by_one(sizes, max_shard_bytes), (sizes, max_shard_bytes)


@pytest.mark.parametrize("max_shard_bytes", [1, 700, 3000, 1 << 30])
def test_add_rows_of_other_datasets_give_the_bytes_of_add_row(tmp_path, max_shard_bytes):
    """Rows copied in bulk (`add_rows`) from scratch datasets (not fsynced, of other shard sizes), in segments
    that start and end anywhere, give the bytes of one writer adding the rows one by one."""
    rows = _rows(40)
    extra = {"categories": {1: "a", 2: "b", 3: "c"}}
    one = ShardWriter(tmp_path / "one", max_shard_bytes=max_shard_bytes)
    _add(one, rows)
    one.close(extra)
    record, parts = 0, []
    for k, (start, end, part_shard_bytes) in enumerate([(0, 7, 1 << 30), (7, 8, 500), (8, 30, 900), (30, 40, 1)]):
        part = ShardWriter(tmp_path / f"part_{k}", max_shard_bytes=part_shard_bytes, durable=False)
        record = _add(part, rows[start:end], record)
        part.close()
        parts.append((PackedDataset(tmp_path / f"part_{k}", verify="off"), start))
    copied = ShardWriter(tmp_path / "copied", max_shard_bytes=max_shard_bytes)
    for lo, hi in [(0, 3), (3, 7), (7, 7), (7, 9), (9, 29), (29, 31), (31, 40)]:
        for part, first in parts:
            a, b = max(lo, first) - first, min(hi, first + len(part)) - first
            if a < b:
                copied.add_rows(part, a, b)
    copied.close(extra)
    assert _tree(tmp_path / "copied") == _tree(tmp_path / "one")


def test_append_dataset_refuses_other_token_fields(tmp_path):
    rng = np.random.default_rng(0)
    part = ShardWriter(tmp_path / "part", token_fields=["input_ids", "labels", "category_ids", "turn_ids",
                                                         "block_ids", "path_ids"])
    part.add_row([make_sequence(rng, 10, structure=True)])
    part.close()
    with ShardWriter(tmp_path / "out") as writer, pytest.raises(ValueError, match="token fields"):
        writer.append_dataset(tmp_path / "part")


def _config(tmp_path, **kw):
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    return DataConfig(inputs=[InputSpec(path=[str(src)])], output_dir=str(tmp_path / "out"),
                      tokenizer_path=str(tmp_path), stages=["preprocess"], **kw)


def test_engine_keys_are_validated(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="ray_address='auto' is only used with engine: ray"):
        _config(tmp_path, ray_address="auto").validate()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="requirements-ray.txt"):
        _config(tmp_path, engine="ray").validate()
    _config(tmp_path).validate()  # engine: local needs no Ray


def test_engine_keys_stay_out_of_the_output_config(tmp_path):
    local = output_config(_config(tmp_path))
    ray = output_config(_config(tmp_path, engine="ray", ray_address="auto", num_workers=7))
    assert local == ray
    assert not {"engine", "ray_address", "num_workers", "stages"} & set(local)


@pytest.mark.parametrize("target_bytes", [1, 7, 40, 1 << 20])
def test_jsonl_byte_ranges_read_the_lines_of_the_whole_file_reader(tmp_path, target_bytes):
    """Ranges cut on newlines, read apart and their line numbers shifted by the lines before them, give the rows,
    errors and `path:line` sources of `iter_rows` (BOM, blank and CRLF lines, malformed JSON, no final newline)."""
    from data.io import iter_jsonl_range, iter_rows, jsonl_byte_ranges
    from data.records import RecordError

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n{"a": 2}\r\n  \n{"a": \n[1]\n{"b": "x\\ny"}\n\n{"a": 3}')
    expected = [(src, row if isinstance(row, dict) else str(row)) for src, row in iter_rows(str(path))]
    got, lines_before, ranges = [], 0, list(jsonl_byte_ranges(str(path), 0, target_bytes))
    assert ranges[0][0] == 0 and ranges[-1][1] == path.stat().st_size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for start, end in ranges:
        n_lines, rows = iter_jsonl_range(str(path), start, end)
        for n, row in rows:
            source = f"{path}:{lines_before + n}"
            if isinstance(row, RecordError):
                assert row.source == f"{path}:+{n}"
                row = str(RecordError(source, row.field, row.message, row.reason))
            got.append((source, row))
        lines_before += n_lines
    assert got == expected
    assert len(expected) == 6 and lines_before == 9
    if target_bytes == 1:
        assert len(ranges) == 9  # one line per range
