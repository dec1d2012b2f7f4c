"""`engine: ray`: the pipeline's stages on Ray Data, byte-identical to `engine: local`.

The stage modules do not know the engine: this module hands them Ray-backed versions of their parallel parts,
and every stage's own core, accounting and writers do the rest.
- Ordered map: chunks (each with its index) go to Ray Data `map_batches` in windows (one execution each) of
  max(`MIN_WINDOW_CHUNKS`, `WINDOW_CHUNKS_PER_WORKER` x workers) chunks, or at least `RANGE_WINDOW_CHUNKS` for
  chunks that are task descriptors (byte ranges, plan slices); the next window runs beside the current one.
  The driver yields results in chunk order as they arrive (it holds at most two windows). Ray's
  `preserve_order` is set too, never relied on alone. An exception raised by a chunk's function comes back as
  that chunk's result and is raised in chunk order, with its own type and message.
- preprocess: the workers read the inputs that split cheaply (.jsonl byte ranges cut on newlines, .parquet
  row groups) and convert them (other formats are read by the driver as locally, converted by the workers),
  writing the kept records as parts and returning summaries; the driver shifts each range's line numbers by
  the lines of the ranges before it (so `path:line` sources and errors are the local ones), assigns uids and
  category ids from the summaries, and the workers then write each part's canonical.jsonl lines, which the
  driver appends to canonical.jsonl (`io.append_file`, a kernel copy).
- sample: the workers read canonical.jsonl by byte ranges (line lengths and category ids); the driver makes
  the local seeded plan (`sample.plan`); the workers write slices of it as parts, appended in order.
- merge: the workers read sampled.jsonl by byte ranges and return only the decision's inputs (token counts and
  `merge.merge_key` digests); the driver runs the local decision (`merge.GroupDecider`, the same seeded draws)
  over them (`decide_range`: only the records that try to join, and the one before each run of them); the
  workers write the groups starting in their range as parts (reading on past the range's end
  for a group that straddles it), which the driver appends to merged.jsonl.
- pack: the global best-fit plan on the driver from the length array; the rows are written by the workers,
  one task per output shard, appended the same way.
Workers read the inputs, `output_dir` and `tokenizer_path` themselves: on a cluster every node must see them at
the same path (a shared filesystem). Chunks and results travel as pickled bytes (opaque binary columns; Ray
Data would otherwise infer Arrow types from our nested Python values) between this driver and its own workers.
"""
from __future__ import annotations

import array
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import pickle
import queue
import random
import shutil
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import orjson

from data import merge, pack, preprocess, sample
from data.config import DataConfig, split_spec
from data.executor import Executor, TaskSize, with_setup
from data.fsutil import atomic_writer, read_lines, scratch_dir
from data.io import (UTF8_BOM, append_file, expand_inputs, iter_jsonl_range, jsonl_byte_ranges, parse_jsonl_line,
                     require_stage_input)
from data.progress import progress
from data.records import RecordError
from data.report import DROPPED_AT_LIMIT, DroppedAt
from data.shards import PackedDataset, ShardWriter, shard_ranges

# Chunks per Ray Data execution (a window): bounds the driver's memory (a chunk is <= 256 records) and amortizes
# the 0.3-1 s an execution takes to start. A task takes several chunks (a Ray task costs ~10-30 ms more than a
# local pool's): TASKS_PER_WORKER tasks per worker and window keep the workers balanced.
WINDOW_CHUNKS_PER_WORKER = 8
MIN_WINDOW_CHUNKS = 64
TASKS_PER_WORKER = 2
INPUT_RANGE_BYTES = 16 << 20  # .jsonl input bytes per preprocess range (a worker holds its rows at once)
RANGE_BYTES = 1 << 20  # canonical.jsonl bytes per sample range, and sampled.jsonl bytes per sample plan slice
MERGE_RANGE_BYTES = 1 << 20  # sampled.jsonl bytes per merge range
# Maps over byte ranges and plan slices (`_StageMap.for_ranges`): Ray Data's driver spends ~20-30 ms of CPU per
# task and block (BENCHMARKS.md, bench_ray_overhead.py), so their windows are large (max(RANGE_WINDOW_CHUNKS,
# RANGE_WINDOW_CHUNKS_PER_WORKER x workers) chunks of ~1 MiB) and cut into RANGE_TASKS_PER_WORKER tasks per
# worker, one block each: >= 32 MiB a task, whatever the worker count.
RANGE_WINDOW_CHUNKS = 1024
RANGE_WINDOW_CHUNKS_PER_WORKER = 256
RANGE_TASKS_PER_WORKER = 8
MAX_ROW_GROUP_BYTES = 16 << 20  # larger .parquet row groups: the file is read on the driver


# ---------------------------------------------------------------------------------------------- session
@contextlib.contextmanager
def ray_session(cfg: DataConfig) -> Iterator[int]:
    """Join `cfg.ray_address` (None: start a local instance) unless Ray is already initialized in this process;
    yields the worker count (`num_workers`, or every CPU of the cluster). Shuts down only what it started."""
    import ray
    import ray.data

    started = not ray.is_initialized()
    if started:
        local = cfg.ray_address is None
        ray.init(address=cfg.ray_address, include_dashboard=False if local else None,
                 num_cpus=(cfg.num_workers or None) if local else None,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        yield cfg.num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    finally:
        if started:
            ray.shutdown()


# ---------------------------------------------------------------------------------------------- ordered map
class _ChunkFailure:
    """An exception `fn` raised on a worker, sent back as its chunk's result: the driver raises it in chunk order,
    with its own type and message, as the local engine would (Ray would wrap it in a `RayTaskError`). Crashes of
    the worker process itself are not caught here: Ray retries those tasks."""

    def __init__(self, exc: Exception):
        self.exc = exc


def _run_chunk(fn: Callable, chunk: bytes) -> bytes:
    try:
        return pickle.dumps(fn(pickle.loads(chunk)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        exc.add_note(f"(raised in a Ray worker)\n{traceback.format_exc()}")
        try:
            return pickle.dumps(_ChunkFailure(exc), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle: its type, message and traceback as text
            return pickle.dumps(_ChunkFailure(RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))


def _apply(batch: dict, fn: Callable) -> dict:
    """The Ray Data UDF: `fn` on each pickled chunk of the batch, the chunk index passed through."""
    results = [_run_chunk(fn, chunk) for chunk in batch["chunk"]]
    return {"index": batch["index"], "result": np.array(results, dtype=object)}


class RayExecutor(Executor):
    """`Executor.map` on Ray Data: `fn(task)` for every task, yielded in task order as they arrive.

    Tasks are read a window at a time (one Ray Data execution each); the next window is submitted while the caller
    consumes one, and runs beside it (its tasks fill the workers the current window's last tasks leave idle), so
    the driver holds at most two windows of tasks and results. Ray Data's driver pays per execution, task and
    block, so maps over small task descriptors (`size="ranges"`) use large windows; `size="shards"` runs one task
    (a whole output shard) per Ray task."""

    def __init__(self, workers: int, window: int | None = None):
        self.workers = workers
        self.window = window  # tasks per execution, whatever `size` (None: by size and workers)

    def map(self, fn: Callable, tasks: Iterable, size: TaskSize = "ranges",
            setup: Callable[[], None] | None = None) -> Iterator:
        window = max(MIN_WINDOW_CHUNKS, WINDOW_CHUNKS_PER_WORKER * self.workers)
        chunks_per_task, tasks_per_worker = None, TASKS_PER_WORKER
        if size == "ranges":
            window = max(window, RANGE_WINDOW_CHUNKS, RANGE_WINDOW_CHUNKS_PER_WORKER * self.workers)
            tasks_per_worker = RANGE_TASKS_PER_WORKER
        elif size == "shards":
            chunks_per_task = 1
        window = self.window or window
        return self._map(with_setup(fn, setup), tasks, window, chunks_per_task, tasks_per_worker)

    def _map(self, fn: Callable, chunks: Iterable, window: int, chunks_per_task: int | None,
             tasks_per_worker: int) -> Iterator:
        runner = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ray-window")
        failed: list[Exception] = []  # an error of `chunks` itself: raised after the chunks before it are yielded
        try:
            running = None
            for first, items in self._windows(chunks, window, failed):
                arrived: queue.SimpleQueue = queue.SimpleQueue()
                per_task = chunks_per_task or max(1, len(items) // (tasks_per_worker * self.workers))
                following = (first, len(items), arrived, runner.submit(self._run_window, fn, items, per_task, arrived))
                if running is not None:
                    yield from self._in_order(*running)
                running = following
            if running is not None:
                yield from self._in_order(*running)
            if failed:
                raise failed[0]
        finally:  # stopped early (an error, or the caller closed us): a window not started yet never starts
            runner.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _windows(chunks: Iterable, window: int, failed: list[Exception]) -> Iterator[tuple[int, list[dict]]]:
        """Windows of pickled chunks. An error raised by `chunks` ends them (the chunks read so far still go out)
        and is put in `failed`: the caller raises it after the results of the chunks before it, so that an
        error found by a worker in an earlier chunk comes first, as in chunk order."""
        items: list[dict] = []
        try:
            for index, chunk in enumerate(chunks):
                items.append({"index": index, "chunk": pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)})
                if len(items) >= window:
                    yield items[0]["index"], items
                    items = []
        except Exception as exc:
            failed.append(exc)
        if items:
            yield items[0]["index"], items

    @staticmethod
    def _in_order(first: int, n: int, arrived: queue.SimpleQueue, done: concurrent.futures.Future) -> Iterator:
        """A window's results in chunk order, each as soon as it and every chunk before it have arrived."""
        waiting: dict[int, bytes] = {}
        for k in range(first, first + n):
            while k not in waiting:
                index, result = arrived.get()
                if index is None:  # the execution ended: raises its error, or reports the chunks it never returned
                    done.result()
                    raise RuntimeError(f"Ray returned no result for chunk {k} (window {first}..{first + n - 1})")
                if not first <= index < first + n or index in waiting:
                    raise RuntimeError(f"Ray returned chunk {index} unexpectedly (window {first}..{first + n - 1})")
                waiting[index] = result
            result = pickle.loads(waiting.pop(k))
            if isinstance(result, _ChunkFailure):
                raise result.exc
            yield result
        done.result()

    def _run_window(self, fn: Callable, items: list[dict], chunks_per_task: int, arrived: queue.SimpleQueue) -> None:
        """One Ray Data execution over a window: each (chunk index, pickled result) onto `arrived` as Ray yields
        it, then (None, None)."""
        import ray.data

        try:
            blocks = -(-len(items) // chunks_per_task)  # one block a task: the driver's cost is per block too
            dataset = ray.data.from_items(items, override_num_blocks=blocks).map_batches(
                _apply, fn_args=(fn,), batch_size=chunks_per_task, batch_format="numpy",
                compute=ray.data.TaskPoolStrategy(size=self.workers))
            for row in dataset.iter_rows():
                arrived.put((int(row["index"]), row["result"]))
        finally:
            arrived.put((None, None))


def append_parts(out, results: Iterable[tuple], bar) -> list[list]:
    """For each worker result `(part, records, *rest)` in order: append the part to `out` (`io.append_file`, a
    kernel copy), remove it, advance `bar` by its records. Returns the `rest` of each."""
    rests = []
    for part, n, *rest in results:
        append_file(out, part)
        os.remove(part)
        bar.update(n)
        rests.append(rest)
    return rests


# ---------------------------------------------------------------------------------------------- preprocess
def _preprocess_task(task: tuple) -> tuple:
    """Worker: `("rows", spec_index, spec, fmt, rows)` converts rows the driver read (as locally);
    `("range", spec_index, spec, fmt, path, start, end, lines_before)` reads and converts the lines of a .jsonl
    byte range. Returns (kind, spec_index, path, lines_before, lines in the range, rows read, results) with
    `convert_chunk`'s results; a range's sources are `path:+n` (n: line within the range) until the driver,
    which knows where the range starts, rewrites them."""
    if task[0] == "rows":
        _, spec_index, spec, fmt, rows = task
        return "rows", spec_index, None, None, 0, len(rows), preprocess.convert_chunk((spec_index, spec, fmt, rows))[1]
    if task[0] == "row_group":
        import pyarrow.parquet as pq

        _, spec_index, spec, fmt, path, group, first_row = task
        with pq.ParquetFile(path) as pf:
            rows = [(f"{path}:{first_row + i}", row) for i, row in enumerate(pf.read_row_group(group).to_pylist())]
        return "rows", spec_index, None, None, 0, len(rows), preprocess.convert_chunk((spec_index, spec, fmt, rows))[1]
    _, spec_index, spec, fmt, path, start, end, lines_before = task
    n_lines, rows = iter_jsonl_range(path, start, end)
    readable = [(row_or_error.source if isinstance(row_or_error, RecordError) else f"{path}:+{n}", row_or_error)
                for n, row_or_error in rows]
    converted = iter(preprocess.convert_chunk(
        (spec_index, spec, fmt, [(src, row) for src, row in readable if not isinstance(row, RecordError)]))[1])
    results = [("err", row.source, row.field, row.message, row.reason) if isinstance(row, RecordError)
               else next(converted) for _, row in readable]
    return "range", spec_index, path, lines_before, n_lines, len(rows), results


def _detect_in_jsonl(path: str, rows: preprocess.RowChunker, cfg: DataConfig):
    """The format of a .jsonl input from its first row of a detectable format, read here as `preprocess._tasks`
    reads it (rows before it count as dropped under skip, `rows.count_dropped`): (format, spec, its byte offset,
    lines before it), or None when no row of the file has one."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if lineno == 1:
                line = line.removeprefix(UTF8_BOM)
            if not line.strip():
                continue
            source = f"{path}:{lineno}"
            row = parse_jsonl_line(line, source)
            try:
                if isinstance(row, RecordError):
                    raise row
                fmt, resolved = preprocess.detect_format(row, rows.spec, source)
            except RecordError as exc:
                if cfg.on_error != "skip":
                    raise
                rows.count_dropped(exc)
                continue
            return fmt, resolved, start, lineno - 1
    return None


def _parquet_row_groups(path: str) -> list[int] | None:
    """Rows per row group of a readable .parquet file (its footer only); None for any other input, for a file
    pyarrow cannot open (read here then, so it fails as locally) and for one with a row group over
    `MAX_ROW_GROUP_BYTES` (a worker reads a row group whole and its rows come back as one result)."""
    if not (path.lower().endswith(".parquet") and os.path.isfile(path)):
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as pf:
            groups = [pf.metadata.row_group(k) for k in range(pf.num_row_groups)]
    except (pa.ArrowException, OSError):
        return None
    if any(group.total_byte_size > MAX_ROW_GROUP_BYTES for group in groups):
        return None
    return [group.num_rows for group in groups]


def _preprocess_tasks(cfg: DataConfig, stats: list[dict], dropped: dict,
                      dropped_at: DroppedAt) -> Iterator[tuple]:
    """`preprocess._tasks` with the reading moved to the workers where an input splits cheaply: .jsonl into
    byte ranges (once the input's format is known: a set one, or detected here from its first rows), .parquet
    into row groups (when the input's format is set; `auto` needs a row). Other inputs (.json arrays, .csv,
    .arrow, datasets directories) are read here in chunks of rows, as locally."""
    for spec_index, spec in enumerate(cfg.inputs):
        st = stats[spec_index]
        rows = preprocess.RowChunker(cfg, spec, st, dropped, dropped_at, count_kept=False)  # kept: from results
        for path in expand_inputs(spec.path):
            split, local = split_spec(path)
            if split is None and local.lower().endswith(".jsonl") and os.path.isfile(local):
                start, lines_before = 0, 0
                if rows.fmt is None:
                    found = _detect_in_jsonl(path, rows, cfg)
                    if found is None:
                        continue
                    rows.fmt, rows.spec, start, lines_before = found
                    st["format"] = rows.fmt
                for chunk_spec, fmt, chunk in rows.flush():
                    yield "rows", spec_index, chunk_spec, fmt, chunk
                for k, (a, b) in enumerate(jsonl_byte_ranges(path, start, INPUT_RANGE_BYTES)):
                    yield "range", spec_index, rows.spec, rows.fmt, path, a, b, lines_before if k == 0 else None
                continue
            known = rows.fmt is not None or rows.spec.format != "auto"  # a set format needs no row to detect it
            row_groups = _parquet_row_groups(local) if split is None and known else None
            if row_groups is not None:
                rows.fmt = rows.fmt or rows.spec.format
                st["format"] = rows.fmt
                for chunk_spec, fmt, chunk in rows.flush():
                    yield "rows", spec_index, chunk_spec, fmt, chunk
                first_row = 0
                for group, n_rows in enumerate(row_groups):
                    yield "row_group", spec_index, rows.spec, rows.fmt, path, group, first_row
                    first_row += n_rows
                continue
            for chunk_spec, fmt, chunk in rows.add_rows(path):
                yield "rows", spec_index, chunk_spec, fmt, chunk
        for chunk_spec, fmt, chunk in rows.flush():
            yield "rows", spec_index, chunk_spec, fmt, chunk


def _convert_to_part(parts_dir: str, numbered: tuple[int, tuple]) -> tuple:
    """Worker, preprocess's first pass: task `k`'s rows converted (`_preprocess_task`) and its kept records
    written to a part as `[category, source, record]` lines; returns what the driver's accounting needs:
    (kind, spec_index, path, lines_before, lines, rows, kept, {category: kept, in order of first appearance},
    {drop reason: count}, {drop reason: its first `DROPPED_AT_LIMIT` sources}, the first error as (source, field,
    message, reason) or None, part). A task's rows are a stretch of one input in order, so the first sources
    of each task hold the first of the whole run."""
    k, task = numbered
    kind, spec_index, path, lines_before, n_lines, n_rows, results = _preprocess_task(task)
    part = os.path.join(parts_dir, f"converted_{k:08d}.jsonl")
    categories: dict[str, int] = {}
    dropped: dict[str, int] = {}
    dropped_at: dict[str, list[str]] = {}
    first_error = None
    with atomic_writer(part) as out:
        for result in results:
            if result[0] == "ok":
                _, source, rec, category = result
                out.write(orjson.dumps([category, source, rec]) + b"\n")
                categories[category] = categories.get(category, 0) + 1
                continue
            if result[0] == "filtered":
                reason = "filtered_by_function"
            else:
                _, source, field, message, reason = result
                first_error = first_error or (source, field, message, reason)
            dropped[reason] = dropped.get(reason, 0) + 1
            sources = dropped_at.setdefault(reason, [])
            if len(sources) < DROPPED_AT_LIMIT:
                sources.append(result[1])
    return (kind, spec_index, path, lines_before, n_lines, n_rows, sum(categories.values()), categories, dropped,
            dropped_at, first_error, part)


def _finish_part(task: tuple[str, str, int, dict[str, int], tuple[int, int] | None]) -> tuple[str, int]:
    """Worker, preprocess's second pass: a first-pass part's records as canonical.jsonl lines (`canonical_line`),
    uids from `first_uid`, category ids from `ids`; a range's `path:+n` sources become `path:(base + n)` (`shift`:
    (length of `path:+`, base)). Returns (the finished part, its records)."""
    part, finished, first_uid, ids, shift = task
    n = 0
    with open(part, "rb") as f, atomic_writer(finished) as out:
        for n, line in enumerate(f, 1):
            category, source, rec = orjson.loads(line)
            if shift is not None:
                source = f"{source[:shift[0] - 1]}{shift[1] + int(source[shift[0]:])}"
            out.write(preprocess.canonical_line(rec, category, ids[category], first_uid + n - 1, source))
    return finished, n


def _shifted(source: str, path: str, base: int) -> str:
    """A range's source `path:+n` as the local one, `path:(base + n)` (`base`: the lines before the range)."""
    return f"{path}:{base + int(source[len(path) + 2:])}"


def convert_on_workers(parallel_map: _StageMap, cfg: DataConfig, stats: list[dict], dropped: dict,
                       dropped_at: DroppedAt, category_ids: preprocess.CategoryIds, sizes: dict, out,
                       bar) -> int:
    """`preprocess.run`'s reading, converting and writing on the workers, in two passes. First the workers
    convert their tasks (`.jsonl` byte ranges, `.parquet` row groups, or rows the driver read) and write the kept
    records as parts; the driver does the accounting from their summaries in task order: line numbers (each
    range's lines shifted by those of the ranges before it, so sources and errors read `path:line` as locally),
    the first error, drop counts and sources, category ids in order of first appearance, each part's first uid. Then the
    workers write each part's canonical.jsonl lines and the driver appends the parts to `out` (a kernel copy)."""
    next_line: dict[str, int] = {}
    finish: list[tuple] = []
    uid = 0
    with scratch_dir(Path(cfg.canonical_path).parent, "preprocess-parts") as parts_dir:
        numbered = enumerate(_preprocess_tasks(cfg, stats, dropped, dropped_at))
        fn = functools.partial(_convert_to_part, str(parts_dir))
        with contextlib.closing(parallel_map(fn, numbered)) as done:
            for (kind, spec_index, path, lines_before, n_lines, n_rows, n_kept, categories, part_dropped,
                 part_dropped_at, first_error, part) in done:
                st = stats[spec_index]
                st["in"] += n_rows
                shift = None
                if kind == "range":
                    base = lines_before if lines_before is not None else next_line[path]
                    next_line[path] = base + n_lines
                    shift = (len(path) + 2, base)  # a range's sources are `path:+n`
                if first_error is not None and cfg.on_error != "skip":
                    source, field, message, reason = first_error
                    if shift is not None:
                        source = _shifted(source, path, base)
                    raise RecordError(source, field, message, reason)
                for reason, n in part_dropped.items():
                    st["dropped"] += n
                    dropped[reason] = dropped.get(reason, 0) + n
                for reason, sources in part_dropped_at.items():
                    for source in sources:
                        dropped_at.add(reason, source if shift is None else _shifted(source, path, base))
                for category, n in categories.items():
                    category_ids(category)
                    sizes[category] = sizes.get(category, 0) + n
                st["out"] += n_kept
                if n_kept:
                    finish.append((part, uid, shift))
                uid += n_kept
                bar.update(n_rows)
        tasks = ((part, part[:-len(".jsonl")] + ".canonical.jsonl", first_uid, category_ids.ids, shift)
                 for part, first_uid, shift in finish)
        with progress(total=uid, desc="preprocess: canonical lines", unit="rec") as written, \
                contextlib.closing(parallel_map.for_ranges()(_finish_part, tasks)) as finished:
            append_parts(out, finished, written)
    return uid


# ---------------------------------------------------------------------------------------------- sample
def _scan_range(task: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """Worker: each line's length and category id in a byte range of canonical.jsonl, and the category names
    (`sample.scan` over the range)."""
    lines = read_lines(*task)  # lines as iterating the file gives them (`JsonlIndex`)
    lengths = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
    categories = np.empty(len(lines), dtype=np.int64)
    names: dict[int, str] = {}
    for i, line in enumerate(lines):
        meta = orjson.loads(line)["meta"]
        categories[i] = cid = meta["category_id"]
        names.setdefault(cid, meta.get("category_name", str(cid)))
    return lengths, categories, names


def scan_on_workers(parallel_map: _StageMap, path: Path) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """`sample.scan` with the records read by the workers, by byte ranges; the driver keeps 16 bytes a record."""
    ranges = list(jsonl_byte_ranges(str(path), 0, RANGE_BYTES))
    lengths, categories, names = [np.zeros(1, dtype=np.int64)], [np.zeros(0, dtype=np.int64)], {}
    with contextlib.closing(parallel_map(_scan_range, ((str(path), a, b) for a, b in ranges))) as done:
        for range_lengths, range_categories, range_names in done:
            lengths.append(range_lengths)
            categories.append(range_categories)
            for cid, name in range_names.items():
                names.setdefault(cid, name)
    return np.cumsum(np.concatenate(lengths)), np.concatenate(categories), names


def _write_sampled(task: tuple[str, np.ndarray, np.ndarray, np.ndarray, str]) -> tuple[str, int]:
    """Worker: a slice of the sample plan, its records read from canonical.jsonl by offset and written as a part
    (`sample.sampled_line`). Returns (part, records)."""
    path, starts, ends, copies, part = task
    with open(path, "rb") as f, atomic_writer(part) as out:
        for start, end, copy in zip(starts.tolist(), ends.tolist(), copies.tolist()):
            f.seek(start)
            out.write(sample.sampled_line(f.read(end - start).rstrip(b"\n"), copy))
    return part, len(starts)


def write_sampled_on_workers(parallel_map: _StageMap, cfg: DataConfig, offsets: np.ndarray, records: np.ndarray,
                             copies: np.ndarray, out) -> None:
    """`sample.write` on the workers: the plan cut into slices of about `RANGE_BYTES` of output, each written
    as a part by a worker, the parts appended to `out` in order (a kernel copy)."""
    output_ends = np.diff(offsets)[records]  # each planned line's bytes, then (in place) where it ends in the output
    np.cumsum(output_ends, out=output_ends)
    total = int(output_ends[-1]) if len(output_ends) else 0
    cuts = np.searchsorted(output_ends, np.arange(RANGE_BYTES, total, RANGE_BYTES))
    del output_ends
    bounds = np.unique(np.concatenate([[0], cuts, [len(records)]]))
    with scratch_dir(Path(cfg.sampled_path).parent, "sample-parts") as parts_dir:
        tasks = ((str(cfg.canonical_path), offsets[records[a:b]], offsets[records[a:b] + 1], copies[a:b],
                  str(parts_dir / f"part_{k:08d}.jsonl"))
                 for k, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())))
        with progress(total=len(records), desc="sample", unit="rec") as bar, \
                contextlib.closing(parallel_map(_write_sampled, tasks)) as done:
            append_parts(out, done, bar)


# ---------------------------------------------------------------------------------------------- merge
def _count_lines(task: tuple[str, int, int]) -> tuple[int, int]:
    """Worker: (lines, non-blank lines) of a byte range of a .jsonl file, split as iterating the file splits it."""
    lines = read_lines(*task)
    return len(lines), sum(1 for line in lines if line.strip())


def _merge_inputs(task: tuple) -> tuple[int, np.ndarray, np.ndarray]:
    """Worker: the merge decision's inputs for the records of a byte range of sampled.jsonl, `merge.prepare_records`
    on them: (labels zeroed, token counts as int32 with -1 for None, merge keys as (n, 4) uint64)."""
    path, start, end, joins, budget_active, loss_turns, tokenizer_key, opts = task
    _, rows = iter_jsonl_range(path, start, end)
    records = []
    for _, row in rows:
        if isinstance(row, RecordError):
            raise row
        records.append(row)
    joins = joins.tolist()
    needs = merge.needs_counts(joins[:-1], joins[-1], budget_active)
    zeroed, counts, keys = merge.prepare_records(records, needs, loss_turns, tokenizer_key, opts, True)
    return (sum(zeroed), np.array([-1 if n is None else n for n in counts], dtype=np.int32),
            np.array(keys, dtype=np.uint64).reshape(len(records), len(merge.MERGE_KEYS)))


def _write_groups(task: tuple[str, int, int, np.ndarray, str, str]) -> tuple[str, int, int]:
    """Worker: the merged records of the groups that start in one byte range of sampled.jsonl, written as a
    part (atomically: a retried task rewrites it). The range's first `skip` records belong to a group of an
    earlier range; the last group may run on past the range's end, so lines are read on until it is complete.
    Returns (part, groups, labels zeroed by loss_turns in these groups)."""
    path, start, skip, sizes, loss_turns, part = task
    zeroed = 0
    with open(path, "rb") as f, atomic_writer(part) as out:
        f.seek(start)
        lines = (line for line in f if line.strip())
        for _ in range(skip):
            next(lines)
        for size in sizes.tolist():
            group = [orjson.loads(next(lines)) for _ in range(size)]
            zeroed += sum(merge.apply_loss_turns(rec, loss_turns) for rec in group)
            out.write(orjson.dumps(merge.merge_records(group)) + b"\n")
    return part, len(sizes), zeroed


def decide_range(decider: merge.GroupDecider, joins: np.ndarray, tokens: np.ndarray, keys: np.ndarray
                 ) -> np.ndarray:
    """`decider.starts_group` over one range's records (draws, token counts with -1 for None, merge keys), in
    order; returns the indices in the range of the records that start a group. A record that does not try to
    join starts a group and sets the decider's state from itself alone, so only the records that try to join,
    and the record just before each run of them, go through the decider; its state carries on into the next
    range."""
    starts = ~joins
    before = np.flatnonzero(joins[1:] & ~joins[:-1])  # the non-joining record before each run of joins
    tried = np.flatnonzero(joins)
    calls = np.concatenate([before, tried, [len(joins) - 1]] if len(joins) and not joins[-1] else [before, tried])
    for i in np.unique(calls).tolist():  # in record order
        n = int(tokens[i])
        started = decider.starts_group(bool(joins[i]), None if n < 0 else n, tuple(keys[i].tolist()))
        starts[i] = started
    return np.flatnonzero(starts)


def merge_on_workers(parallel_map: _StageMap, cfg: DataConfig, budget: int | None, tokenizer_key,
                     opts) -> merge.MergeTotals:
    """`merge.run` with the records off the driver, in three passes over byte ranges of sampled.jsonl: the
    workers count each range's records; with the seeded draws (`merge.join_draws`, in file order) they return
    the decision's inputs (token counts, merge keys: 36 bytes a record), on which the driver runs the local
    decision (`merge.GroupDecider`); then they write the groups starting in their range as parts, which the
    driver concatenates into merged.jsonl (a byte copy)."""
    path = str(require_stage_input(cfg.sampled_path, "sample"))
    ranges = list(jsonl_byte_ranges(path, 0, MERGE_RANGE_BYTES))
    with contextlib.closing(parallel_map(_count_lines, ((path, a, b) for a, b in ranges))) as done:
        counts = [n_records for _, n_records in done]
    first_record = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    n_in = int(first_record[-1])
    starts = array.array("q")  # record index where each group starts, in order
    decider = merge.GroupDecider(budget)
    if budget is None:  # no draws: every record is a group of its own
        starts.extend(range(n_in))
    else:
        draws = merge.join_draws(random.Random(cfg.seed), cfg.merge.probability)
        joins_of: collections.deque[np.ndarray] = collections.deque()  # draws of the ranges in flight

        def tasks():
            ahead = next(draws)
            for (a, b), n in zip(ranges, counts):
                if not n:
                    continue
                joins = [ahead] + [next(draws) for _ in range(n)]  # ..., and the next record's draw
                ahead = joins[-1]
                joins_of.append(np.array(joins[:-1]))
                yield path, a, b, np.array(joins, dtype=bool), True, cfg.loss_turns, tokenizer_key, opts

        index = 0
        with progress(total=n_in, desc="merge: decisions", unit="rec") as bar, \
                contextlib.closing(parallel_map(_merge_inputs, tasks())) as done:
            for _, tokens, keys in done:
                bar.update(len(tokens))
                starts.extend((index + decide_range(decider, joins_of.popleft(), tokens, keys)).tolist())
                index += len(tokens)
    group_starts = np.frombuffer(starts, dtype=np.int64) if starts else np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.append(group_starts, n_in))
    group_sizes = {int(k): int(v) for k, v in zip(*np.unique(sizes, return_counts=True))}
    with scratch_dir(Path(cfg.merged_path).parent, "merge-parts") as parts_dir:
        def write_tasks():
            for k, (a, _) in enumerate(ranges):
                lo, hi = np.searchsorted(group_starts, first_record[k:k + 2])
                if lo < hi:  # groups start in this range
                    yield (path, a, int(group_starts[lo] - first_record[k]), sizes[lo:hi], cfg.loss_turns,
                           str(parts_dir / f"part_{k:08d}.jsonl"))

        with atomic_writer(cfg.merged_path) as out, progress(total=len(sizes), desc="merge", unit="group") as bar, \
                contextlib.closing(parallel_map(_write_groups, write_tasks())) as done:
            zeroed = sum(part_zeroed for part_zeroed, in append_parts(out, done, bar))
    return merge.MergeTotals(n_in, zeroed, decider.blocked, group_sizes)


# ---------------------------------------------------------------------------------------------- pack
def _write_part(task: tuple[str, list[str], int, str, str, pack.RowPlan]) -> str:
    """Worker: one output shard, `rows` copied from the tokenized dataset by `pack.write_rows`, as a dataset
    of its own at `part_dir` (the driver shows the progress, by shard)."""
    src_path, token_fields, max_shard_bytes, kind, part_dir, rows = task
    src = PackedDataset(src_path)
    writer = ShardWriter(part_dir, token_fields=token_fields, max_shard_bytes=max_shard_bytes, kind=kind)
    with writer:
        pack.write_rows(writer, src, rows, np.asarray(src.row_n_tokens, dtype=np.int64), show_progress=False)
        writer.close()
    return part_dir


def write_rows_on_workers(parallel_map: _StageMap, writer: ShardWriter, src: PackedDataset,
                          rows: pack.RowPlan, lengths: np.ndarray) -> None:
    """`pack.run`'s row writer: one Ray task per output shard, the shards appended to `writer` in order."""
    row_nbytes = (rows.sums(lengths) * writer.dtype.itemsize).tolist()
    shards = shard_ranges(row_nbytes, writer.max_shard_bytes)
    parts = writer.tmp_dir / "ray-parts"  # inside the writer's temp dir: an aborted writer removes it too
    parts.mkdir()
    tasks = ((str(src.path), writer.token_fields, writer.max_shard_bytes, writer.kind, str(parts / f"part_{k:05d}"),
              rows.slice(start, end)) for k, (start, end) in enumerate(shards))
    with progress(total=len(rows), desc="pack", unit="row") as bar, \
            contextlib.closing(parallel_map(_write_part, tasks)) as part_dirs:
        for part_dir, (start, end) in zip(part_dirs, shards):
            writer.append_dataset(part_dir)
            bar.update(end - start)
    shutil.rmtree(parts)  # empty, or the temp dirs of attempts Ray retried


# ---------------------------------------------------------------------------------------------- pipeline
class _StageMap:
    """Transitional: an executor's map in the shape the stages' old engine hooks take."""

    def __init__(self, executor: Executor, size: TaskSize):
        self.executor, self.size, self.workers = executor, size, executor.workers

    def __call__(self, fn: Callable, chunks: Iterable) -> Iterator:
        return self.executor.map(fn, chunks, self.size)

    def for_ranges(self) -> "_StageMap":
        return _StageMap(self.executor, "ranges")


def stage_runners(executor: RayExecutor) -> dict[str, Callable[[DataConfig, Executor], dict]]:
    """Each stage's `run` with its parallel parts on Ray."""
    parallel_map = _StageMap(executor, "records")
    range_map = _StageMap(executor, "ranges")
    shard_map = _StageMap(executor, "shards")
    return {
        "preprocess": lambda cfg, executor: preprocess.run(
            cfg, convert_all=functools.partial(convert_on_workers, parallel_map)),
        "sample": lambda cfg, executor: sample.run(
            cfg, scan_all=functools.partial(scan_on_workers, range_map),
            write_all=functools.partial(write_sampled_on_workers, range_map)),
        "merge": lambda cfg, executor: merge.run(cfg, merge_all=functools.partial(merge_on_workers, range_map)),
        "pack": lambda cfg, executor: pack.run(cfg, write=functools.partial(write_rows_on_workers, shard_map)),
    }


def run_pipeline(cfg: DataConfig, run_stages: Callable[..., dict[str, dict]]) -> dict[str, dict]:
    """Every stage of `cfg.stages`, in pipeline order, in one Ray session; returns their report sections.
    `run_stages` is the driver's (`data.pipeline.run_stages`), passed in so that this module, which the driver
    imports, does not import it back."""
    with ray_session(cfg) as workers:
        executor = RayExecutor(workers)
        return run_stages(cfg, executor, stage_runners(executor).get)
