"""Streaming readers for raw inputs, a byte-offset index over JSONL files, and the ordered parallel map.

Readers yield `(source, row)` with source `"path:line"` (1-based line for .jsonl and .csv, 0-based row index
for .json arrays, .parquet, .arrow and datasets directories). Memory stays bounded by one batch of rows.
"""
from __future__ import annotations

import collections
import csv
import glob
import multiprocessing
import os
import signal
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from common.fsutil import stale_temporaries, undecided_temporaries
from data.config import DataConfig, split_spec
from data.records import RecordError

BATCH_ROWS = 1024
UTF8_BOM = b"\xef\xbb\xbf"  # some editors and Excel exports start files with it; orjson rejects it


# ---------------------------------------------------------------------------------------------- input paths
def expand_inputs(patterns: list[str] | str) -> list[str]:
    """Patterns (globs, `split@dir`) -> concrete inputs: list order kept, each glob's matches sorted."""
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for pattern in patterns:
        split, path = split_spec(pattern)
        matches = sorted(glob.glob(path))
        if not matches:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        out.extend(f"{split}@{m}" if split else m for m in matches)
    return out


def input_is_empty(path: str) -> bool:
    """Whether an input holds no row: a text file (.jsonl, .csv) that is empty or of blank lines only, a parquet
    file of no rows. Reads only up to the first non-blank byte (or the parquet footer); other formats, a datasets
    directory and an unreadable file (a 0-byte parquet file is corrupt, not empty) are left to their reader."""
    split, local = split_spec(path)
    if split is not None or os.path.isdir(local):
        return False
    suffix = Path(local).suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(local).metadata.num_rows == 0
        except (pa.ArrowException, OSError):
            return False
    if suffix in (".jsonl", ".csv"):
        with open(local, "rb") as f:
            while block := f.read(1 << 20):
                if block.removeprefix(UTF8_BOM).strip():
                    return False
        return True
    return False


def iter_rows(path: str) -> Iterator[tuple[str, Any]]:
    """Rows of one input as `(source, dict)`; an unparsable JSONL line yields `(source, RecordError)` instead,
    so the caller applies its error policy. `path` may be `split@dir` for a datasets directory."""
    split, local = split_spec(path)
    if os.path.isdir(local):
        yield from _iter_datasets_dir(local, split)
        return
    if split is not None:
        raise ValueError(f"{path}: a split (split@path) only applies to a datasets directory")
    suffix = Path(local).suffix.lower()
    readers: dict[str, Callable[[str], Iterator]] = {
        ".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet,
        ".csv": _iter_csv, ".arrow": _iter_arrow,
    }
    if suffix not in readers:
        raise ValueError(f"{local}: unsupported input type {suffix!r}; supported: {list(readers)} or a "
                         "datasets directory (save_to_disk)")
    yield from readers[suffix](local)


def read_rows(path: str, on_error: str = "error", dropped: dict | None = None,
              on_skip: Callable[[RecordError], None] | None = None) -> Iterator[tuple[str, dict]]:
    """`iter_rows` with the error policy applied: raise the RecordError, or count it in `dropped[reason]` and
    hand it to `on_skip`."""
    for source, row in iter_rows(path):
        if isinstance(row, RecordError):
            if on_error != "skip":
                raise row
            if dropped is not None:
                dropped[row.reason] = dropped.get(row.reason, 0) + 1
            if on_skip is not None:
                on_skip(row)
            continue
        yield source, row


def _iter_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1:
                line = line.removeprefix(UTF8_BOM)
            if line.strip():
                source = f"{path}:{lineno}"
                yield source, parse_jsonl_line(line, source)


class LineMemoryError(MemoryError):
    """A line (or a whole .json file) that the parser could not hold in memory: it may be valid, so it is neither
    reported as malformed nor dropped under `on_error: skip`; the run stops naming it (`source: detail`)."""

    def __init__(self, source: str, detail: str):
        super().__init__(source, detail)
        self.source, self.detail = source, detail

    def __str__(self) -> str:
        return f"{self.source}: {self.detail}"


# orjson parses a document inside one buffer it allocates first, of (len / 2) * 24 bytes (its yyjson pool allocator:
# orjson's deserialize/backend/yyjson.rs, `buffer_capacity_to_allocate`): about 12 times the document. A line of
# 2.2 GB asks for one allocation of 26 GB, which a machine with less RAM + swap refuses at once (no OOM).
ORJSON_PARSE_BUFFER = 12
ORJSON_NO_BUFFER = "Not enough memory to allocate buffer for parsing"


def _out_of_memory(exc: Exception) -> bool:
    """Whether a parse failure is the parser running out of memory (orjson says so in a JSONDecodeError)."""
    return isinstance(exc, MemoryError) or str(exc).startswith(ORJSON_NO_BUFFER)


def memory_error(source: str, what: str, size: int, exc: Exception) -> LineMemoryError:
    """The error for a `what` ("line", "file") of `size` bytes at `source` that `exc` says did not fit in memory:
    orjson's parse buffer refused (`ORJSON_PARSE_BUFFER`), or memory running out while parsing."""
    keep = "the record may be valid, and nothing was dropped"
    if str(exc).startswith(ORJSON_NO_BUFFER):
        need = size * ORJSON_PARSE_BUFFER
        return LineMemoryError(source, (
            f"not enough memory to parse this {what} ({size:,} bytes): the JSON parser (orjson) parses a document "
            f"inside one buffer of about {ORJSON_PARSE_BUFFER} times its size, {need / 2**30:,.1f} GiB here, and that "
            f"allocation was refused (orjson: {ORJSON_NO_BUFFER}): the system grants no single allocation larger than "
            f"its memory (RAM and swap) or the limit of ulimit -v, the container or the job. {keep[0].upper()}"
            f"{keep[1:]}: make the record smaller (split it, or move embedded data such as base64 images into files "
            f"it names), or run where an allocation of {need / 2**30:,.1f} GiB succeeds (more memory, a higher limit, "
            "fewer num_workers)"))
    cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return LineMemoryError(source, f"not enough memory to parse this {what} ({size:,} bytes; {cause}); {keep}: raise "
                           "the memory limit (ulimit -v, the container's or the job's), lower num_workers, or split "
                           "the record")


def parse_jsonl_line(line: bytes, source: str, require_object: bool = True) -> Any:
    """One non-blank input line: the row object, or the RecordError that rejects it (`malformed_json`).
    `require_object=False` returns any JSON value (the caller validates it) and rejects only malformed JSON.
    A line the parser cannot hold in memory raises `LineMemoryError`."""
    try:
        row = orjson.loads(line)
    except (orjson.JSONDecodeError, MemoryError) as exc:
        if _out_of_memory(exc):
            raise memory_error(source, "line", len(line), exc) from None
        return RecordError(source, "line", f"malformed JSON: {exc}", "malformed_json")
    if require_object and not isinstance(row, dict):
        return RecordError(source, "line", f"expected a JSON object, got {type(row).__name__}", "malformed_json")
    return row


def split_lines(data: bytes) -> list[bytes]:
    """`data` cut into lines as iterating a binary file cuts them: each ends at and keeps its b"\\n", but the last
    when `data` does not end in one (no empty line after a final newline)."""
    pieces = data.split(b"\n")
    last = pieces.pop()  # after the last newline: b"", or a final line without one
    lines = [piece + b"\n" for piece in pieces]
    if last:
        lines.append(last)
    return lines


def read_lines(path: str | os.PathLike, start: int, end: int) -> list[bytes]:
    """The lines (`split_lines`) of bytes `[start, end)` of a file."""
    with open(path, "rb") as f:
        f.seek(start)
        return split_lines(f.read(end - start))


def jsonl_byte_ranges(path: str, start: int, target_bytes: int) -> Iterator[tuple[int, int]]:
    """`[start, end)` byte ranges from `start` to the end of the file, each about `target_bytes` and ending
    just after a newline (or at the end of the file): ranges hold whole lines, so they can be read apart."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        while start < size:
            end = start + max(1, target_bytes)
            if end < size:
                f.seek(end - 1)
                f.readline()  # to the end of the line holding byte end - 1
                end = f.tell()
            end = min(end, size)
            yield start, end
            start = end


def iter_jsonl_range(path: str, start: int, end: int) -> tuple[int, list[tuple[int, dict | RecordError]]]:
    """The lines of `[start, end)` (from `jsonl_byte_ranges`) as `_iter_jsonl` reads them: (lines in the range,
    [(line number within the range, 1-based; row, RecordError or LineMemoryError)] for the non-blank lines). The
    errors name `path:+n` (n within the range): the caller knows where the range starts and rewrites the source."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if start == 0:
        data = data.removeprefix(UTF8_BOM)
    lines = split_lines(data)  # as iterating a binary file: lines end at b"\n" only, and keep it
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append((n, parse_jsonl_line(line, f"{path}:+{n}")))
            except LineMemoryError as exc:
                rows.append((n, exc))
    return len(lines), rows


def _iter_json(path: str) -> Iterator[tuple[str, Any]]:
    """A JSON array of rows, or an object whose values are arrays of rows (e.g. {"train": [...]}).
    The one reader that holds a whole file in memory (JSON has no record boundaries); use .jsonl for big data."""
    try:
        data = orjson.loads(Path(path).read_bytes().removeprefix(UTF8_BOM))
    except (orjson.JSONDecodeError, MemoryError) as exc:
        if _out_of_memory(exc):
            raise memory_error(path, "file (a .json file is read whole: .jsonl is read line by line)",
                               os.path.getsize(path), exc) from None
        raise RecordError(path, "file", f"malformed JSON: {exc}", "malformed_json") from None
    if isinstance(data, list):
        groups = [(None, data)]
    elif isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        groups = list(data.items())
        if not any(isinstance(row, dict) for rows in data.values() for row in rows[:1]):
            raise RecordError(path, "file", "an object of arrays must map names (e.g. splits) to arrays of row "
                              "objects; column-oriented JSON is not supported", "malformed_json")
    else:
        raise RecordError(path, "file", "expected a JSON array of rows or an object of arrays of rows",
                          "malformed_json")
    for key, rows in groups:
        for i, row in enumerate(rows):
            source = f"{path}:{i}" if key is None else f"{path}:{key}[{i}]"
            if not isinstance(row, dict):
                yield source, RecordError(source, "row", f"expected an object, got {type(row).__name__}",
                                          "malformed_json")
            else:
                yield source, row


def _iter_batches(path: str, batches) -> Iterator[tuple[str, dict]]:
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield f"{path}:{index}", row
            index += 1


def _iter_parquet(path: str) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as pf:
            yield from _iter_batches(path, pf.iter_batches(batch_size=BATCH_ROWS))
    except (pa.ArrowException, OSError) as exc:  # empty, truncated or not parquet at all
        raise RecordError(path, "file", f"not a readable parquet file: {exc}", "malformed_parquet") from None


def _iter_arrow(path: str) -> Iterator[tuple[str, dict]]:
    """Arrow IPC, file (random access) or stream format (what `datasets` writes), memory-mapped."""
    import pyarrow as pa

    try:
        with pa.memory_map(path, "r") as source:
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                batches = pa.ipc.open_stream(source)
            yield from _iter_batches(path, batches)
    except (pa.ArrowException, OSError) as exc:
        raise RecordError(path, "file", f"not a readable Arrow file: {exc}", "malformed_arrow") from None


def _iter_csv(path: str) -> Iterator[tuple[str, Any]]:
    """Rows keyed by the header; the source line is where the row starts (quoted fields may span lines).
    A row with invalid UTF-8 is a `malformed_csv` RecordError (the file is decoded line by line for that)."""
    bad_lines: dict[int, str] = {}  # physical line -> decode error

    def decoded(f: BinaryIO) -> Iterator[str]:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(UTF8_BOM)
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad_lines[lineno] = str(exc)
                yield raw.decode("utf-8", errors="replace")

    with open(path, "rb") as f:
        reader = csv.reader(decoded(f))
        header = next(reader, None)
        if header is None:
            return
        if bad_lines:
            line, error = next(iter(bad_lines.items()))
            raise RecordError(f"{path}:{line}", "header", f"invalid UTF-8: {error}", "malformed_csv")
        end = reader.line_num
        for row in reader:
            source = f"{path}:{end + 1}"
            start, end = end + 1, reader.line_num
            bad = [n for n in range(start, end + 1) if n in bad_lines]
            if bad:
                yield source, RecordError(source, "row", f"invalid UTF-8 on line {bad[0]}: {bad_lines[bad[0]]}",
                                          "malformed_csv")
                continue
            if not row:
                continue
            if len(row) != len(header):
                yield source, RecordError(source, "row", f"{len(row)} fields for {len(header)} columns",
                                          "malformed_csv")
            else:
                yield source, dict(zip(header, row))


def _iter_datasets_dir(path: str, split: str | None) -> Iterator[tuple[str, dict]]:
    import datasets

    ds = datasets.load_from_disk(path)
    name = path
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            raise ValueError(f"{path} is a DatasetDict with splits {sorted(ds)}; name one as split@{path}")
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r}; splits: {sorted(ds)}")
        ds = ds[split]
        name = f"{split}@{path}"
    elif split is not None:
        raise ValueError(f"{path} is a single Dataset; drop the split prefix {split!r}@")
    yield from _iter_batches(name, ds.with_format("arrow").iter(batch_size=BATCH_ROWS))


# ---------------------------------------------------------------------------------------------- writers
def append_file(out: BinaryIO, path: str | os.PathLike) -> None:
    """Append the bytes of file `path` to `out` (a binary file being written), copied by the kernel where it can
    (`os.copy_file_range`: no pass through this process, and server-side on filesystems that offer it). `out`'s
    position follows the file descriptor's, so writes through it after this land after the appended bytes."""
    out.flush()
    with open(path, "rb") as src:
        remaining = os.fstat(src.fileno()).st_size
        try:
            while remaining > 0 and (copied := os.copy_file_range(src.fileno(), out.fileno(), remaining)):
                remaining -= copied
        except OSError:  # not offered here (another filesystem, an old kernel)
            pass
        shutil.copyfileobj(src, out, 1 << 20)  # what the kernel did not copy (from where it stopped)


def copy_into(path: str | os.PathLike, out: str | os.PathLike, offset: int) -> None:
    """The bytes of file `path` written into the existing file `out` at `offset` (beyond its end it grows), copied by
    the kernel where it can (`os.copy_file_range`), by pread/pwrite where it cannot."""
    with open(path, "rb") as src, open(out, "r+b") as dst:
        size = os.fstat(src.fileno()).st_size
        done = 0
        try:
            while done < size and (copied := os.copy_file_range(src.fileno(), dst.fileno(), size - done, done,
                                                                offset + done)):
                done += copied
        except OSError:  # not offered here (another filesystem, an old kernel)
            pass
        while done < size:
            block = os.pread(src.fileno(), min(1 << 20, size - done), done)
            if not block:
                raise OSError(f"{path}: shorter than its size ({done} of {size} bytes read)")
            os.pwrite(dst.fileno(), block, offset + done)
            done += len(block)


def _temporary_places(cfg: DataConfig) -> list[tuple[Path, list[str] | None]]:
    """Where the pipeline's temporaries are: any in `output_dir`, the ratio file's next to it."""
    return [(cfg.out, None), (cfg.ratio_file.parent, [cfg.ratio_file.name])]


def remove_stale_temporaries(cfg: DataConfig) -> list[tuple[Path, int]]:
    """Delete what killed runs left behind: temporaries in `output_dir` and the ratio file's, whose writer process is
    gone. Returns (path, bytes) of each one removed."""
    found = [path for where, names in _temporary_places(cfg) for path in stale_temporaries(where, names)]
    removed = []
    for path in dict.fromkeys(found):
        if path.is_dir() and not path.is_symlink():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
        else:
            size = path.stat().st_size
            path.unlink()
        removed.append((path, size))
    return removed


def undecided_output_temporaries(cfg: DataConfig) -> list[tuple[Path, int]]:
    """The pipeline's temporaries named by pid alone (older versions) whose pid is running, with that pid
    (`fsutil.undecided_temporaries`): kept by `remove_stale_temporaries`."""
    found = [item for where, names in _temporary_places(cfg) for item in undecided_temporaries(where, names)]
    return list(dict.fromkeys(found))


def require_stage_input(path: str | os.PathLike, stage: str) -> Path:
    """The output of an earlier stage, or a FileNotFoundError saying which stage writes it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; run the {stage} stage first")
    return path


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a JSONL file this pipeline wrote (no error policy: these files are ours)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield orjson.loads(line)


# ---------------------------------------------------------------------------------------------- parallel map
def _pool_worker_setup(initializer: Callable | None, initargs: tuple) -> None:
    """A pool worker answers SIGTERM as a process should, whatever it inherited: the pool's `terminate` (on an error
    or a full disk) ends its workers with it, and one that ignored it (a parent that set SIG_IGN) would hang it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if initializer is not None:
        initializer(*initargs)


def ordered_parallel_map(fn: Callable, tasks, workers: int, initializer: Callable | None = None,
                         initargs: tuple = (), start_method: str | None = None) -> Iterator:
    """`fn(task)` for every task, results in task order, at most `2 * workers` tasks in flight.

    Unlike `Pool.imap`, whose feeder thread drains the whole task iterator into the queue, this keeps memory
    bounded when tasks are chunks of a large streamed input. With workers <= 1 everything runs inline (the
    initializer too), so results are identical whatever the worker count. `start_method`: the multiprocessing
    start method of the pool (None: the platform's default).
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        for task in tasks:
            yield fn(task)
        return
    with multiprocessing.get_context(start_method).Pool(workers, initializer=_pool_worker_setup,
                                                        initargs=(initializer, initargs)) as pool:
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
