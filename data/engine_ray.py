"""`engine: ray`: the pipeline's stages on Ray Data, byte-identical to `engine: local`.

The stage modules do not know the engine: each runs its one program over an executor (`data.executor`), and
this module gives them `RayExecutor`, whose maps run on Ray Data.
- Ordered map: chunks (each with its index) go to Ray Data `map_batches` in windows (one execution each) of
  max(`MIN_WINDOW_CHUNKS`, `WINDOW_CHUNKS_PER_WORKER` x workers) chunks, or at least `RANGE_WINDOW_CHUNKS` for
  chunks that are task descriptors (byte ranges, plan slices); the next window runs beside the current one.
  The driver yields results in chunk order as they arrive (it holds at most two windows). Ray's
  `preserve_order` is set too, never relied on alone. An exception raised by a chunk's function comes back as
  that chunk's result and is raised in chunk order, with its own type and message.
Workers read the inputs, `output_dir` and `tokenizer_path` themselves: on a cluster every node must see them at
the same path (a shared filesystem). Chunks and results travel as pickled bytes (opaque binary columns; Ray
Data would otherwise infer Arrow types from our nested Python values) between this driver and its own workers.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from common.config import ConfigError
from common.fsutil import atomic_path
from data.config import DataConfig
from data.executor import Executor, Part, TaskSize, copy_parts, copy_tasks, with_setup

# Chunks per Ray Data execution (a window): bounds the driver's memory (a chunk is <= 256 records) and amortizes
# the 0.3-1 s an execution takes to start. A task takes several chunks (a Ray task costs ~10-30 ms more than a
# local pool's): TASKS_PER_WORKER tasks per worker and window keep the workers balanced.
WINDOW_CHUNKS_PER_WORKER = 8
MIN_WINDOW_CHUNKS = 64
TASKS_PER_WORKER = 2
# Maps over task descriptors (size "ranges": byte ranges, plan slices, output shards): Ray Data's driver spends
# ~20-30 ms of CPU per task and block (BENCHMARKS.md, bench_ray_overhead.py), so their windows are large
# (max(RANGE_WINDOW_CHUNKS, RANGE_WINDOW_CHUNKS_PER_WORKER x workers) chunks, ~1 MiB of input each for byte
# ranges) and cut into RANGE_TASKS_PER_WORKER tasks per worker, one block each: ~256 MiB a task on a large input,
# whatever the worker count (~4 Ray tasks per GiB and pass, bench_ray.py's projection); a small input still gives
# every worker its tasks. The next window, running beside, keeps the workers busy.
RANGE_WINDOW_CHUNKS = 1024
RANGE_WINDOW_CHUNKS_PER_WORKER = 512
RANGE_TASKS_PER_WORKER = 2


def map_shape(size: TaskSize, workers: int, window: int | None = None) -> tuple[int, int]:
    """How `RayExecutor.map` runs chunks of a size class on `workers`: (chunks per window, Ray tasks per worker
    in a window)."""
    if size == "ranges":
        return window or max(RANGE_WINDOW_CHUNKS, RANGE_WINDOW_CHUNKS_PER_WORKER * workers), RANGE_TASKS_PER_WORKER
    return window or max(MIN_WINDOW_CHUNKS, WINDOW_CHUNKS_PER_WORKER * workers), TASKS_PER_WORKER


def chunks_per_task(window_chunks: int, tasks_per_worker: int, workers: int) -> int:
    """Chunks per Ray task in a window of `window_chunks` chunks."""
    return max(1, window_chunks // (tasks_per_worker * workers))


def ray_tasks(chunks: int, size: TaskSize, workers: int, window: int | None = None) -> int:
    """The Ray tasks (blocks) `RayExecutor(workers, window).map` launches for `chunks` chunks of a size class: what
    Ray Data's driver pays per (the projection of a larger input and cluster reads it)."""
    window, tasks_per_worker = map_shape(size, workers, window)
    full, last = divmod(chunks, window)
    total = 0
    for n, windows in ((window, full), (last, 1 if last else 0)):
        if windows:
            total += windows * -(-n // chunks_per_task(n, tasks_per_worker, workers))
    return total


# ---------------------------------------------------------------------------------------------- session
CONNECT_TIMEOUT_S = 5.0  # ray.init retries an unreachable address for 60-90 s before a traceback naming nothing


def address_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) that `ray_address` connects to: "ray://host:port" (Ray Client) or "host:port" (the GCS of a
    cluster); None for "auto"/"local", which Ray resolves itself (and fails fast on)."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse an unreachable `ray_address` in seconds, naming the key and the address."""
    endpoint = address_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"ray_address={address!r}: nothing answers at {endpoint[0]}:{endpoint[1]} ({exc or 'timed out'} within "
            f"{timeout:.0f} s). Start the cluster there (`ray start --head`), fix the address, or set ray_address: "
            "null to start a local Ray instance") from None


@contextlib.contextmanager
def ray_session(cfg: DataConfig) -> Iterator[int]:
    """Join `cfg.ray_address` (None: start a local instance) unless Ray is already initialized in this process;
    yields the worker count (`num_workers`, or every CPU of the cluster). Shuts down only what it started."""
    import ray
    import ray.data

    started = not ray.is_initialized()
    if started:
        local = cfg.ray_address is None
        if not local:
            check_reachable(cfg.ray_address)
        try:
            ray.init(address=cfg.ray_address, include_dashboard=False if local else None,
                     num_cpus=(cfg.num_workers or None) if local else None,
                     runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
        except (ConnectionError, RuntimeError, ValueError) as exc:
            if local:
                raise
            raise ConfigError(f"ray_address={cfg.ray_address!r}: Ray could not join that cluster: {exc}. Start "
                              "it (`ray start --head`), fix the address, or set ray_address: null for a local "
                              "Ray instance") from exc
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
    block, so maps over task descriptors (`size="ranges"`) use large windows and large tasks."""

    def __init__(self, workers: int, window: int | None = None):
        self.workers = workers
        self.window = window  # tasks per execution, whatever `size` (None: by size and workers)
        self.tasks = 0  # Ray tasks (one block each) launched so far: what Ray Data's driver pays per
        self.maps: list[tuple[TaskSize, int]] = []  # each map run so far: its size class and its chunks

    def map(self, fn: Callable, tasks: Iterable, size: TaskSize = "ranges",
            setup: Callable[[], None] | None = None) -> Iterator:
        window, tasks_per_worker = map_shape(size, self.workers, self.window)
        return self._map(with_setup(fn, setup), tasks, window, tasks_per_worker, size)

    def concatenate(self, out: str | os.PathLike, parts: Iterable[Part]) -> None:
        """`out` written atomically as the parts' bytes in order: the workers copy each part to its offset (a kernel
        copy on the output's filesystem: no byte passes through the driver's node) and remove it, as the parts
        arrive (`copy_tasks`); the driver adds up the sizes, then syncs and renames the file
        (`fsutil.atomic_path`)."""
        with atomic_path(out) as tmp:
            for _ in self.map(copy_parts, copy_tasks(str(tmp), parts)):
                pass

    def _map(self, fn: Callable, chunks: Iterable, window: int, tasks_per_worker: int, size: TaskSize) -> Iterator:
        runner = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ray-window")
        failed: list[Exception] = []  # an error of `chunks` itself: raised after the chunks before it are yielded
        chunks_seen = 0
        try:
            running = None
            for first, items in self._windows(chunks, window, failed):
                chunks_seen += len(items)
                arrived: queue.SimpleQueue = queue.SimpleQueue()
                per_task = chunks_per_task(len(items), tasks_per_worker, self.workers)
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
            self.maps.append((size, chunks_seen))

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


# ---------------------------------------------------------------------------------------------- pipeline
def run_pipeline(cfg: DataConfig, run_stages: Callable[..., dict[str, dict]]) -> dict[str, dict]:
    """Every stage of `cfg.stages`, in pipeline order, in one Ray session; returns their report sections.
    `run_stages` is the driver's (`data.pipeline.run_stages`), passed in so that this module, which the driver
    imports, does not import it back."""
    with ray_session(cfg) as workers:
        return run_stages(cfg, RayExecutor(workers))
