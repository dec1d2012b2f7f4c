"""Readers for every input format, atomic writers, file hashing, the JSONL byte index and the ordered parallel map."""
import csv
import hashlib
import os
import subprocess
import sys

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import fsutil
from common.fsutil import atomic_write_bytes, atomic_writer, file_blake2b
from data import pipeline
from data.io import append_file, copy_into, expand_inputs, iter_rows, ordered_parallel_map, read_rows
from data.records import RecordError
from data.report import read_report
from data.shards.dataset import ShardWriter
from tests._data_helpers import CHAT_QA, data_config_file, minimal_config_file, write_jsonl
from tests._jsonl_index import JsonlIndex

ROWS = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)]


def _rows(path):
    return list(iter_rows(str(path)))


def test_jsonl_sources_are_one_based_lines_and_blank_lines_are_not_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n')
    assert _rows(path) == [(f"{path}:1", {"a": 1}), (f"{path}:3", {"a": 2})]


def test_jsonl_malformed_line_raises_or_is_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": \n[1, 2]\n{"a": 4}\n')
    with pytest.raises(RecordError) as err:
        list(read_rows(str(path)))
    assert str(err.value).startswith(f"{path}:2: line: malformed JSON")
    assert err.value.reason == "malformed_json"
    dropped = {}
    rows = list(read_rows(str(path), on_error="skip", dropped=dropped))
    assert [r for _, r in rows] == [{"a": 1}, {"a": 4}]
    assert dropped == {"malformed_json": 2}  # line 2 (bad JSON) and line 3 (not an object)


def test_json_array_and_object_of_arrays(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_bytes(orjson.dumps(ROWS))
    assert _rows(arr) == [(f"{arr}:{i}", r) for i, r in enumerate(ROWS)]
    obj = tmp_path / "o.json"
    obj.write_bytes(orjson.dumps({"train": ROWS[:2], "extra": ROWS[2:3]}))
    assert [s for s, _ in _rows(obj)] == [f"{obj}:train[0]", f"{obj}:train[1]", f"{obj}:extra[0]"]
    bad = tmp_path / "b.json"
    bad.write_bytes(b'{"a": 1')
    with pytest.raises(RecordError, match="malformed JSON"):
        _rows(bad)


def test_csv_rows_with_file_line_numbers(tmp_path):
    path = tmp_path / "d.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["question", "answer"])
        w.writeheader()
        w.writerows(ROWS[:2])
    assert _rows(path) == [(f"{path}:2", ROWS[0]), (f"{path}:3", ROWS[1])]


def test_parquet_streams_in_batches(tmp_path, monkeypatch):
    import data.io

    monkeypatch.setattr(data.io, "BATCH_ROWS", 2)  # several batches, row index continues across them
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=2)
    assert _rows(path) == [(f"{path}:{i}", r) for i, r in enumerate(ROWS)]


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_arrow_ipc_file_and_stream(tmp_path, kind):
    table = pa.Table.from_pylist(ROWS)
    path = tmp_path / "d.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
        with new(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
    assert _rows(path) == [(f"{path}:{i}", r) for i, r in enumerate(ROWS)]


def test_datasets_dir_with_and_without_split(tmp_path):
    import datasets

    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    assert [r for _, r in _rows(single)] == ROWS
    multi = tmp_path / "multi"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                          "test": datasets.Dataset.from_list(ROWS[3:])}).save_to_disk(str(multi))
    rows = list(iter_rows(f"test@{multi}"))
    assert rows == [(f"test@{multi}:0", ROWS[3]), (f"test@{multi}:1", ROWS[4])]
    with pytest.raises(ValueError, match="DatasetDict with splits"):
        list(iter_rows(str(multi)))
    with pytest.raises(ValueError, match="no split 'dev'"):
        list(iter_rows(f"dev@{multi}"))
    assert expand_inputs([f"train@{multi}"]) == [f"train@{multi}"]


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="unsupported input type"):
        _rows(path)


def test_expand_inputs_sorts_each_glob_and_keeps_list_order(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.json"):
        (tmp_path / name).write_text("")
    got = expand_inputs([str(tmp_path / "c.json"), str(tmp_path / "*.jsonl")])
    assert got == [str(tmp_path / n) for n in ("c.json", "a.jsonl", "b.jsonl")]
    with pytest.raises(FileNotFoundError, match="no file matches"):
        expand_inputs(str(tmp_path / "none*.jsonl"))


def test_atomic_writer_keeps_old_content_on_error_and_leaves_no_temp(tmp_path):
    path = tmp_path / "out.jsonl"
    atomic_write_bytes(path, b"old\n")
    with pytest.raises(RuntimeError):
        with atomic_writer(path) as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert path.read_bytes() == b"old\n"
    assert os.listdir(tmp_path) == ["out.jsonl"]
    with atomic_writer(path) as f:
        f.write(b"new\n")
    assert path.read_bytes() == b"new\n"


def test_jsonl_index_seeks_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ROWS))
    seen = []
    with JsonlIndex.build(path, lambda i, line: seen.append(i)) as index:
        assert len(index) == len(ROWS) and seen == list(range(len(ROWS)))
        assert index.get(3) == ROWS[3] and index.get(0) == ROWS[0]
        assert index.read(4) == orjson.dumps(ROWS[4])
        assert int(index.offsets[-1]) == path.stat().st_size


def _square_chunk(task):
    return [x * x for x in task]


def test_ordered_parallel_map_keeps_order_for_any_worker_count():
    tasks = [list(range(i, i + 3)) for i in range(0, 30, 3)]
    expected = [_square_chunk(t) for t in tasks]
    assert list(ordered_parallel_map(_square_chunk, iter(tasks), 1)) == expected
    assert list(ordered_parallel_map(_square_chunk, iter(tasks), 2)) == expected


def test_csv_multiline_field_and_ragged_row(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('question,answer\n"two\nlines",a0\nq1\nq2,a2\n')
    rows = _rows(path)
    assert rows[0] == (f"{path}:2", {"question": "two\nlines", "answer": "a0"})
    assert isinstance(rows[1][1], RecordError) and str(rows[1][1]) == f"{path}:4: row: 1 fields for 2 columns"
    assert rows[2] == (f"{path}:5", {"question": "q2", "answer": "a2"})


def test_csv_invalid_utf8_is_a_record_error_naming_the_line(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b'question,answer\nq0,a0\nq1,\xff\xfe\n"multi\nli\xffne",a2\nq3,a3\n')
    rows = _rows(path)
    assert rows[0] == (f"{path}:2", {"question": "q0", "answer": "a0"})
    assert isinstance(rows[1][1], RecordError) and rows[1][1].reason == "malformed_csv"
    assert str(rows[1][1]).startswith(f"{path}:3: row: invalid UTF-8 on line 3")
    assert isinstance(rows[2][1], RecordError) and str(rows[2][1]).startswith(f"{path}:4: row: invalid UTF-8 on line 5")
    assert rows[3] == (f"{path}:6", {"question": "q3", "answer": "a3"})
    dropped = {}
    assert [src for src, _ in read_rows(str(path), "skip", dropped)] == [f"{path}:2", f"{path}:6"]
    assert dropped == {"malformed_csv": 2}
    path.write_bytes(b"quest\xffion,answer\nq,a\n")
    with pytest.raises(RecordError, match=r":1: header: invalid UTF-8"):
        _rows(path)


def test_atomic_writer_gives_the_umask_mode_not_0600(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "a.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640


def test_columnar_json_is_rejected_with_a_clear_message(tmp_path):
    path = tmp_path / "cols.json"
    path.write_bytes(orjson.dumps({"question": ["q0", "q1"], "answer": ["a0", "a1"]}))
    with pytest.raises(RecordError, match="column-oriented JSON is not supported"):
        _rows(path)


def test_utf8_bom_is_ignored(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "d.jsonl").write_bytes(bom + b'{"a": 1}\n')
    (tmp_path / "d.json").write_bytes(bom + b'[{"a": 1}]')
    (tmp_path / "d.csv").write_bytes(bom + b"a\n1\n")
    for name, value in (("d.jsonl", 1), ("d.json", 1), ("d.csv", "1")):
        assert [r for _, r in _rows(tmp_path / name)] == [{"a": value}]


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_append_file_adds_parts_between_buffered_writes(tmp_path, monkeypatch, kernel_copy):
    """Parts appended by the kernel (or through this process where `os.copy_file_range` fails) land after what
    was written before, in order, and writes through the buffered file after them follow them."""
    if not kernel_copy:
        def unsupported(*args):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", unsupported)
    parts = []
    for k, size in enumerate([0, 1, 5000, 3 << 20]):
        part = tmp_path / f"part{k}"
        part.write_bytes(os.urandom(size))
        parts.append(part)
    out_path = tmp_path / "out.bin"
    with atomic_writer(out_path) as out:
        out.write(b"head")
        for part in parts:
            end = out.tell() + part.stat().st_size
            append_file(out, part)
            assert out.tell() == end  # the file object knows where the kernel's copy ended
            out.write(b"|")
    assert out_path.read_bytes() == b"head" + b"".join(p.read_bytes() + b"|" for p in parts)


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_copy_into_writes_each_part_at_its_offset_in_any_order(tmp_path, monkeypatch, kernel_copy):
    """Parts copied into one file at their offsets, last first (past the end the file grows, the gap filled
    later), by the kernel or by pread/pwrite where `os.copy_file_range` fails: the file is their concatenation."""
    if not kernel_copy:
        def unsupported(*args):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", unsupported)
    parts, offsets, end = [], [], 0
    for k, size in enumerate([3 << 20, 0, 1, 5000, 7]):
        part = tmp_path / f"part{k}"
        part.write_bytes(os.urandom(size))
        parts.append(part)
        offsets.append(end)
        end += size
    out = tmp_path / "out.bin"
    out.write_bytes(b"")
    for part, offset in reversed(list(zip(parts, offsets))):
        copy_into(part, out, offset)
    assert out.read_bytes() == b"".join(p.read_bytes() for p in parts)


@pytest.mark.parametrize("size_in_chunks", [0, 0.5, 1, 2.5, 3])
def test_file_blake2b_is_the_hash_of_the_whole_file_across_read_buffers(tmp_path, monkeypatch, size_in_chunks):
    monkeypatch.setattr(fsutil, "HASH_CHUNK", 1024)
    payload = os.urandom(int(1024 * size_in_chunks) + (7 if size_in_chunks else 0))
    path = tmp_path / "blob"
    path.write_bytes(payload)
    assert file_blake2b(path) == hashlib.blake2b(payload, digest_size=32).hexdigest()
    assert file_blake2b(path, sync=True) == file_blake2b(path)


# ---------------------------------------------------------------------------------------------- lines too large for memory
@pytest.mark.parametrize("failure", ["orjson", "python"])
def test_a_record_too_large_for_memory_is_an_error_that_says_memory(tmp_path, monkeypatch, capsys, failure):
    """A valid record whose line does not fit in memory was reported (or under skip dropped) as malformed JSON.
    Simulated without allocating: the parser fails on one line as orjson does under a memory limit."""
    path = tmp_path / "big.jsonl"
    big = {**CHAT_QA, "messages": [{"role": "user", "content": "HUGE"}, CHAT_QA["messages"][1]]}
    write_jsonl(path, [CHAT_QA, big, CHAT_QA])
    real_loads = orjson.loads

    def loads(data):
        if b"HUGE" in bytes(data if not isinstance(data, str) else data.encode()):
            if failure == "orjson":
                raise orjson.JSONDecodeError("Not enough memory to allocate buffer for parsing", "", 0)
            raise MemoryError()
        return real_loads(data)

    monkeypatch.setattr(orjson, "loads", loads)
    config = data_config_file(tmp_path, [{"path": str(path), "format": "messages", "category_name": "chat"}],
                          on_error="skip")
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([config, "--stages", "preprocess"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    size = len(path.read_bytes().splitlines(True)[1])
    assert err.startswith(f"error: {path}:2: not enough memory to parse this line ({size} bytes")
    assert "malformed" not in err and "nothing was dropped" in err
    assert ("parses a document inside one buffer of about 12 times its size" if failure == "orjson" else
            "raise the memory limit") in err
    assert not (tmp_path / "out" / "canonical.jsonl").exists()
    assert "preprocess" not in read_report(tmp_path / "out" / "report.json")


def test_parse_jsonl_line_raises_memory_errors_and_returns_malformed_json():
    from data.io import LineMemoryError, parse_jsonl_line
    from data.records import RecordError

    assert isinstance(parse_jsonl_line(b'{"a": ', "f.jsonl:3"), RecordError)
    assert parse_jsonl_line(b'{"a": 1}\n', "f.jsonl:3") == {"a": 1}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(orjson, "loads", lambda data: (_ for _ in ()).throw(MemoryError()))
        with pytest.raises(LineMemoryError, match=r"^f\.jsonl:3: not enough memory to parse this line \(9 bytes"):
            parse_jsonl_line(b'{"a": 1}\n', "f.jsonl:3")


# ---------------------------------------------------------------------------------------------- unreadable inputs
@pytest.mark.parametrize("content", [b"", b"PAR1 this is not parquet"])
def test_empty_or_corrupt_parquet_names_the_file(tmp_path, capsys, content):
    bad = tmp_path / "train.parquet"
    bad.write_bytes(content)
    config = minimal_config_file(tmp_path, inputs=[{"path": str(bad)}], stages=["preprocess"])
    with pytest.raises(SystemExit):
        pipeline.main([str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {bad}: file: not a readable parquet file: ")
    assert not any("Traceback" in line for line in err)


# ---------------------------------------------------------------------------------------------- durable renames
def test_writes_are_fsynced_before_the_renames_that_publish_them(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    from common.fsutil import atomic_write_bytes

    for _ in range(2):  # the second time replaces an existing dataset
        with ShardWriter(tmp_path / "ds", max_shard_bytes=100) as w:
            for n in (30, 30, 30):
                w.add_row([{k: np.ones(n, np.int32) for k in ("input_ids", "labels", "category_ids", "turn_ids")}])
            w.close({}, extra_files={"stats.json": b"{}"})
    atomic_write_bytes(tmp_path / "report.json", b"{}")

    publish = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(tmp_path / "ds")]
    assert len(publish) == 2
    files = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert len(files) == 3 * 4 + 2
    start = 0
    for at in publish:
        tmp_dir = events[at][1]
        synced = [e[1] for e in events[start:at] if e[0] == "fsync"]
        assert sorted(os.path.basename(p) for p in synced if os.path.dirname(p) == tmp_dir) == files
        assert synced[-1] == tmp_dir  # the directory itself, after its files
        assert events[at + 1] == ("fsync", str(tmp_path))  # the parent, after the swap
        start = at
    rename = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(tmp_path / "report.json"))
    assert events[rename - 1] == ("fsync", events[rename][1]) and events[rename + 1] == ("fsync", str(tmp_path))


_UNDER_A_LIMIT = """
import resource, sys
from data import pipeline

used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
resource.setrlimit(resource.RLIMIT_AS, (used + (512 << 20),) * 2)  # 512 MiB more than the pipeline's own
pipeline.main(sys.argv[1:])
"""


def test_a_record_larger_than_the_json_parsers_buffer_says_so_and_what_to_do(tmp_path):
    """A valid record whose line orjson cannot parse: orjson asks for one buffer of ~12x the line before parsing,
    and a machine refuses a single allocation beyond its memory (a 2.2 GB line: 26 GB, refused at once on 23 GB,
    the process at 6.3 GB). Reproduced for real at a small scale: a 64 MiB line under an address-space limit 512 MiB
    above the pipeline's own, so its 768 MiB parse buffer is refused as the 26 GB one was. Before: `raise the memory
    limit`, as if the record itself did not fit."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(orjson.dumps({"question": "q", "answer": "a"}) + b"\n")
        f.write(b'{"question": "' + b"x" * (64 << 20) + b'", "answer": "a"}\n')
    config = tmp_path / "c.json"
    config.write_bytes(orjson.dumps({"inputs": [{"path": str(path)}], "output_dir": str(tmp_path / "out"),
                                     "tokenizer_path": "unused", "num_workers": 0}))
    proc = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT, str(config), "--stages", "preprocess"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    size = path.read_bytes().splitlines(True)[1].__len__()
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {path}:2: not enough memory to parse this line ({size:,} bytes): the JSON parser (orjson) parses a "
        f"document inside one buffer of about 12 times its size, {size * 12 / 2**30:,.1f} GiB here, and that "
        "allocation was refused (orjson: Not enough memory to allocate buffer for parsing): the system grants no "
        "single allocation larger than its memory (RAM and swap) or the limit of ulimit -v, the container or the "
        "job. The record may be valid, and nothing was dropped: make the record smaller (split it, or move embedded "
        f"data such as base64 images into files it names), or run where an allocation of {size * 12 / 2**30:,.1f} "
        "GiB succeeds (more memory, a higher limit, fewer num_workers)")


_STOPS_EARLY_WITH_SIGTERM_IGNORED = """
import signal, time
from data.io import ordered_parallel_map

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what the pool's workers inherit from such a parent
results = ordered_parallel_map(time.sleep, [0.0] + [1.0] * 8, workers=2)
print(next(results))
results.close()  # the pool's terminate while a worker sleeps: it must end though its parent ignores SIGTERM
print("closed", flush=True)
"""


def test_a_pool_stopped_early_ends_its_workers_whatever_the_parent_ignores():
    """`ordered_parallel_map` stopped before its end (an error, a full disk) terminates its pool with SIGTERM; a
    worker that inherited SIG_IGN for it (from a parent that ignored it) kept the pool's join waiting forever."""
    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", _STOPS_EARLY_WITH_SIGTERM_IGNORED], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "closed"], proc.stderr[-2000:]
