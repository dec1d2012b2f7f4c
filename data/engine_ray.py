"""`engine: ray`: the pipeline's stages on Ray Data, byte-identical to `engine: local`.

The stage modules do not know the engine: this module hands them Ray-backed versions of the only parts that
run in parallel, and every stage's own core, accounting and writers do the rest.
- preprocess, merge (token counts), tokenize: the project's own chunks (the same generators and readers as
  the local run, so `path:line` sources and error policies are unchanged) go, each with its chunk index, to
  Ray Data `map_batches` in windows of max(`MIN_WINDOW_CHUNKS`, `WINDOW_CHUNKS_PER_WORKER` x workers) chunks,
  several chunks per task; the next window runs while the driver consumes the current one. The driver puts
  each window's results back in chunk order (so it holds at most two windows), then writes as locally. Ray's
  `preserve_order` is set too, never relied on alone.
- sample: on the driver (the local core: a byte-offset index, a seeded plan, line copies).
- pack: the global best-fit plan on the driver from the length array; the rows are written by the workers,
  one task per output shard (cut by `shards.shard_ranges`, the writer's own rule), and the finished shards
  are appended in order (`ShardWriter.append_dataset`), so meta.json and checksums match the local run.
Workers read and write `output_dir` and `tokenizer_path` themselves: on a cluster every node must see them at
the same path (a shared filesystem). Chunks and results travel as pickled bytes (opaque binary columns; Ray
Data would otherwise infer Arrow types from our nested Python values) between this driver and its own workers.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import pickle
import shutil
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import orjson

from data import merge, pack, preprocess, sample, tokenize
from data.config import STAGES, DataConfig, to_dict
from data.shards import PackedDataset, ShardWriter, shard_ranges

# Chunks per Ray Data execution (a window): bounds the driver's memory (a chunk is <= 256 records) and amortizes
# the 0.3-1 s an execution takes to start. A task takes several chunks (a Ray task costs ~10-30 ms more than a
# local pool's): TASKS_PER_WORKER tasks per worker and window keep the workers balanced.
WINDOW_CHUNKS_PER_WORKER = 8
MIN_WINDOW_CHUNKS = 64
TASKS_PER_WORKER = 2


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
def _apply(batch: dict, fn: Callable) -> dict:
    """The Ray Data UDF: `fn` on each pickled chunk of the batch, the chunk index passed through."""
    results = [pickle.dumps(fn(pickle.loads(chunk)), protocol=pickle.HIGHEST_PROTOCOL) for chunk in batch["chunk"]]
    return {"index": batch["index"], "result": np.array(results, dtype=object)}


class RayChunkMap:
    """`parallel_map(fn, chunks)` on Ray Data: `fn(chunk)` for every chunk, yielded in chunk order.

    `fn` must be picklable (a module-level function or a partial of one). Chunks are read a window at a time;
    while the caller consumes one window's results, the next window runs on the workers, so the driver holds at
    most two windows of chunks and results."""

    def __init__(self, workers: int, window: int | None = None, chunks_per_task: int | None = None):
        self.workers = workers
        self.window = window or max(MIN_WINDOW_CHUNKS, WINDOW_CHUNKS_PER_WORKER * workers)
        self.chunks_per_task = chunks_per_task  # None: the window spread as TASKS_PER_WORKER tasks per worker

    def __call__(self, fn: Callable, chunks: Iterable) -> Iterator:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ray-window") as runner:
            running = None
            for items in self._windows(chunks):
                following = runner.submit(self._run_window, fn, items)
                if running is not None:
                    yield from map(pickle.loads, running.result())
                running = following
            if running is not None:
                yield from map(pickle.loads, running.result())

    def _windows(self, chunks: Iterable) -> Iterator[list[dict]]:
        items: list[dict] = []
        for index, chunk in enumerate(chunks):
            items.append({"index": index, "chunk": pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)})
            if len(items) >= self.window:
                yield items
                items = []
        if items:
            yield items

    def _run_window(self, fn: Callable, items: list[dict]) -> list[bytes]:
        """One Ray Data execution over a window; the pickled results in chunk order, whatever order Ray used."""
        import ray.data

        first = items[0]["index"]
        chunks_per_task = self.chunks_per_task or max(1, len(items) // (TASKS_PER_WORKER * self.workers))
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _apply, fn_args=(fn,), batch_size=chunks_per_task, batch_format="numpy",
            compute=ray.data.TaskPoolStrategy(size=self.workers))
        results: list[bytes | None] = [None] * len(items)
        for row in dataset.iter_rows():
            k = int(row["index"]) - first
            if not 0 <= k < len(items) or results[k] is not None:
                raise RuntimeError(f"Ray returned chunk {first + k} unexpectedly (window {first}..{first + len(items) - 1})")
            results[k] = row["result"]
        missing = [first + k for k, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"Ray returned no result for chunks {missing[:10]} (window {first}..{first + len(items) - 1})")
        return results


# ---------------------------------------------------------------------------------------------- tokenize
_TOKENIZE_CONFIG: bytes | None = None  # the config the worker's TokenizeContext was built from


def _tokenize_in_worker(cfg_dict: dict, chunk: list) -> tuple[list, int]:
    """`tokenize._tokenize_chunk` with the worker process's context, built once per config (Ray reuses
    worker processes across tasks, as a local pool does)."""
    global _TOKENIZE_CONFIG
    key = orjson.dumps(cfg_dict)
    if _TOKENIZE_CONFIG != key:
        tokenize._init_worker(cfg_dict)
        _TOKENIZE_CONFIG = key
    return tokenize._worker_chunk(chunk)


def tokenize_results(parallel_map: RayChunkMap, cfg: DataConfig, ctx, workers: int) -> Iterator[tuple[list, int]]:
    """`tokenize.run`'s ordered results: the local chunks of merged.jsonl, tokenized by the Ray workers."""
    return parallel_map(functools.partial(_tokenize_in_worker, to_dict(cfg)), tokenize.iter_chunks(cfg.merged_path))


# ---------------------------------------------------------------------------------------------- pack
def _write_part(task: tuple[str, list[str], int, str, str, list[list[int]]]) -> str:
    """Worker: one output shard, `rows` copied from the tokenized dataset by `pack.write_rows`, as a dataset
    of its own at `part_dir`."""
    src_path, token_fields, max_shard_bytes, kind, part_dir, rows = task
    src = PackedDataset(src_path)
    writer = ShardWriter(part_dir, token_fields=token_fields, max_shard_bytes=max_shard_bytes, kind=kind)
    with writer:
        pack.write_rows(writer, src, rows, np.asarray(src.row_n_tokens, dtype=np.int64))
        writer.close()
    return part_dir


def write_rows_on_workers(parallel_map: RayChunkMap, writer: ShardWriter, src: PackedDataset,
                          rows: list[list[int]], lengths: np.ndarray) -> None:
    """`pack.run`'s row writer: one Ray task per output shard, the shards appended to `writer` in order."""
    row_nbytes = [int(lengths[members].sum()) * writer.dtype.itemsize for members in rows]
    parts = writer.tmp_dir / "ray-parts"  # inside the writer's temp dir: an aborted writer removes it too
    parts.mkdir()
    tasks = ((str(src.path), writer.token_fields, writer.max_shard_bytes, writer.kind, str(parts / f"part_{k:05d}"),
              rows[start:end]) for k, (start, end) in enumerate(shard_ranges(row_nbytes, writer.max_shard_bytes)))
    with contextlib.closing(parallel_map(_write_part, tasks)) as part_dirs:
        for part_dir in part_dirs:
            writer.append_dataset(part_dir)
    shutil.rmtree(parts)  # empty, or the temp dirs of attempts Ray retried


# ---------------------------------------------------------------------------------------------- pipeline
def stage_runners(parallel_map: RayChunkMap) -> dict[str, Callable[[DataConfig], dict]]:
    """Each stage's `run` with its parallel part on Ray (sample runs on the driver). Pack's chunks are whole
    output shards (up to pack.shard_size_mb each): one per task."""
    shard_map = RayChunkMap(parallel_map.workers, chunks_per_task=1)
    return {
        "preprocess": functools.partial(preprocess.run, parallel_map=parallel_map),
        "sample": sample.run,
        "merge": functools.partial(merge.run, parallel_map=parallel_map),
        "tokenize": functools.partial(tokenize.run, ordered_results=functools.partial(tokenize_results, parallel_map)),
        "pack": functools.partial(pack.run, write=functools.partial(write_rows_on_workers, shard_map)),
    }


def run_pipeline(cfg: DataConfig) -> dict[str, dict]:
    """Every stage of `cfg.stages`, in pipeline order, in one Ray session; returns their report sections."""
    from data.pipeline import run_stage

    with ray_session(cfg) as workers:
        runners = stage_runners(RayChunkMap(workers))
        return {stage: run_stage(cfg, stage, runners[stage]) for stage in STAGES if stage in cfg.stages}
