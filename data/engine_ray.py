"""`engine: ray`: the pipeline's stages on Ray Data, byte-identical to `engine: local`.

The stage modules do not know the engine: this module hands them Ray-backed versions of their parallel parts,
and every stage's own core, accounting and writers do the rest.
- Ordered map: chunks (each with its index) go to Ray Data `map_batches` in windows (one execution each) of
  max(`MIN_WINDOW_CHUNKS`, `WINDOW_CHUNKS_PER_WORKER` x workers) chunks, or at least `RANGE_WINDOW_CHUNKS` for
  chunks that are task descriptors (byte ranges, plan slices); the next window runs beside the current one.
  The driver yields results in chunk order as they arrive (it holds at most two windows). Ray's
  `preserve_order` is set too, never relied on alone. An exception raised by a chunk's function comes back as
  that chunk's result and is raised in chunk order, with its own type and message.
- merge: the workers read sampled.jsonl by byte ranges and return only the decision's inputs (token counts and
  `merge.merge_key` digests); the driver runs the local decision (`merge.GroupDecider`, the same seeded draws)
  over them (`decide_range`: only the records that try to join, and the one before each run of them); the
  workers write the groups starting in their range as parts (reading on past the range's end
  for a group that straddles it), which the driver appends to merged.jsonl.
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
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import orjson

from data import merge
from data.config import DataConfig
from data.executor import Executor, TaskSize, with_setup
from data.fsutil import atomic_writer, read_lines, scratch_dir
from data.io import append_file, iter_jsonl_range, jsonl_byte_ranges, require_stage_input
from data.progress import progress
from data.records import RecordError

# Chunks per Ray Data execution (a window): bounds the driver's memory (a chunk is <= 256 records) and amortizes
# the 0.3-1 s an execution takes to start. A task takes several chunks (a Ray task costs ~10-30 ms more than a
# local pool's): TASKS_PER_WORKER tasks per worker and window keep the workers balanced.
WINDOW_CHUNKS_PER_WORKER = 8
MIN_WINDOW_CHUNKS = 64
TASKS_PER_WORKER = 2
MERGE_RANGE_BYTES = 1 << 20  # sampled.jsonl bytes per merge range
# Maps over byte ranges and plan slices (size "ranges"): Ray Data's driver spends ~20-30 ms of CPU per
# task and block (BENCHMARKS.md, bench_ray_overhead.py), so their windows are large (max(RANGE_WINDOW_CHUNKS,
# RANGE_WINDOW_CHUNKS_PER_WORKER x workers) chunks of ~1 MiB) and cut into RANGE_TASKS_PER_WORKER tasks per
# worker, one block each: >= 32 MiB a task, whatever the worker count.
RANGE_WINDOW_CHUNKS = 1024
RANGE_WINDOW_CHUNKS_PER_WORKER = 256
RANGE_TASKS_PER_WORKER = 8


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
        self.tasks = 0  # Ray tasks (one block each) launched so far: what Ray Data's driver pays per

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
            self.tasks += blocks
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




# ---------------------------------------------------------------------------------------------- pipeline
class _StageMap:
    """Transitional: an executor's map in the shape the stages' old engine hooks take."""

    def __init__(self, executor: Executor, size: TaskSize):
        self.executor, self.size, self.workers = executor, size, executor.workers

    def __call__(self, fn: Callable, chunks: Iterable) -> Iterator:
        return self.executor.map(fn, chunks, self.size)


def stage_runners(executor: RayExecutor) -> dict[str, Callable[[DataConfig, Executor], dict]]:
    """Each stage's `run` with its parallel parts on Ray."""
    range_map = _StageMap(executor, "ranges")
    return {
        "merge": lambda cfg, executor: merge.run(cfg, merge_all=functools.partial(merge_on_workers, range_map)),
    }


def run_pipeline(cfg: DataConfig, run_stages: Callable[..., dict[str, dict]]) -> dict[str, dict]:
    """Every stage of `cfg.stages`, in pipeline order, in one Ray session; returns their report sections.
    `run_stages` is the driver's (`data.pipeline.run_stages`), passed in so that this module, which the driver
    imports, does not import it back."""
    with ray_session(cfg) as workers:
        executor = RayExecutor(workers)
        return run_stages(cfg, executor, stage_runners(executor).get)
