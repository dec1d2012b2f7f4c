"""The engines' one interface: ordered maps of module-level worker functions over typed tasks, part directories,
and appending parts in order.

Every stage is one program over an `Executor`: the driver builds small task dataclasses (a byte range, a row
group, a slice of a plan), `executor.map(fn, tasks)` runs `fn` on each and yields the results in task order,
and the driver reduces them (accounting, the decisions that span ranges) and appends the parts the workers
wrote into its outputs (`concatenate`). `LocalExecutor` runs the workers in a local process pool;
`data.engine_ray.RayExecutor` on Ray Data. A stage never knows which one it has, so both engines write the same
bytes.

Worker functions and tasks must pickle: a function defined at module level (or a `functools.partial` of one),
tasks of plain values, numpy arrays and dataclasses. An exception a worker raises comes back with its own type
and message and is raised in task order (the results of earlier tasks are yielded first).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

from common.fsutil import atomic_writer, scratch_dir
from data.io import append_file, copy_into, jsonl_byte_ranges, ordered_parallel_map, read_lines

# How big a task is, which an executor may use to batch tasks: "records" (a chunk of records held in the task
# itself: few at a time), "ranges" (a descriptor: a byte range, a row group, a plan slice, an output shard).
TaskSize = Literal["records", "ranges"]


class Executor:
    """What a stage needs from an engine. Subclasses implement `map`; the rest is shared."""

    workers: int

    def map(self, fn: Callable, tasks: Iterable, size: TaskSize = "ranges",
            setup: Callable[[], None] | None = None) -> Iterator:
        """`fn(task)` for every task, yielded in task order. `setup()` runs once in each worker process before
        its first task (a tokenizer loaded once per process, not per task)."""
        raise NotImplementedError

    def scratch(self, near: str | os.PathLike, name: str) -> contextlib.AbstractContextManager[Path]:
        """A directory for the workers' parts on the output's filesystem (every worker must see it), removed with
        its content when the block ends."""
        return scratch_dir(near, name)

    def concatenate(self, out: str | os.PathLike, parts: Iterable["Part"]) -> None:
        """`out` written atomically (`fsutil.atomic_writer`) as the parts' bytes in order, each part removed once
        copied. Here the driver appends them (a kernel copy; on one machine, within the page cache);
        `RayExecutor` has its workers copy them."""
        with atomic_writer(out) as f:
            for part in parts:
                append_file(f, part.path)
                os.remove(part.path)


class LocalExecutor(Executor):
    """The local engine: `workers` processes of this machine (with 1, everything runs in this process, so the
    results never depend on the worker count)."""

    def __init__(self, workers: int):
        self.workers = max(1, int(workers))

    def map(self, fn: Callable, tasks: Iterable, size: TaskSize = "ranges",
            setup: Callable[[], None] | None = None) -> Iterator:
        return ordered_parallel_map(fn, tasks, self.workers, initializer=setup, start_method=pool_start_method())


def pool_start_method() -> str | None:
    """The platform's default (fork on Linux), except in a process that runs a Ray driver: a child forked from it
    inherits Ray's threads' locks and can hang before its first task (seen once in a full test run, the local engine
    beside the Ray tests' instance); the pool then starts its workers from a fork server, a fresh process."""
    ray = sys.modules.get("ray")
    return "forkserver" if ray is not None and ray.is_initialized() else None


_LAST_SETUP: bytes | None = None  # the setup this worker process ran last (Ray reuses processes across maps)


def call_after_setup(setup: Callable[[], None], fn: Callable, task):
    """`fn(task)`, `setup()` run first unless it was the last setup this process ran: how an executor whose
    workers are not started per map (Ray's) honours `Executor.map`'s `setup`."""
    global _LAST_SETUP
    key = pickle.dumps(setup)
    if key != _LAST_SETUP:
        setup()
        _LAST_SETUP = key
    return fn(task)


def with_setup(fn: Callable, setup: Callable[[], None] | None) -> Callable:
    """`fn`, or `fn` preceded once per process by `setup` (`call_after_setup`)."""
    return fn if setup is None else functools.partial(call_after_setup, setup, fn)


# ---------------------------------------------------------------------------------------------- shared tasks
@dataclasses.dataclass(frozen=True)
class Part:
    """A scratch file a worker wrote, a piece of a stage's output (`Executor.concatenate`): its path and size,
    read by the worker that wrote it (so the driver never stats a part)."""
    path: str
    size: int

    @classmethod
    def written(cls, path: str | os.PathLike) -> "Part":
        return cls(str(path), os.path.getsize(path))


@dataclasses.dataclass(frozen=True)
class PartCopy:
    """Worker task: each (part, offset) of `parts` copied into `out` at its offset (`copy_parts`)."""
    out: str
    parts: tuple[tuple[str, int], ...]


# Consecutive parts copied by one task (`PartCopy`) up to this many bytes: a copy costs little per byte, so few
# tasks (Ray Data's driver pays per task).
COPY_TASK_BYTES = 256 << 20


def copy_tasks(out: str, parts: Iterable[Part]) -> Iterator[PartCopy]:
    """The parts, in order, as `PartCopy` tasks of consecutive parts (up to `COPY_TASK_BYTES`, or one larger part),
    each at the offset where the parts before it end."""
    batch, batch_bytes, end = [], 0, 0
    for part in parts:
        if batch and batch_bytes + part.size > COPY_TASK_BYTES:
            yield PartCopy(out, tuple(batch))
            batch, batch_bytes = [], 0
        batch.append((part.path, end))
        batch_bytes += part.size
        end += part.size
    if batch:
        yield PartCopy(out, tuple(batch))


def copy_parts(task: PartCopy) -> None:
    """Worker: each part's bytes into the output file at its offset (a kernel copy), then the part removed."""
    for part, offset in task.parts:
        copy_into(part, task.out, offset)
        os.remove(part)


@dataclasses.dataclass(frozen=True)
class ByteRange:
    """Bytes `[start, end)` of a .jsonl file holding whole lines (`io.jsonl_byte_ranges`); `index`: its position
    among the file's ranges."""
    path: str
    start: int
    end: int
    index: int = 0


@dataclasses.dataclass(frozen=True)
class RangeCount:
    """What `count_lines` found in a range: its lines, and those not blank (the records)."""
    lines: int
    records: int


def byte_ranges(path: str | os.PathLike, target_bytes: int, start: int = 0) -> list[ByteRange]:
    """`path` from `start` cut into ranges of about `target_bytes` that end on a newline."""
    return [ByteRange(str(path), a, b, k) for k, (a, b) in enumerate(jsonl_byte_ranges(str(path), start, target_bytes))]


# A range-sized stage cuts its input into ranges of at most its own maximum, but no larger than a share of the file
# that gives every worker RANGES_PER_WORKER of them (down to MIN_RANGE_BYTES): a small input still keeps every
# worker busy. Results never depend on the ranges (each stage's tests vary them).
MIN_RANGE_BYTES = 64 << 10
RANGES_PER_WORKER = 4


def spread_ranges(path: str | os.PathLike, workers: int, max_bytes: int) -> list[ByteRange]:
    """`byte_ranges` of at most `max_bytes`, smaller for a small file (`RANGES_PER_WORKER` per worker)."""
    share = os.path.getsize(path) // (RANGES_PER_WORKER * workers)
    return byte_ranges(path, min(max_bytes, max(MIN_RANGE_BYTES, share)))


def count_lines(task: ByteRange) -> RangeCount:
    """Worker: the lines and non-blank lines of a range, split as iterating the file splits them."""
    lines = read_lines(task.path, task.start, task.end)
    return RangeCount(len(lines), sum(1 for line in lines if line.strip()))
